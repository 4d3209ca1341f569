#!/usr/bin/env python
"""Step time and peak RSS of the recompute granularities, side by side, on CPU.

For the ``small`` preset (fp32, batch 1) at each length T (default 8,192 and 32,768 tokens), one
forward + backward of ``GenoLM.loss`` per configuration:

- ``full``: every block checkpointed (the baseline: backward rebuilds a whole layer at once);
- ``chunked``: ``memory.recompute: chunked`` (genolong.parallel.recompute.ChunkedBlockForward):
  the block inputs kept as under ``full``, each half of a block rebuilt separately,
  ``--chunk-tokens`` tokens at a time (default 4,096): the feed-forward half in token chunks,
  KDA attention halves in token segments carrying the state, DSA attention halves in query
  segments;
- ``selective``: the default selective kinds (``DEFAULT_SELECTIVE``), for reference.

Each run is its own process (``--child``), so its peak RSS (the child's ``ru_maxrss``, from
``os.wait4``) is its own; the configurations alternate within each round (A B C, then C B A) so a
machine that gets busier or quieter affects them alike, and each configuration's best round (least
step time) is compared: ratios against ``full`` of the same length (above 1 for time: slower than
full; below 1 for RSS: less memory). The step also runs under
:class:`genolong.memory.ActivationMeter` for the saved-activation bytes (deterministic). Peak RSS
includes what the heap's fragmentation holds (chunk-sized blocks are reused less tidily than
whole-layer ones), so one more run per configuration measures the live-bytes peak of the step
(every storage torch creates during it, counted while alive: deterministic, allocator-free). The
children allocate as the genolong commands do (``keep_freed_memory``; ``--allocator system``
for glibc's defaults). A run
whose RSS, extrapolated linearly from the shorter length, would not fit in 70% of the memory
available is skipped and marked so. One torch thread per child (``--threads``).

Example::

    python benchmarks/recompute_granularity.py                       # 8k (2 rounds) and 32k (1 round, full and chunked)
    python benchmarks/recompute_granularity.py --lengths 8192 --rounds 1

Prints a table and writes JSON (default benchmarks/results/recompute_granularity.json) after
every length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, mem_available_bytes, run_fresh, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "recompute_granularity.json"
CONFIGS = ("full", "chunked", "selective")
GiB = 2**30


def _techniques(config: str, chunk_tokens: int) -> dict[str, Any]:
    """parallelize() keyword arguments of a configuration."""
    return {
        "full": {"recompute": "full"},
        "chunked": {"recompute": "chunked", "recompute_chunk_tokens": chunk_tokens},
        "selective": {"recompute": "selective"},
    }[config]


def child(
    config: str,
    tokens: int,
    chunk_tokens: int,
    preset: str,
    threads: int,
    live: bool = False,
    allocator: str = "genolong",
) -> None:
    """One configuration's step in this process; prints its figures as one JSON line (with
    ``live``: the live-bytes peak of the step instead of its time)."""
    if allocator == "genolong":
        from genolong.allocator import keep_freed_memory

        keep_freed_memory()  # as every genolong command that runs a model does, before torch allocates
    import contextlib

    import torch

    from genolong.memory import ActivationMeter, LiveBytes
    from genolong.model import PRESETS, GenoLM
    from genolong.parallel import parallelize

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = parallelize(GenoLM(PRESETS[preset]), **_techniques(config, chunk_tokens))
    ids = torch.randint(1, 6, (1, tokens), generator=torch.Generator().manual_seed(1))
    tracker = LiveBytes() if live else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ActivationMeter(model) as meter, tracker:
        nll, weight = model.loss(ids)
        loss = nll / weight
        loss.backward()
    seconds = time.perf_counter() - t0
    if live:
        print(json.dumps({"live_peak_bytes": tracker.peak, "loss": loss.item()}))  # type: ignore[union-attr]
        return
    print(
        json.dumps(
            {
                "step_s": seconds,
                "loss": loss.item(),
                "saved_bytes": meter.peak_resident_bytes,
                "layer_saved_bytes": [layer.resident_bytes for layer in meter.layers],
                "meter_peak_rss_bytes": meter.peak_rss_bytes,
            }
        )
    )


def _run_child_rusage(config: str, tokens: int, a: argparse.Namespace, live: bool = False) -> dict[str, Any]:
    """Run one child; its figures plus the process's own peak RSS (``ru_maxrss``) and wall time."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        config,
        "--lengths",
        str(tokens),
        "--chunk-tokens",
        str(a.chunk_tokens),
        "--preset",
        a.preset,
        "--threads",
        str(a.threads),
        "--allocator",
        a.allocator,
    ] + (["--live"] if live else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    run = run_fresh(cmd, env=env).check()
    result = run.last_json()
    result["wall_s"] = run.wall_s
    result["peak_rss_bytes"] = run.peak_rss_bytes
    return result


def _summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each configuration's best round (least step time) and its ratios to ``full``'s."""
    best = {c: min(rs, key=lambda r: r["step_s"]) for c, rs in runs.items() if rs}
    row: dict[str, Any] = {"best": best, "runs": runs}
    if "full" in best:
        for c, b in best.items():
            row.setdefault("time_vs_full", {})[c] = b["step_s"] / best["full"]["step_s"]
            row.setdefault("peak_rss_vs_full", {})[c] = b["peak_rss_bytes"] / best["full"]["peak_rss_bytes"]
    return row


def _table(doc: dict[str, Any]) -> str:
    lines = [
        "| T | recompute | step s | time vs full | peak RSS GiB | peak RSS vs full | live-bytes peak GiB | vs full "
        "| saved (meter) GiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens, row in doc["lengths"].items():
        for c in CONFIGS:
            if c in row.get("skipped", {}):
                lines.append(f"| {int(tokens):,} | {c} | skipped: {row['skipped'][c]} | | | | |")
                continue
            b = row["best"].get(c)
            if b is None:
                continue
            tv = row.get("time_vs_full", {}).get(c)
            rv = row.get("peak_rss_vs_full", {}).get(c)
            lb = row.get("live_peak_bytes", {}).get(c)
            lr = row.get("live_peak_vs_full", {}).get(c)
            lines.append(
                f"| {int(tokens):,} | {c} | {b['step_s']:.1f} | {'' if tv is None else f'{tv:.2f}x'} | "
                f"{b['peak_rss_bytes'] / GiB:.2f} | {'' if rv is None else f'{rv:.2f}x'} | "
                f"{'' if lb is None else f'{lb / GiB:.2f}'} | {'' if lr is None else f'{lr:.2f}x'} | "
                f"{b['saved_bytes'] / GiB:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--lengths", default="8192,32768", help="tokens per step, comma-separated")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {', '.join(CONFIGS)}")
    parser.add_argument(
        "--long-configs",
        default="full,chunked",
        help="configurations for lengths over 16k (default full,chunked: selective at 32k needs ~15 GiB "
        "and ten minutes more on a 2-core machine)",
    )
    parser.add_argument(
        "--chunk-tokens", type=int, default=4096, help="chunked's recompute_chunk_tokens (default 4096)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per length (default 2; lengths over 16k: 1)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument(
        "--allocator",
        choices=("genolong", "system"),
        default="genolong",
        help="genolong: keep_freed_memory() as the genolong commands do (default); system: glibc's defaults",
    )
    parser.add_argument(
        "--no-live", action="store_true", help="skip the live-bytes pass (one more run per configuration)"
    )
    parser.add_argument("--live", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child is not None:
        child(a.child, int(a.lengths), a.chunk_tokens, a.preset, a.threads, a.live, a.allocator)
        return
    configs = [c for c in a.configs.split(",") if c]
    doc: dict[str, Any] = {
        "benchmark": "recompute_granularity",
        **environment("date"),
        "command": " ".join(sys.argv),
        **environment("machine", "cpus"),
        "preset": a.preset,
        "chunk_tokens": a.chunk_tokens,
        "threads": a.threads,
        "allocator": a.allocator,
        "lengths": {},
    }
    previous: dict[str, tuple[int, int]] = {}  # config -> (T, peak RSS) of its last length
    for tokens in (int(x) for x in a.lengths.split(",") if x):
        rounds = 1 if tokens > 16_384 else a.rounds
        skipped: dict[str, str] = {}
        if tokens > 16_384:
            long_configs = [c for c in a.long_configs.split(",") if c]
            skipped.update({c: "not run over 16k (--long-configs)" for c in configs if c not in long_configs})
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for c in configs:
            if c in previous and c not in skipped:
                t0, rss0 = previous[c]
                need = rss0 * tokens / t0
                if need > 0.7 * mem_available_bytes():
                    skipped[c] = (
                        f"needs ~{need / GiB:.1f} GiB (extrapolated), {mem_available_bytes() / GiB:.1f} GiB available"
                    )
        for round_ in range(rounds):
            order = configs if round_ % 2 == 0 else list(reversed(configs))
            for c in order:
                if c in skipped:
                    continue
                res = _run_child_rusage(c, tokens, a)
                runs[c].append(res)
                print(
                    f"T {tokens:>6} {c:>9} round {round_}: step {res['step_s']:.1f} s, peak RSS "
                    f"{res['peak_rss_bytes'] / GiB:.2f} GiB, saved {res['saved_bytes'] / GiB:.3f} GiB, "
                    f"loss {res['loss']:.6f}",
                    flush=True,
                )
        live: dict[str, int] = {}
        for c in configs:
            if runs[c] and not a.no_live:
                live[c] = _run_child_rusage(c, tokens, a, live=True)["live_peak_bytes"]
                print(f"T {tokens:>6} {c:>9} live-bytes peak {live[c] / GiB:.2f} GiB", flush=True)
        for c in configs:
            if runs[c]:
                previous[c] = (tokens, max(r["peak_rss_bytes"] for r in runs[c]))
        row = _summarise({c: rs for c, rs in runs.items() if rs})
        row["skipped"] = skipped
        row["live_peak_bytes"] = live
        if "full" in live:
            row["live_peak_vs_full"] = {c: v / live["full"] for c, v in live.items()}
        row["rounds"] = rounds
        doc["lengths"][str(tokens)] = row
        doc.update(environment("load_average_at_end"))
        write_json(a.json, doc)
    print()
    print(_table(doc))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()

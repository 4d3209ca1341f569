#!/usr/bin/env python
"""Whole-model training-step time and peak memory of the ``small`` preset against sequence length, CPU.

One step is ``GenoLM.loss`` (forward, chunked cross-entropy over the next-base targets) divided by
the weight sum, then backward into every parameter; batch 1, float32, random A/C/G/T tokens
(uppercase, so every target counts). Every measurement runs in its own fresh child process: it
builds the preset (seeded), runs one warm-up step at 1,024 tokens, records ``ru_maxrss`` (the
high-water mark so far), runs the timed step at T and records ``ru_maxrss`` again ("peak delta"
is what the step at T added). The lengths alternate within each of ``--repeats`` rounds (8k, 16k,
..., 8k, 16k, ...), so a burst of load on the shared machine hits every length alike; medians are
reported, of wall time and of the step's process CPU time (with one thread, CPU time is the work
done, less disturbed by other jobs on a shared machine). By default each block's activations are
recomputed in backward (``torch.utils.checkpoint`` around every block, applied by this script as a
trainer would): without it the peak RSS of ``small`` grew by ~630 KB per token (4k -> 8k), ~40 GB
at 64k. ``--malloc-mmap-threshold 131072`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` in the workers:
with glibc's default dynamic threshold, freed blocks of up to 32 MB stay in the heap and the RSS
high-water mark at 4k was 1.6x the one with the fixed threshold (1644 vs 1040 MiB, for +16% CPU
time). Growth is the step time at the longest length over the shortest; a linear-time model
grows by the token ratio (8x from 8k to 64k).

Target (issue 3): step time grows <= 9x from 8k to 64k tokens (8x the tokens).

Example::

    python benchmarks/model_scaling.py --threads 1              # small preset, T = 8k, 16k, 32k, 64k
    python benchmarks/model_scaling.py --lengths 2048,4096 --repeats 1 --json /tmp/scaling.json

Prints a table and writes JSON (default benchmarks/results/model_scaling.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import (  # noqa: E402
    environment,
    median_row,
    mem_available_bytes,
    peak_rss_bytes,
    sweep_arguments,
    sweep_fresh,
    write_json,
)

DEFAULT_JSON = HERE / "results" / "model_scaling.json"
WARMUP_T = 1024


def worker(a: argparse.Namespace) -> dict:
    """One timed training step of the preset at length ``a.T`` in this (fresh) process."""
    import torch

    from genolong.model import PRESETS, GenoLM

    peak = peak_rss_bytes
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GenoLM(PRESETS[a.preset])
    if a.recompute:
        # activation recomputation per block, applied from outside the model as a trainer would:
        # autograd keeps only each block's input streams; a block's intermediates live only while
        # that block runs (forward, then again in backward)
        from torch.utils.checkpoint import checkpoint

        for layer in model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)

    def step(tokens: torch.Tensor) -> tuple[float, float, float]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        nll, weight = model.loss(tokens)
        loss = nll / weight
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        return float(loss.detach()), t1 - t0, t2 - t1

    gen = torch.Generator().manual_seed(1)
    step(torch.randint(1, 5, (1, WARMUP_T), generator=gen, dtype=torch.uint8))
    base = peak()
    c0 = time.process_time()
    loss, fwd, bwd = step(torch.randint(1, 5, (1, a.T), generator=gen, dtype=torch.uint8))
    cpu = time.process_time() - c0
    end = peak()
    return {
        "T": a.T,
        "loss": loss,
        "fwd_s": fwd,
        "bwd_s": bwd,
        "step_s": fwd + bwd,
        "cpu_s": cpu,
        "base_peak_bytes": base,
        "peak_bytes": end,
        "peak_delta_bytes": end - base,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sweep_arguments(p, "8192,16384,32768,65536", DEFAULT_JSON)
    p.add_argument("--repeats", type=int, default=3, help="rounds over all lengths (fresh process each)")
    p.add_argument("--preset", default="small")
    p.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recompute each block's activations in backward (default on; --no-recompute keeps them)",
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in the workers: freed large blocks then go back "
        "to the OS instead of staying in the heap, so peak RSS tracks live tensors (costs page "
        "faults); default 0 = glibc's dynamic threshold",
    )
    p.add_argument(
        "--memory-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip a length whose peak RSS, extrapolated linearly from the two previous lengths, exceeds "
        "90%% of MemAvailable (default on; the machine is shared)",
    )
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0

    lengths = [int(x) for x in a.lengths.split(",") if x]
    print(
        f"{a.preset} GenoLM training step (loss fwd+bwd) on CPU, batch 1, fp32, {a.threads} threads, "
        f"{a.repeats} rounds, recompute {'on' if a.recompute else 'off'}, MALLOC_MMAP_THRESHOLD_ "
        f"{a.malloc_mmap_threshold or 'default'}; load {os.getloadavg()}",
        flush=True,
    )
    env = dict(os.environ)
    if a.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.malloc_mmap_threshold)
    skipped: dict[int, str] = {}

    def guard(T: int, runs: dict[int, list[dict]]) -> str | None:
        need, avail = _predicted_peak(runs, T), mem_available_bytes()
        if a.memory_guard and need is not None and avail and need > 0.9 * avail:
            return (
                f"predicted peak {need / 2**30:.1f} GiB (linear in T from the two previous lengths) "
                f"> 90% of the {avail / 2**30:.1f} GiB available"
            )
        return None

    def done(i: int, T: int, run: dict, runs: dict[int, list[dict]]) -> None:
        print(
            f"  round {i + 1}: T={T:>6} step {run['step_s']:7.2f} s (fwd {run['fwd_s']:.2f}, bwd "
            f"{run['bwd_s']:.2f}, cpu {run['cpu_s']:.2f}), peak {run['peak_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
        _write(a, argv, runs, skipped, complete=False)  # keep what was measured if a later run dies

    args = [f"--threads={a.threads}", f"--preset={a.preset}", "--recompute" if a.recompute else "--no-recompute"]
    runs, skips = sweep_fresh(__file__, lengths, args, a.repeats, env=env, skip=guard, done=done)
    skipped.update(skips)
    return 0 if _write(a, argv, runs, skipped, complete=True) else 1


def _predicted_peak(runs: dict[int, list[dict]], T: int) -> float | None:
    """Peak RSS at T extrapolated linearly from the two longest measured lengths below T."""
    done = sorted(t for t, rs in runs.items() if rs and t < T)
    if len(done) < 2:
        return None
    t1, t2 = done[-2], done[-1]
    p1 = max(r["peak_bytes"] for r in runs[t1])
    p2 = max(r["peak_bytes"] for r in runs[t2])
    return p2 + (p2 - p1) / (t2 - t1) * (T - t2)


def _write(
    a: argparse.Namespace, argv: list[str] | None, runs: dict[int, list[dict]], skipped: dict[int, str], complete: bool
) -> bool:
    """Summarise the runs so far, print the table when ``complete``, write the JSON; False if nothing ran."""
    lengths = [T for T in runs if runs[T]]
    if not lengths:
        print("no length ran", file=sys.stderr)
        return False
    rows = []
    t0 = lengths[0]
    show = print if complete else (lambda *args, **kwargs: None)
    show(
        f"{'T':>7} {'step s':>8} {'fwd s':>7} {'bwd s':>7} {'cpu s':>7} {'tok/s':>7} {'growth':>7} {'cpu gr':>7} {'tokens':>7} "
        f"{'peak MiB':>9} {'dpeak MiB':>9} {'dpeak B/tok':>11}"
    )
    for T in lengths:
        row = median_row(T, runs[T], ("fwd_s", "bwd_s", "step_s", "cpu_s", "peak_bytes", "peak_delta_bytes"))
        rows.append(row)
        row["tokens_per_s"] = T / row["step_s"]
        row["growth_vs_first"] = row["step_s"] / rows[0]["step_s"]
        row["cpu_growth_vs_first"] = row["cpu_s"] / rows[0]["cpu_s"]
        row["token_ratio_vs_first"] = T / t0
        row["peak_delta_bytes_per_token"] = row["peak_delta_bytes"] / T
        show(
            f"{T:>7} {row['step_s']:>8.2f} {row['fwd_s']:>7.2f} {row['bwd_s']:>7.2f} {row['cpu_s']:>7.2f} {row['tokens_per_s']:>7.0f} "
            f"{row['growth_vs_first']:>6.2f}x {row['cpu_growth_vs_first']:>6.2f}x {row['token_ratio_vs_first']:>6.0f}x {row['peak_bytes'] / 2**20:>9.0f} "
            f"{row['peak_delta_bytes'] / 2**20:>9.0f} {row['peak_delta_bytes_per_token']:>11.0f}"
        )
    growth = rows[-1]["step_s"] / rows[0]["step_s"]
    cpu_growth = rows[-1]["cpu_s"] / rows[0]["cpu_s"]
    for T, why in skipped.items():
        show(f"{T:>7} skipped: {why}")
    show(
        f"growth {lengths[-1]}/{lengths[0]}: {growth:.2f}x wall, {cpu_growth:.2f}x CPU for {lengths[-1] / lengths[0]:.0f}x tokens "
        f"(target <= {9 * lengths[-1] / lengths[0] / 8:.2f}x)"
    )
    out = {
        "benchmark": "model_scaling",
        "command": "model_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **environment("date"),
        "target": "step time growth <= 9x from 8k to 64k tokens",
        "growth": growth,
        "cpu_growth": cpu_growth,
        "config": {
            "preset": a.preset,
            "recompute": a.recompute,
            "malloc_mmap_threshold": a.malloc_mmap_threshold or None,
            "batch": 1,
            "dtype": "float32",
            "threads": a.threads,
            "repeats": a.repeats,
            "warmup_tokens": WARMUP_T,
        },
        "machine": environment("cpus", "platform", "python", "torch", "loadavg_at_end"),
        "rows": rows,
        "skipped": {str(T): why for T, why in skipped.items()},
        "complete": complete,
    }
    write_json(a.json, out)
    show(f"wrote {a.json}")
    return True


if __name__ == "__main__":
    sys.exit(main())

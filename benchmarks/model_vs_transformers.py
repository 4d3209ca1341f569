#!/usr/bin/env python
"""genolong's ``tiny`` model against transformers' implementation of the same config, CPU fwd+bwd.

Both sides get the same weights (loaded by name) and the same tokens:

- ours: ``genolong.model.GenoLM(PRESETS["tiny"])``, logits from ``GenoLM.logits``;
- transformers: ``Glm5NextTextModel(Glm5NextTextConfig(**config.to_hf_dict()))`` plus a
  ``Linear`` LM head, ``use_cache=False``, its default attention implementation, run where fla
  cannot be imported (``sys.modules["fla"] = None`` before importing transformers; otherwise it
  routes KDA to fla's Triton kernel, which fails on CPU).

One step is: forward, next-token cross-entropy over the ``[T, vocab]`` logits (mean), backward
into every parameter; batch 1, float32, B=1 random A/C/G/T ids. Every measurement runs in its own
fresh child process (so peak RSS is per side and per T): the child builds the model, loads the
shared weights, runs one warm-up step at 256 tokens, records ``ru_maxrss`` (the high-water mark,
imports and weights included), runs the timed step at T and records ``ru_maxrss`` again; "peak
delta" is the difference (what the step at T added) and "peak" the absolute high-water mark. The
children alternate (ours, transformers, ours, ...) for ``--repeats`` rounds; medians are reported,
of wall time and of the step's process CPU time (with one thread, CPU time is the work done and
is less disturbed by other jobs on a shared machine than wall time).
The two losses are compared as a check that both sides computed the same model.

Target (issue 3): ours >= 3x faster than transformers and lower peak memory, at 2k-16k tokens.

Example::

    python benchmarks/model_vs_transformers.py --threads 1              # T = 2k, 4k, 8k, 16k
    python benchmarks/model_vs_transformers.py --lengths 2048 --repeats 1 --json /tmp/mvt.json

Prints a table and writes JSON (default benchmarks/results/model_vs_transformers.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, peak_rss_bytes, run_fresh, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "model_vs_transformers.json"
WARMUP_T = 256


def _build(side: str, preset: str, state_path: str):
    """(step function taking ids [1, T] and returning the loss tensor, parameters) for one side."""
    import torch
    import torch.nn.functional as F

    from genolong.model import PRESETS

    config = PRESETS[preset]
    state = torch.load(state_path, weights_only=True)
    if side == "ours":
        from genolong.model import GenoLM

        model = GenoLM(config)
        model.load_state_dict(state, strict=True)

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            return model.logits(model(ids))

        params = list(model.parameters())
    else:
        sys.modules["fla"] = None  # type: ignore[assignment]  # transformers must not route KDA to fla
        from transformers import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        hf_config = Glm5NextTextConfig(**config.to_hf_dict())
        model = Glm5NextTextModel(hf_config)
        head = torch.nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        head_state = {"weight": state.pop("lm_head.weight")}
        model.load_state_dict(state, strict=True)
        head.load_state_dict(head_state, strict=True)

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            return head(model(input_ids=ids, use_cache=False).last_hidden_state)

        params = [*model.parameters(), *head.parameters()]

    def step(ids: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        logits = logits_of(ids)
        loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        return loss.detach(), t1 - t0, t2 - t1

    return step


def worker(a: argparse.Namespace) -> dict:
    """One timed step of one side at length ``a.T`` in this (fresh) process."""
    import torch

    torch.set_num_threads(a.threads)
    step = _build(a.worker, a.preset, a.state)
    gen = torch.Generator().manual_seed(1)
    step(torch.randint(1, 5, (1, WARMUP_T), generator=gen))
    base = peak_rss_bytes()
    ids = torch.randint(1, 5, (1, a.T), generator=torch.Generator().manual_seed(a.T))
    c0 = time.process_time()
    loss, fwd, bwd = step(ids)
    cpu = time.process_time() - c0
    end = peak_rss_bytes()
    return {
        "side": a.worker,
        "T": a.T,
        "loss": float(loss),
        "fwd_s": fwd,
        "bwd_s": bwd,
        "step_s": fwd + bwd,
        "cpu_s": cpu,
        "base_peak_bytes": base,
        "peak_bytes": end,
        "peak_delta_bytes": end - base,
        "threads": torch.get_num_threads(),
    }


def _run_child(side: str, T: int, a: argparse.Namespace, state: str) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        f"--worker={side}",
        f"--T={T}",
        f"--state={state}",
        f"--threads={a.threads}",
        f"--preset={a.preset}",
    ]
    r = run_fresh(cmd)
    if not r.ok:
        raise RuntimeError(f"{side} at T={T} failed:\n{r.output.strip()[-3000:]}")
    return r.last_json()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", default="2048,4096,8192,16384", help="comma-separated T values")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (ours, transformers) per T")
    p.add_argument(
        "--hf-repeats-above",
        type=int,
        default=8192,
        help="above this T, transformers runs once per T (it is slow); ours keeps --repeats",
    )
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="torch threads, both sides")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0, help="seed of the shared random weights")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--worker", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--state", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0

    import torch

    from genolong.model import PRESETS, GenoLM

    lengths = [int(x) for x in a.lengths.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="genolong-mvt-") as tmp:
        # the shared weights: genolong's initialisation of the preset, saved once, loaded by name on both sides
        torch.manual_seed(a.seed)
        state = str(Path(tmp) / "state.pt")
        torch.save(GenoLM(PRESETS[a.preset]).state_dict(), state)
        print(
            f"{a.preset} model fwd+bwd on CPU, batch 1, fp32, {a.threads} threads, medians of up to {a.repeats} "
            f"interleaved fresh-process runs; load {os.getloadavg()}"
        )
        print(
            f"{'T':>6} {'ours s':>8} {'hf s':>8} {'speedup':>8} {'cpu spd':>8} {'ours peak':>10} {'hf peak':>9} "
            f"{'ours dpeak':>10} {'hf dpeak':>9} {'mem ratio':>9} {'loss diff':>9}"
        )
        rows = []
        for T in lengths:
            runs: dict[str, list[dict]] = {"ours": [], "transformers": []}
            for i in range(a.repeats):
                runs["ours"].append(_run_child("ours", T, a, state))
                if i == 0 or T <= a.hf_repeats_above:
                    runs["transformers"].append(_run_child("transformers", T, a, state))
            row: dict = {"T": T, "runs": runs}
            for side, rs in runs.items():
                row[side] = {
                    key: statistics.median(r[key] for r in rs)
                    for key in (
                        "fwd_s",
                        "bwd_s",
                        "step_s",
                        "cpu_s",
                        "peak_bytes",
                        "peak_delta_bytes",
                        "base_peak_bytes",
                    )
                }
                row[side]["repeats"] = len(rs)
            o, h = row["ours"], row["transformers"]
            row["speedup"] = h["step_s"] / o["step_s"]
            row["speedup_cpu"] = h["cpu_s"] / o["cpu_s"]
            row["peak_ratio_hf_over_ours"] = h["peak_bytes"] / o["peak_bytes"]
            row["peak_delta_ratio_hf_over_ours"] = h["peak_delta_bytes"] / max(o["peak_delta_bytes"], 1)
            lo, lh = runs["ours"][0]["loss"], runs["transformers"][0]["loss"]
            row["loss_ours"], row["loss_transformers"], row["loss_abs_diff"] = lo, lh, abs(lo - lh)
            rows.append(row)
            mib = 2**20
            print(
                f"{T:>6} {o['step_s']:>8.2f} {h['step_s']:>8.2f} {row['speedup']:>7.1f}x {row['speedup_cpu']:>7.1f}x "
                f"{o['peak_bytes'] / mib:>8.0f}Mi {h['peak_bytes'] / mib:>7.0f}Mi {o['peak_delta_bytes'] / mib:>8.0f}Mi "
                f"{h['peak_delta_bytes'] / mib:>7.0f}Mi {row['peak_delta_ratio_hf_over_ours']:>8.1f}x "
                f"{row['loss_abs_diff']:>9.1e}",
                flush=True,
            )

    from importlib.metadata import version

    out = {
        "benchmark": "model_vs_transformers",
        "command": "model_vs_transformers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **environment("date"),
        "targets": {"speedup": ">= 3x", "peak_memory": "ours lower"},
        "config": {
            "preset": a.preset,
            "hf_config": PRESETS[a.preset].to_hf_dict(),
            "batch": 1,
            "dtype": "float32",
            "threads": a.threads,
            "repeats": a.repeats,
            "hf_repeats_above": a.hf_repeats_above,
            "warmup_tokens": WARMUP_T,
            "loss": "mean next-token cross-entropy over full logits",
        },
        "machine": {
            **environment("cpus", "platform", "python", "torch"),
            "transformers": version("transformers"),
            **environment("loadavg_at_end"),
        },
        "rows": rows,
    }
    write_json(a.json, out)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Training step time and peak memory of full, attention-only and LoRA training of ``small`` (CPU).

Three settings, each built the way ``genolong finetune`` builds it (``GenoLMModule`` over the
bundled base ``data/sample/base``, with the recipe's memory techniques: selective recompute of the
KDA and DSA cores):

- ``full``: ``recipes/quickstart.yaml`` with ``model.freeze`` emptied (every parameter trains);
- ``attention``: ``recipes/quickstart.yaml`` as shipped (``model.freeze``: everything but the
  attention layers frozen, :func:`genolong.train.module.freeze_parameters`);
- ``lora``: ``recipes/quickstart-lora.yaml`` (``model.lora``: rank 16, alpha 32 on
  ``layers.*.self_attn.*``, :func:`genolong.model.lora.apply_lora`; every base weight frozen).

A step is the module's ``training_step`` (forward, loss with the indexer KL), ``backward``, the
recipe's gradient clipping (norm 1.0 over the trained parameters) and the ``AdamW`` step of
``configure_optimizers``, then ``zero_grad``. Each (setting, T) runs in a fresh process
(``_bench.run_fresh``: its own peak RSS): the model is built, one warm-up step of
``--warmup-tokens`` tokens creates the optimiser state, then ``--steps`` timed steps of T tokens
(random A/C/G/T, the same tokens in every setting). The processes run interleaved (full,
attention, lora, full, attention, lora, ...) for ``--repeats`` rounds at each length
(``--repeats-32k`` at 32k and above, where a step takes minutes), so load changes on a shared
machine hit every setting alike; the table shows medians and each setting's step time as a
ratio to ``full`` of the same round (median and range over rounds).

Held bytes: :func:`genolong.train.callbacks.held_bytes` after the timed step's optimiser step
(parameters, gradients present then, ``AdamW`` state), as the training log's ``memory/*``.

Example::

    python benchmarks/lora_step.py                                   # 8k and 32k
    python benchmarks/lora_step.py --lengths 8192 --repeats 3

Prints a table and writes JSON (default benchmarks/results/lora_step.json) after every length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, run_fresh, write_json  # noqa: E402

ROOT = HERE.parent
DEFAULT_JSON = HERE / "results" / "lora_step.json"
MiB = 2**20

#: setting -> (recipe under recipes/, --set overrides)
SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "full": ("quickstart.yaml", ("model.freeze=[]",)),
    "attention": ("quickstart.yaml", ()),
    "lora": ("quickstart-lora.yaml", ()),
}


def build_module(setting: str) -> Any:
    """The configured ``GenoLMModule`` of ``setting`` as ``genolong finetune`` builds it (one process)."""
    import functools

    import torch

    from genolong.config import load_recipe
    from genolong.train import GenoLMModule, OptimSettings
    from genolong.train.finetune import _build_model, _parallelize

    name, overrides = SETTINGS[setting]
    recipe = load_recipe(ROOT / "recipes" / name, overrides)
    t = recipe.train
    module = GenoLMModule(
        build_model=functools.partial(_build_model, recipe),
        optim=OptimSettings(
            lr=t.lr,
            min_lr=t.min_lr,
            warmup_steps=t.warmup_steps,
            max_steps=t.max_steps,
            weight_decay=t.weight_decay,
            betas=t.betas,
            eps=t.eps,
            moe_bias_rate=t.moe_bias_update_rate,
            moe_bias_update=t.moe_bias_update,
            moe_balance_loss_weight=t.moe_balance_loss_weight,
        ),
        parallelize=functools.partial(_parallelize, recipe),
        softmask_weight=recipe.model.softmask_weight,
        ce_chunk_tokens=recipe.memory.ce_chunk_tokens,
        freeze=recipe.model.freeze,
        lora=recipe.model.lora,
        frozen_dtype=torch.bfloat16 if t.precision == "bf16-mixed" else None,
        indexer_kl_weight=t.indexer_kl_weight,
        moe_capacity_factor=recipe.memory.moe_capacity_factor,
    )
    module.configure_model()
    module.grad_clip = t.grad_clip
    return module


def worker(setting: str, T: int, steps: int, warmup_tokens: int, threads: int) -> dict[str, Any]:
    """Build ``setting``, take a warm-up step and ``steps`` timed steps of ``T`` tokens; the figures."""
    import time
    import warnings

    import torch
    from _bench import peak_rss_bytes

    from genolong.train.callbacks import held_bytes

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message=".*self.log.*")  # no trainer: nothing is logged
    module = build_module(setting)
    optimizer = module.configure_optimizers()["optimizer"]
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    rss_built = peak_rss_bytes()

    def step(tokens: torch.Tensor) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = module.training_step({"tokens": tokens}, 0)
        loss.backward()
        if module.grad_clip:
            torch.nn.utils.clip_grad_norm_(trained, module.grad_clip)
        optimizer.step()
        return time.perf_counter() - t0, float(loss.detach())

    generator = torch.Generator().manual_seed(T)
    step(torch.randint(1, 5, (1, warmup_tokens), generator=torch.Generator().manual_seed(1)))
    optimizer.zero_grad(set_to_none=True)
    tokens = torch.randint(1, 5, (1, T), generator=generator)
    seconds, losses, cpu = [], [], []
    for _ in range(steps):
        c0 = time.process_time()
        s, loss = step(tokens)
        cpu.append(time.process_time() - c0)
        seconds.append(s)
        losses.append(loss)
        held = held_bytes(module.model, [optimizer])  # gradients still present
        optimizer.zero_grad(set_to_none=True)
    return {
        "setting": setting,
        "T": T,
        "step_seconds": seconds,
        "step_cpu_seconds": cpu,
        "losses": losses,
        "held": held,
        "peak_rss_after_build_bytes": rss_built,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def held_total(held: dict[str, float]) -> float:
    return held["memory/parameter_bytes"] + held["memory/gradient_bytes"] + held["memory/optimizer_bytes"]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per setting: medians, and per round the step time over ``full``'s of the same round."""
    out: dict[str, Any] = {}
    for setting, rs in runs.items():
        step_s = [statistics.median(r["step_seconds"]) for r in rs]
        row = {
            "rounds": len(rs),
            "step_seconds_median": statistics.median(step_s),
            "step_seconds_per_round": step_s,
            "cpu_seconds_median": statistics.median(statistics.median(r["step_cpu_seconds"]) for r in rs),
            "peak_rss_bytes_median": statistics.median(r["peak_rss_bytes"] for r in rs),
            "peak_rss_bytes_per_round": [r["peak_rss_bytes"] for r in rs],
            "trained_params": int(rs[0]["held"]["params/trained"]),
            "frozen_params": int(rs[0]["held"]["params/frozen"]),
            "held": rs[0]["held"],
            "held_bytes": held_total(rs[0]["held"]),
        }
        if "full" in runs and setting != "full":
            ratios = [a / b for a, b in zip(step_s, [statistics.median(r["step_seconds"]) for r in runs["full"]])]
            row["time_vs_full_per_round"] = ratios
            row["time_vs_full_median"] = statistics.median(ratios)
            cpu = [statistics.median(r["step_cpu_seconds"]) for r in rs]
            cpu_ratios = [a / b for a, b in zip(cpu, [statistics.median(r["step_cpu_seconds"]) for r in runs["full"]])]
            row["cpu_vs_full_per_round"] = cpu_ratios
            row["cpu_vs_full_median"] = statistics.median(cpu_ratios)
            row["peak_rss_vs_full"] = row["peak_rss_bytes_median"] / statistics.median(
                r["peak_rss_bytes"] for r in runs["full"]
            )
        out[setting] = row
    return out


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| T | setting | trained params | held: params + grads + AdamW | step s (median) | step / full (range) "
        "| CPU s | CPU / full (range) | peak RSS (range) | RSS / full | rounds |",
        "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for T, rows in doc["lengths"].items():
        for setting, r in rows["summary"].items():
            h = r["held"]
            held = (
                f"{r['held_bytes'] / MiB:.1f} MiB ({h['memory/parameter_bytes'] / MiB:.1f} + "
                f"{h['memory/gradient_bytes'] / MiB:.1f} + {h['memory/optimizer_bytes'] / MiB:.1f})"
            )
            if "time_vs_full_median" in r:
                ratio = (
                    f"{r['time_vs_full_median']:.2f} ({min(r['time_vs_full_per_round']):.2f}-"
                    f"{max(r['time_vs_full_per_round']):.2f})"
                )
                cpu = (
                    f"{r['cpu_vs_full_median']:.3f} ({min(r['cpu_vs_full_per_round']):.3f}-"
                    f"{max(r['cpu_vs_full_per_round']):.3f})"
                )
                rss = f"{r['peak_rss_vs_full']:.2f}"
            else:
                ratio, cpu, rss = "1", "1", "1"
            peaks = r["peak_rss_bytes_per_round"]
            lines.append(
                f"| {int(T) // 1024}k | {setting} | {r['trained_params']:,} | {held} | {r['step_seconds_median']:.1f} "
                f"| {ratio} | {r['cpu_seconds_median']:.1f} | {cpu} | {r['peak_rss_bytes_median'] / MiB:,.0f} MiB "
                f"({min(peaks) / MiB:,.0f}-{max(peaks) / MiB:,.0f}) | {rss} | {r['rounds']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", default="8192,32768", help="tokens per step, comma-separated (default: %(default)s)"
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds below 32k (default: %(default)s)")
    parser.add_argument("--repeats-32k", type=int, default=1, help="rounds at 32k and above (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per process (default: %(default)s)")
    parser.add_argument(
        "--warmup-tokens", type=int, default=1024, help="tokens of the warm-up step (default: %(default)s)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    parser.add_argument(
        "--table", action="store_true", help="print the table of --json (summaries recomputed) and stop"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.table:
        doc = json.loads(a.json.read_text())
        for length in doc["lengths"].values():
            length["summary"] = summarize(length["runs"])
        write_json(a.json, doc)
        print(table(doc))
        return
    if a.worker is not None:
        setting, T = a.worker.split(":")
        print(json.dumps(worker(setting, int(T), a.steps, a.warmup_tokens, a.threads)))
        return
    settings = a.settings.split(",")
    doc: dict[str, Any] = {
        "benchmark": "lora_step",
        **environment("date", "host", "cpus", "platform", "python", "torch", "loadavg_at_start"),
        "threads": a.threads,
        "steps_per_process": a.steps,
        "warmup_tokens": a.warmup_tokens,
        "settings": {s: {"recipe": SETTINGS[s][0], "set": list(SETTINGS[s][1])} for s in settings},
        "lengths": {},
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    for T in (int(x) for x in a.lengths.split(",")):
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
        rounds = a.repeats if T < 32768 else a.repeats_32k
        for r in range(rounds):
            for setting in settings:
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    f"{setting}:{T}",
                    "--steps",
                    str(a.steps),
                    "--warmup-tokens",
                    str(a.warmup_tokens),
                    "--threads",
                    str(a.threads),
                ]
                fresh = run_fresh(cmd, env=env, cwd=ROOT).check()
                res = fresh.last_json()
                res.update(
                    peak_rss_bytes=fresh.peak_rss_bytes,
                    process_wall_s=fresh.wall_s,
                    process_cpu_s=fresh.user_s + fresh.system_s,
                    loadavg=os.getloadavg(),
                )
                runs[setting].append(res)
                print(
                    f"T={T} round {r} {setting}: step {statistics.median(res['step_seconds']):.1f} s "
                    f"(CPU {statistics.median(res['step_cpu_seconds']):.1f} s), peak RSS {fresh.peak_rss_bytes / MiB:,.0f} MiB, "
                    f"trained {int(res['held']['params/trained']):,}, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        doc["lengths"][str(T)] = {"rounds": rounds, "runs": runs, "summary": summarize(runs)}
        doc.update(environment("loadavg_at_end"))
        write_json(a.json, doc)
    print()
    print(table(doc))
    print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()

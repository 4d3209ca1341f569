#!/usr/bin/env python
"""CPU runs with and without genolong's allocator setting: wall, user and system time, page faults
and peak RSS of whole ``genolong`` commands, side by side.

Each case runs as a fresh ``genolong`` process per allocator variant, alternating the order every
round (A B, then B A) so that a machine that gets busier or quieter affects both alike:

- ``system``: glibc's defaults (``GENOLONG_MALLOC=system``), what genolong did before;
- ``genolong``: the default now, :func:`genolong.allocator.keep_freed_memory` at start-up;
- with ``--jemalloc``: ``jemalloc``, jemalloc through ``LD_PRELOAD`` with its defaults, and
  ``jemalloc-keep``, with its decay turned off (``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``:
  freed pages kept, as genolong's glibc setting does), when a ``libjemalloc.so.2`` is installed
  (Debian: ``libjemalloc2``).

Cases (the bundled base ``small`` model, fp32, on the bundled sample prepared into a temporary
directory):

- ``evaluate L``: ``genolong evaluate BASE --context L --max-tiles 1`` (the per-token table and
  every aggregate written), L = 8,192, 65,536, 262,144 by default;
- ``finetune L``: ``genolong finetune recipes/quickstart.yaml`` at ``data.context=L`` for
  ``--steps`` optimiser steps (no evaluation, no checkpoint, no export), L = 8,192, 32,768; besides
  the whole command, the median ``perf/step_time_s`` of the steps after the first (from
  steps.jsonl).

Times and faults come from ``os.wait4`` (the child's own rusage); peak RSS is its ``ru_maxrss``.
Ratios are system / variant, of each variant's best run (least wall time over the rounds: the run
least disturbed on a shared machine; all runs are in the JSON): above 1 means the variant is
faster.

Example::

    python benchmarks/cpu_allocator.py                                  # all cases, 2 rounds (long ones: 1)
    python benchmarks/cpu_allocator.py --evaluate 65536 --finetune '' --jemalloc
    python benchmarks/cpu_allocator.py --evaluate 8192 --finetune 8192 --rounds 1

Prints a table and writes JSON (default benchmarks/results/cpu_allocator.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, run_fresh, write_json  # noqa: E402

ROOT = HERE.parent
DEFAULT_JSON = HERE / "results" / "cpu_allocator.json"
JEMALLOC = [
    Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
    Path("/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"),
    Path("/usr/lib/libjemalloc.so.2"),
]


def _variants(with_jemalloc: bool) -> dict[str, dict[str, str]]:
    """Environment changes of each allocator variant."""
    variants = {"system": {"GENOLONG_MALLOC": "system"}, "genolong": {"GENOLONG_MALLOC": "keep"}}
    found = next((p for p in JEMALLOC if p.exists()), None)
    if with_jemalloc:
        if found is None:
            sys.exit("--jemalloc: no libjemalloc.so.2 installed (Debian: apt-get install libjemalloc2)")
        variants["jemalloc"] = {"LD_PRELOAD": str(found)}
        variants["jemalloc-keep"] = {"LD_PRELOAD": str(found), "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    return variants


def _run(cmd: list[str], env_changes: dict[str, str], cwd: Path) -> dict[str, float]:
    """Run ``cmd``; wall, user, system seconds, minor faults and peak RSS (bytes) of the child."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GENOLONG_MALLOC", "GLIBC_TUNABLES"))}
    env.pop("LD_PRELOAD", None)
    env.update(env_changes)
    run = run_fresh(cmd, env=env, cwd=cwd).check()
    return {
        "wall_s": run.wall_s,
        "user_s": run.user_s,
        "system_s": run.system_s,
        "minor_faults": float(run.minor_faults),
        "peak_rss_bytes": float(run.peak_rss_bytes),
    }


def _step_time(logs: Path) -> float:
    """Median step time of the steps after the first (the first pays one-time set-up)."""
    records = [json.loads(line) for line in (logs / "steps.jsonl").read_text().splitlines()]
    times = [r["perf/step_time_s"] for r in records if "perf/step_time_s" in r][1:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument(
        "--evaluate", default="8192,65536,262144", help="evaluate tile lengths, comma-separated ('' for none)"
    )
    parser.add_argument(
        "--finetune", default="8192,32768", help="finetune window lengths, comma-separated ('' for none)"
    )
    parser.add_argument("--steps", type=int, default=2, help="finetune optimiser steps per run (default 2)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds per case (default 2; evaluate over 100k and finetune over 16k tokens: 1)",
    )
    parser.add_argument(
        "--jemalloc", action="store_true", help="also jemalloc through LD_PRELOAD, with and without decay"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--table", type=Path, metavar="JSON", help="print the table of a saved result and stop")
    a = parser.parse_args()
    if a.table is not None:
        doc = json.loads(a.table.read_text())
        doc["rows"] = [_summarise(r["case"], r["tokens"], r["rounds"], r["runs"]) for r in doc["rows"]]
        _print_table(doc)
        return

    from genolong.quickstart import bundled_base, prepare_sample

    variants = _variants(a.jemalloc)
    genolong = [sys.executable, "-m", "genolong.cli"]
    work = Path(tempfile.mkdtemp(prefix="genolong-alloc-bench-"))
    cases: list[tuple[str, int]] = [("evaluate", int(x)) for x in a.evaluate.split(",") if x]
    cases += [("finetune", int(x)) for x in a.finetune.split(",") if x]
    rows: list[dict[str, Any]] = []
    try:
        prepare_sample(work / "genome", progress=False)
        base = bundled_base()
        for kind, length in cases:
            rounds = 1 if (length > 100_000 or (kind == "finetune" and length > 16_384)) else a.rounds
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for round_ in range(rounds):
                order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
                for variant in order:
                    out = work / f"{kind}-{length}-{variant}-{round_}"
                    if kind == "evaluate":
                        cmd = [
                            *genolong,
                            "evaluate",
                            str(base),
                            "--store",
                            str(work / "genome"),
                            "--context",
                            str(length),
                            "--max-tiles",
                            "1",
                            "--out",
                            str(out),
                            "--quiet",
                        ]
                    else:
                        cmd = [
                            *genolong,
                            "finetune",
                            str(ROOT / "recipes" / "quickstart.yaml"),
                            "--set",
                            f"name=alloc-{length}-{variant}-{round_}",
                            "--set",
                            f"data.store={work / 'genome'}",
                            "--set",
                            f"model.checkpoint={base}",
                            "--set",
                            f"data.context={length}",
                            "--set",
                            f"train.max_steps={a.steps}",
                            "--set",
                            "eval.every_n_steps=0",
                            "--set",
                            f"checkpoint.dir={out / 'checkpoints'}",
                            "--set",
                            f"checkpoint.every_n_steps={a.steps}",
                            "--set",
                            "checkpoint.export_safetensors=false",
                            "--set",
                            f"logging.dir={out / 'logs'}",
                            "--set",
                            "logging.progress_bar=false",
                            "--set",
                            "logging.tensorboard=false",
                        ]
                    measured = _run(cmd, variants[variant], work)
                    if kind == "finetune":
                        measured["step_s"] = _step_time(out / "logs")
                    runs[variant].append(measured)
                    print(
                        f"{kind} {length:>7} {variant:>8} round {round_}: "
                        + ", ".join(
                            f"{k} {v / 2**30:.2f} GiB" if k == "peak_rss_bytes" else f"{k} {v:,.1f}"
                            for k, v in measured.items()
                        ),
                        flush=True,
                    )
                    shutil.rmtree(out, ignore_errors=True)
            rows.append(_summarise(kind, length, rounds, runs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "benchmark": "cpu_allocator",
        **environment("date", "machine", "cpus", "python", "load_average_at_end"),
        "variants": variants,
        "steps": a.steps,
        "rows": rows,
    }
    _print_table(doc)
    write_json(a.json, doc)
    print(f"wrote {a.json}")


def _summarise(kind: str, length: int, rounds: int, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """One case's row: per variant its best run (least wall time: the run least disturbed by other
    work on a shared machine; every run stays in ``runs``), and the ratios to ``system``."""
    best = {v: min(rs, key=lambda r: r["wall_s"]) for v, rs in runs.items()}
    row: dict[str, Any] = {"case": kind, "tokens": length, "rounds": rounds, "best": best, "runs": runs}
    for v in runs:
        if v == "system":
            continue
        row[f"{v}_speedup_wall"] = best["system"]["wall_s"] / best[v]["wall_s"]
        if kind == "finetune":
            row[f"{v}_speedup_step"] = best["system"]["step_s"] / best[v]["step_s"]
        row[f"{v}_peak_rss_ratio"] = best[v]["peak_rss_bytes"] / best["system"]["peak_rss_bytes"]
    return row


def _print_table(doc: dict[str, Any]) -> None:
    print(
        "\n| case | tokens | variant | wall s | user s | system s | minor faults | peak RSS GiB | step s | speed-up (wall; step) vs system | peak RSS vs system |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        for v, m in r["best"].items():
            speed = (
                "1"
                if v == "system"
                else f"{r[f'{v}_speedup_wall']:.2f}x"
                + (f"; {r[f'{v}_speedup_step']:.2f}x" if r["case"] == "finetune" else "")
            )
            rss = "1" if v == "system" else f"{r[f'{v}_peak_rss_ratio']:.2f}x"
            step = f"{m['step_s']:.2f}" if "step_s" in m else ""
            print(
                f"| {r['case']} | {r['tokens']:,} | {v} | {m['wall_s']:.1f} | {m['user_s']:.1f} | {m['system_s']:.1f} | "
                f"{m['minor_faults']:,.0f} | {m['peak_rss_bytes'] / 2**30:.2f} | {step} | {speed} | {rss} |"
            )


if __name__ == "__main__":
    main()

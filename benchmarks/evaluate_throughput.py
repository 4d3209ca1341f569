#!/usr/bin/env python
"""``genolong evaluate`` throughput on CPU and the size of its outputs per million scored tokens.

The bundled base model (``small`` preset, fp32) scores the bundled sample's held-out chr22 split
(prepared into a temporary directory) in tiles of L tokens, L = 16k, 32k, 64k by default. For
each L, side by side in this process, alternating within each round:

- baseline: ``GenoLM.loss`` on each tile (the training-path forward and the summed loss, nothing
  per token), the least any evaluation must do;
- evaluate: :func:`genolong.evaluation.score.evaluate` on the same tiles (per-token NLL, per-tile
  x bucket and per-offset sums committed after every tile, the per-token parquet table, the
  bucket table with 2,000 bootstrap resamples), into a fresh directory;
- evaluate --context-cut 1024: the same tiles with the model restarted every 1,024 bases.

Reported: tokens/s of each, their time ratio to the baseline (medians over ``--repeats`` rounds),
and the bytes per million scored tokens of the per-token table (``tokens/``) and of everything else
(the aggregates, independent of the token count but for the per-offset table's L rows).

One warm-up evaluation (one 4k tile) runs first.

Example::

    python benchmarks/evaluate_throughput.py                       # 16k, 32k, 64k; 1 tile each, 2 rounds
    python benchmarks/evaluate_throughput.py --contexts 16384 --tiles 2 --repeats 1

Prints a table and writes JSON (default benchmarks/results/evaluate_throughput.json).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "evaluate_throughput.json"


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--contexts", default="16384,32768,65536", help="tile lengths L, comma-separated")
    parser.add_argument("--tiles", type=int, default=1, help="tiles per measurement (default 1)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; medians are reported (default 2)")
    parser.add_argument("--cut", type=int, default=1024, help="--context-cut of the third variant (default 1024)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)

    from genolong.data.store import GenomeStore
    from genolong.data.windows import EvalTiles
    from genolong.evaluation.score import evaluate
    from genolong.model.lm import GenoLM
    from genolong.quickstart import bundled_base, prepare_sample

    work = Path(tempfile.mkdtemp(prefix="genolong-eval-bench-"))
    try:
        prepare_sample(work / "genome", progress=False)
        split = GenomeStore.open(work / "genome").split("eval")
        model = GenoLM.from_pretrained(bundled_base()).eval()
        # warm-up: the first evaluate pays one-time costs (pyarrow/zstd, matplotlib-free bootstrap
        # set-up, allocator growth) that are not throughput
        evaluate(model, split, work / "warm-up", 4096, max_tiles=1, progress=False)
        rows = []
        for context in (int(c) for c in a.contexts.split(",")):
            tiles = EvalTiles(split, context)
            times: dict[str, list[float]] = {"baseline": [], "evaluate": [], "cut": []}
            sizes: dict[str, int] = {}
            scored = 0
            for round_ in range(a.repeats):
                t0 = time.perf_counter()
                with torch.no_grad():
                    for i in range(a.tiles):
                        model.loss(torch.from_numpy(tiles[i].tokens).long()[None])
                times["baseline"].append(time.perf_counter() - t0)
                for name, cut in (("evaluate", None), ("cut", a.cut)):
                    out = work / f"r-{context}-{name}-{round_}"
                    t0 = time.perf_counter()
                    result = evaluate(model, split, out, context, context_cut=cut, max_tiles=a.tiles, progress=False)
                    times[name].append(time.perf_counter() - t0)
                    scored = result.tokens
                    if name == "evaluate":
                        sizes = {
                            "tokens_table": _tree_bytes(out / "tokens"),
                            "aggregates": _tree_bytes(out) - _tree_bytes(out / "tokens"),
                        }
                    shutil.rmtree(out)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {
                "context": context,
                "tiles": a.tiles,
                "scored_tokens": scored,
                "baseline_s": med["baseline"],
                "evaluate_s": med["evaluate"],
                "cut_s": med["cut"],
                "baseline_tokens_per_s": scored / med["baseline"],
                "evaluate_tokens_per_s": scored / med["evaluate"],
                "cut_tokens_per_s": scored / med["cut"],
                "evaluate_over_baseline": med["evaluate"] / med["baseline"],
                "cut_over_baseline": med["cut"] / med["baseline"],
                "tokens_table_bytes_per_million": sizes["tokens_table"] / scored * 1e6,
                "aggregates_bytes": sizes["aggregates"],
            }
            rows.append(row)
            print(
                f"L={context:>6}: {scored:,} tokens; baseline {row['baseline_tokens_per_s']:,.0f} tok/s, "
                f"evaluate {row['evaluate_tokens_per_s']:,.0f} tok/s ({row['evaluate_over_baseline']:.3f}x time), "
                f"cut {row['cut_tokens_per_s']:,.0f} tok/s ({row['cut_over_baseline']:.3f}x); per-token table "
                f"{row['tokens_table_bytes_per_million'] / 2**20:.2f} MiB per M tokens, aggregates {row['aggregates_bytes'] / 1024:.0f} KiB",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        "\n| L | scored tokens | baseline tok/s | evaluate tok/s | time vs baseline | cut 1k tok/s | cut vs baseline | per-token table, MiB per M tokens | aggregates, KiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']:,} | {r['scored_tokens']:,} | {r['baseline_tokens_per_s']:,.0f} | {r['evaluate_tokens_per_s']:,.0f} | "
            f"{r['evaluate_over_baseline']:.3f}x | {r['cut_tokens_per_s']:,.0f} | {r['cut_over_baseline']:.3f}x | "
            f"{r['tokens_table_bytes_per_million'] / 2**20:.2f} | {r['aggregates_bytes'] / 1024:.0f} |"
        )
    write_json(
        a.json,
        {
            "benchmark": "evaluate_throughput",
            **environment("date", "machine", "torch"),
            "threads": a.threads,
            "repeats": a.repeats,
            "cut": a.cut,
            "rows": rows,
        },
    )
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()

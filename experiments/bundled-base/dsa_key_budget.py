#!/usr/bin/env python
"""How many keys per query do the DSA layers need to read 8k of human DNA? Held-out loss by budget.

A DSA layer attends only to the ``index_topk`` keys its indexer selects (``index_topk //
index_kpool`` pools of ``index_kpool`` tokens, plus the query's own incomplete pool). The bundled
base was trained at up to 1,024 bases with 512 keys: half of its longest window. At 4k-8k bases
into a tile the same 512 keys are 1/8 to 1/16 of the context. This scores each model on the same
held-out tiles with the key budget as its config.json has it and with each ``--topk`` (the weights
unchanged: ``load_eval_model(overrides={"index_topk": k})``), and with its context cut at ``--cut``
bases (read with the largest budget): per context bucket, the change against the model's own budget
with its paired 95% block-bootstrap interval over tiles (:func:`genolong.evaluation.stats.compare`),
and the seconds each scoring took, as a ratio to the own budget's (same process, same tiles).

Sets: ``chr22``, the quickstart's 8 reported tiles of the bundled chr22:20-21 Mb slice (needs a
prepared sample store: ``--store``, e.g. genolong-quickstart/genome); ``chr16``, hg38
chr16:186,964-397,118 from tests/data (26 tiles of 8,192).

    python experiments/bundled-base/dsa_key_budget.py --store genolong-quickstart/genome
    python experiments/bundled-base/dsa_key_budget.py --store /tmp/qs/genome --model base --model tuned=/tmp/qs/runs/quickstart/export \\
        --sets chr22,chr16 --topk 1024,2048,4096 --cut 1024

Prints a table and writes JSON (default experiments/bundled-base/results/dsa_key_budget.json).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "benchmarks"
sys.path.append(str(BENCH))  # benchmarks/_bench.py (and benchmarks/quickstart_heldout.py)
sys.path.append(str(HERE))  # the other scripts of experiments/bundled-base/
from _bench import environment, write_json  # noqa: E402
from quickstart_heldout import CHR16, CHRM  # noqa: E402  (the held-out FASTAs in tests/data)

DEFAULT_JSON = HERE / "results" / "dsa_key_budget.json"
SETS = ("chr22", "chr16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        type=Path,
        default=Path("genolong-quickstart/genome"),
        help="the prepared sample store, for chr22 (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="LABEL=DIR, or 'base' for the bundled base; repeat for several (default: base)",
    )
    parser.add_argument("--sets", default="chr22", help=f"comma-separated, of {', '.join(SETS)} (default: %(default)s)")
    parser.add_argument(
        "--topk", default="1024,2048", help="key budgets to read with, comma-separated (default: %(default)s)"
    )
    parser.add_argument(
        "--cut", type=int, default=None, help="also score with the context cut at C bases (largest budget)"
    )
    parser.add_argument(
        "--context", type=int, default=8192, help="tile length (default: %(default)s, the quickstart's)"
    )
    parser.add_argument(
        "--tiles", type=int, default=None, help="at most this many tiles per set (default: chr22 8, chr16 all)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()

    import torch

    from genolong.data.prepare import prepare_genome
    from genolong.data.store import GenomeStore
    from genolong.evaluation.score import evaluate, load_eval_model
    from genolong.evaluation.stats import compare
    from genolong.model.config import ModelConfig
    from genolong.quickstart import DEFAULT_EVAL_TILES, bundled_base

    torch.set_num_threads(args.threads)
    budgets = sorted({int(k) for k in args.topk.split(",")})
    models: dict[str, Path] = {}
    for item in args.model or ["base"]:
        label, _, path = item.partition("=")
        models[label] = Path(path) if path else bundled_base()
    wanted = args.sets.split(",")
    if unknown := [s for s in wanted if s not in SETS]:
        parser.error(f"--sets: unknown {', '.join(unknown)}; choose from {', '.join(SETS)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="genolong-keys-") as work:
        work_dir = Path(work)
        splits = {}
        if "chr22" in wanted:
            splits["chr22"] = (GenomeStore.open(args.store).split("eval"), args.tiles or DEFAULT_EVAL_TILES)
        if "chr16" in wanted:  # the held-out split of a store whose train split is the mitochondrion
            store = prepare_genome(
                [CHR16, CHRM], work_dir / "store-chr16", train=["MT_human"], eval=["chr16"], progress=False
            )
            splits["chr16"] = (GenomeStore.open(store.path).split("eval"), args.tiles)
        for set_name, (split, tiles) in splits.items():
            for label, model_dir in models.items():
                own = ModelConfig.from_pretrained(model_dir).index_topk
                views = [(f"{own:,} keys (own)", own, None)]
                views += [(f"{k:,} keys", k, None) for k in budgets if k != own]
                if args.cut is not None:
                    views.append(
                        (f"{max(budgets + [own]):,} keys, cut at {args.cut:,}", max(budgets + [own]), args.cut)
                    )
                results, seconds = {}, {}
                for name, topk, cut in views:
                    model = load_eval_model(model_dir, overrides=None if topk == own else {"index_topk": topk})[0]
                    t0 = time.perf_counter()
                    results[name] = evaluate(
                        model,
                        split,
                        work_dir / f"{set_name}-{label}-{topk}-{cut}",
                        args.context,
                        context_cut=cut,
                        max_tiles=tiles,
                        write_tokens=False,
                        progress=False,
                        label=name,
                    )
                    seconds[name] = time.perf_counter() - t0
                reference = views[0][0]
                for name, topk, cut in views:
                    table = compare(results[reference], results[name]).set_index("bucket")
                    row: dict[str, Any] = {
                        "set": set_name,
                        "model": label,
                        "view": name,
                        "index_topk": topk,
                        "context_cut": cut,
                        "tiles": results[name].n_tiles,
                        "bases": results[name].tokens,
                        "seconds": seconds[name],
                        "time_ratio": seconds[name] / seconds[reference],
                        "buckets": {
                            str(b): {
                                "nats": float(r.b_nats),
                                "change_pct": float(r.rel_pct),
                                "ci": [float(r.rel_ci_lo), float(r.rel_ci_hi)],
                            }
                            for b, r in table.iterrows()
                        },
                    }
                    if cut is not None:  # what the context beyond the cut buys at this budget: full - cut
                        full = next(n for n, k, c in views if k == topk and c is None)
                        cut_table = compare(results[name], results[full]).set_index("bucket")
                        row["full_vs_cut"] = {
                            str(b): {"change_pct": float(r.rel_pct), "ci": [float(r.rel_ci_lo), float(r.rel_ci_hi)]}
                            for b, r in cut_table.iterrows()
                        }
                    rows.append(row)
                    print(
                        f"{set_name} {label} {name}: {results[name].mean_nll:.4f} nats/base, {seconds[name]:.0f} s",
                        flush=True,
                    )
    buckets = list(rows[0]["buckets"])
    print(f"\nchange against each model's own budget (%, 95% CI), tiles of {args.context:,}\n")
    print("| set | model | view | " + " | ".join(buckets) + " | time ratio |")
    print("|---|---|---|" + "---|" * len(buckets) + "---:|")
    for r in rows:
        cells = [
            f"{b['nats']:.4f} ({b['change_pct']:+.2f}% [{b['ci'][0]:+.2f}, {b['ci'][1]:+.2f}])"
            for b in r["buckets"].values()
        ]
        print(f"| {r['set']} | {r['model']} | {r['view']} | " + " | ".join(cells) + f" | {r['time_ratio']:.2f} |")
    cuts = [r for r in rows if "full_vs_cut" in r]
    if cuts:
        print("\nwhat the context beyond the cut buys at that budget: full - cut (%, 95% CI)\n")
        print("| set | model | view | " + " | ".join(buckets) + " |")
        print("|---|---|---|" + "---|" * len(buckets))
        for r in cuts:
            cells = [
                f"{b['change_pct']:+.2f}% [{b['ci'][0]:+.2f}, {b['ci'][1]:+.2f}]" for b in r["full_vs_cut"].values()
            ]
            print(f"| {r['set']} | {r['model']} | {r['view']} | " + " | ".join(cells) + " |")
    out = {
        "benchmark": "dsa_key_budget",
        **environment("date", "machine", "torch"),
        "threads": args.threads,
        "models": {k: str(v) for k, v in models.items()},
        "context": args.context,
        "rows": rows,
    }
    write_json(args.json, out)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

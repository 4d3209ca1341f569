#!/usr/bin/env python
"""Does the quickstart's fine-tune carry beyond its own held-out slice? Base vs fine-tuned on other human DNA.

``genolong quickstart`` scores the bundled base and its fine-tuned model on the first 8 tiles of
8,192 bases of the bundled chr22:20-21 Mb slice. This scores the same two models, as ``genolong
evaluate`` does (tiles of ``--context`` tokens, every counted base), on held-out human DNA the
quickstart never trains on or reports:

- ``chr16``: hg38 chr16:186,964-397,118, soft-masked (tests/data; another chromosome, another
  assembly, 42% repeat-masked);
- ``chrM``: the human mitochondrion, rCRS (tests/data; 16,569 bp, a different genome);
- ``chr22-more``: tiles 9 to 8 + ``--more-tiles`` of the same chr22 slice (the second look at the
  quickstart's own region: the tiles after the ones it reports);
- ``chr22`` (only with ``--sets``): the 8 tiles the quickstart reports, scored again here.

A fine-tuned model whose config reads the weights differently from the base's (its recipe's
``model.overrides``, e.g. the quickstart's ``index_topk: 2048``) is also compared with the base
read that way (:func:`genolong.config.reading_changes`): the reading alone, then the training alone.

``--tuned`` may be given several times (``LABEL=DIR`` or ``DIR``): each fine-tuned model is
compared with the one base, scored once (e.g. the quickstart's and quickstart-lora's exports).

Per set: both models' mean loss, the change (fine-tuned - base) with its paired 95% block
bootstrap interval over tiles (:func:`genolong.evaluation.stats.compare`), and the routing of each
model's MoE layers on those tiles (load max/mean, dead experts). With ``--cut C`` each fine-tuned
model is also scored with its view cut at ``C`` bases on the same tiles (what the context beyond
``C`` buys it: full - cut). On a set with soft-masked bases (chr16) both changes are also split by
soft-masking (:func:`genolong.evaluation.stats.compare_softmask`): repeats (lower case) against
unique sequence, with the paired gap between the two classes.

Run ``genolong quickstart`` first (its fine-tuned model is ``OUT/runs/quickstart/export``)::

    genolong quickstart
    python benchmarks/quickstart_heldout.py                     # OUT = genolong-quickstart
    python benchmarks/quickstart_heldout.py --tuned other/runs/quickstart/export
    python benchmarks/quickstart_heldout.py --quickstart /tmp/qs --sets chr22,chr16 \
        --tuned quickstart=/tmp/qs/runs/quickstart/export --tuned lora=/tmp/qsl/run/export

Prints a table and writes JSON (default benchmarks/results/quickstart_heldout.json).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

ROOT = HERE.parent
DEFAULT_JSON = HERE / "results" / "quickstart_heldout.json"
CHR16 = ROOT / "tests" / "data" / "hg38_chr16_186964-397118.softmasked.fa.gz"
CHRM = ROOT / "tests" / "data" / "chrM_rCRS.fa.gz"
SETS = ("chr22", "chr16", "chrM", "chr22-more")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quickstart",
        type=Path,
        default=Path("genolong-quickstart"),
        help="the quickstart's output directory (default: %(default)s)",
    )
    parser.add_argument("--base", type=Path, default=None, help="base model (default: the bundled data/sample/base)")
    parser.add_argument(
        "--tuned",
        action="append",
        default=None,
        help="fine-tuned model, DIR or LABEL=DIR; repeat for several (default: QUICKSTART/runs/quickstart/export)",
    )
    parser.add_argument(
        "--sets",
        default="chr16,chrM,chr22-more",
        help=f"held-out sets, comma-separated, of {', '.join(SETS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--context", type=int, default=8192, help="tile length (default: %(default)s, the quickstart's)"
    )
    parser.add_argument(
        "--more-tiles", type=int, default=32, help="chr22 tiles after the quickstart's 8 (default: %(default)s)"
    )
    parser.add_argument(
        "--cut",
        type=int,
        default=None,
        metavar="C",
        help="also score each fine-tuned model with its context cut at C bases, and compare full with cut "
        "(the quickstart's cut is 1024; default: off)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()

    import torch

    from genolong.config import reading_changes
    from genolong.data.prepare import prepare_genome
    from genolong.data.store import GenomeStore
    from genolong.data.windows import EvalTiles
    from genolong.evaluation.score import evaluate, load_eval_model
    from genolong.evaluation.stats import compare, compare_softmask
    from genolong.model.config import ModelConfig
    from genolong.quickstart import DEFAULT_EVAL_TILES, bundled_base

    torch.set_num_threads(args.threads)
    base_dir = args.base or bundled_base()
    tuned_dirs: dict[str, Path] = {}
    for item in args.tuned or [str(args.quickstart / "runs" / "quickstart" / "export")]:
        label, _, path = item.partition("=") if "=" in item else ("fine-tuned", "", item)
        if label in tuned_dirs or label == "base":
            parser.error(f"--tuned: label {label!r} given twice (or 'base'); name each LABEL=DIR")
        tuned_dirs[label] = Path(path)
    for tuned_dir in tuned_dirs.values():
        if not (tuned_dir / "config.json").is_file():
            parser.error(f"{tuned_dir} is not a model directory; run `genolong quickstart` first, or pass --tuned")
    wanted = args.sets.split(",")
    if unknown := [s for s in wanted if s not in SETS]:
        parser.error(f"--sets: unknown {', '.join(unknown)}; choose from {', '.join(SETS)}")
    models = {"base": load_eval_model(base_dir)[0], **{label: load_eval_model(d)[0] for label, d in tuned_dirs.items()}}
    # a fine-tuned model that reads the weights differently from the base (its recipe's model.overrides,
    # e.g. a wider DSA key budget): the base is also scored that way, to tell the reading from the training
    base_config = ModelConfig.from_pretrained(base_dir)
    read_as: dict[str, str] = {}  # fine-tuned label -> label of the base read as that model reads
    for label, tuned_dir in tuned_dirs.items():
        if changes := reading_changes(base_config, ModelConfig.from_pretrained(tuned_dir)):
            read_as[label] = "base, " + ", ".join(f"{k} {v}" for k, v in changes.items())
            if read_as[label] not in models:
                models[read_as[label]] = load_eval_model(base_dir, overrides=changes)[0]
    sets: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="genolong-heldout-") as work:
        work_dir = Path(work)
        # chr16 and chrM each the held-out split of a store whose train split is the other one
        # (the mitochondrion's record is named MT_human in its file)
        chr22 = GenomeStore.open(args.quickstart / "genome").split("eval")
        if "chr22" in wanted:
            sets.append({"set": "chr22", "split": chr22, "first": 0, "tiles": DEFAULT_EVAL_TILES})
        for name, record, other in (("chr16", "chr16", "MT_human"), ("chrM", "MT_human", "chr16")):
            if name not in wanted:
                continue
            store = prepare_genome(
                [CHR16, CHRM], work_dir / f"store-{name}", train=[other], eval=[record], progress=False
            )
            split = GenomeStore.open(store.path).split("eval")
            sets.append({"set": name, "split": split, "first": 0, "tiles": len(EvalTiles(split, args.context))})
        if "chr22-more" in wanted:
            sets.append({"set": "chr22-more", "split": chr22, "first": DEFAULT_EVAL_TILES, "tiles": args.more_tiles})
        rows = []
        splits: list[dict[str, Any]] = []
        for s in sets:
            results = {}
            for label, model in models.items():
                results[label] = evaluate(
                    model,
                    s["split"],
                    work_dir / f"{s['set']}-{label}",
                    args.context,
                    max_tiles=s["first"] + s["tiles"],
                    write_tokens=bool(s["first"]),
                    progress=False,
                    label=label,
                )
            if s["first"]:  # only the tiles after the quickstart's own
                results = {
                    label: _tail(r, work_dir / f"{s['set']}-{label}", s["first"]) for label, r in results.items()
                }
            if args.cut is not None and not s["first"]:
                for tuned in tuned_dirs:
                    results[f"{tuned} cut"] = evaluate(
                        models[tuned],
                        s["split"],
                        work_dir / f"{s['set']}-{tuned}-cut",
                        args.context,
                        context_cut=args.cut,
                        max_tiles=s["tiles"],
                        write_tokens=False,
                        progress=False,
                        label=f"{tuned} cut",
                    )
            masked = not s["first"] and int(results["base"].softmask_tokens[:, :, 1].sum()) > 0
            for tuned in tuned_dirs:
                pairs = [("base", tuned, f"{tuned} - base")]
                if tuned in read_as:  # the reading alone, then the training alone
                    pairs += [
                        ("base", read_as[tuned], f"{read_as[tuned]} - base"),
                        (read_as[tuned], tuned, f"{tuned} - {read_as[tuned]}"),
                    ]
                if f"{tuned} cut" in results:
                    pairs.append((f"{tuned} cut", tuned, f"{tuned}: full - cut {args.cut}"))
                for a, b, what in pairs:
                    row = {"set": s["set"], "comparison": what}
                    pooled = compare(results[a], results[b]).set_index("bucket")
                    row["all"] = _change(pooled.loc["all"])
                    row["buckets"] = {str(k): _change(r) for k, r in pooled.iterrows() if k != "all"}
                    if masked:
                        table, gap = compare_softmask(results[a], results[b])
                        for flag, name in ((False, "unmasked"), (True, "softmasked")):
                            part = table[table["softmask"] == flag].set_index("bucket")
                            row[name] = {str(k): {**_change(r), "tokens": int(r.tokens)} for k, r in part.iterrows()}
                        row["gap_pts"] = {
                            str(r.bucket): {"gap": float(r.gap_pct), "ci": [float(r.gap_ci_lo), float(r.gap_ci_hi)]}
                            for r in gap.itertuples(index=False)
                        }
                    splits.append(row)
            for tuned in tuned_dirs:
                table = compare(results["base"], results[tuned]).set_index("bucket")
                overall = table.loc["all"]
                rows.append(
                    {
                        "set": s["set"],
                        "model": tuned,
                        "tiles": results["base"].n_tiles,
                        "bases": results["base"].tokens,
                        "base_nats": results["base"].mean_nll,
                        "tuned_nats": results[tuned].mean_nll,
                        "change_pct": float(overall.rel_pct),
                        "ci_lo_pct": float(overall.rel_ci_lo),
                        "ci_hi_pct": float(overall.rel_ci_hi),
                        "buckets": {
                            str(b): {"change_pct": float(r.rel_pct), "ci": [float(r.rel_ci_lo), float(r.rel_ci_hi)]}
                            for b, r in table.iterrows()
                            if b != "all"
                        },
                        "routing": {
                            label: [
                                {k: x[k] for k in ("layer", "load_max_over_mean", "dead_experts")}
                                for x in r.meta["routing"]
                            ]
                            for label, r in results.items()
                            if label in ("base", tuned)
                        },
                    }
                )
    print(f"base {base_dir} vs {', '.join(f'{k} {v}' for k, v in tuned_dirs.items())}, tiles of {args.context:,}\n")
    print(
        "| held-out set | fine-tuned model | tiles | bases | base nats | fine-tuned nats | change (95% CI) "
        "| worst MoE max/mean base / tuned |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        worst = [max(x["load_max_over_mean"] for x in r["routing"][label]) for label in ("base", r["model"])]
        print(
            f"| {r['set']} | {r['model']} | {r['tiles']} | {r['bases']:,} | {r['base_nats']:.4f} | {r['tuned_nats']:.4f} | "
            f"{r['change_pct']:+.2f}% [{r['ci_lo_pct']:+.2f}, {r['ci_hi_pct']:+.2f}] | {worst[0]:.2f} / {worst[1]:.2f} |"
        )
    if splits:
        print(
            "\nBy context bucket (change in %, 95% CI); on soft-masked sets split into unique sequence / repeats, and "
            "the gap repeats - unique in points:\n"
        )
        print("| set | comparison | bucket | all bases | unique (upper case) | repeats (lower case) | gap, points |")
        print("|---|---|---|---|---|---|---|")
        for r in splits:
            for bucket in [*r["buckets"], "all"]:
                pooled = r["all"] if bucket == "all" else r["buckets"][bucket]
                cells = [_fmt(pooled)]
                if "gap_pts" in r:
                    g = r["gap_pts"][bucket]
                    cells += [
                        _fmt(r["unmasked"][bucket]),
                        _fmt(r["softmasked"][bucket]),
                        f"{g['gap']:+.2f} [{g['ci'][0]:+.2f}, {g['ci'][1]:+.2f}]",
                    ]
                else:
                    cells += ["", "", ""]
                print(f"| {r['set']} | {r['comparison']} | {bucket} | " + " | ".join(cells) + " |")
    tuned_out: Any = {k: str(v) for k, v in tuned_dirs.items()}
    if list(tuned_dirs) == ["fine-tuned"]:
        tuned_out = tuned_out["fine-tuned"]  # one model: the file as before, a path
    out = {
        "benchmark": "quickstart_heldout",
        **environment("date", "machine", "torch"),
        "base": str(base_dir),
        "tuned": tuned_out,
        "context": args.context,
        "cut": args.cut,
        "rows": rows,
        "by_bucket": splits,
    }
    write_json(args.json, out)
    print(f"\nwrote {args.json}")


def _change(row: Any) -> dict[str, Any]:
    """One compare row's relative change: ``{"change_pct", "ci"}`` (percent)."""
    return {"change_pct": float(row.rel_pct), "ci": [float(row.rel_ci_lo), float(row.rel_ci_hi)]}


def _fmt(change: dict[str, Any]) -> str:
    """``-0.31% [-0.40, -0.21]``."""
    return f"{change['change_pct']:+.2f}% [{change['ci'][0]:+.2f}, {change['ci'][1]:+.2f}]"


def _tail(result: Any, directory: Path, first: int) -> Any:
    """``result`` (saved in ``directory`` with its per-token table) without its first ``first``
    tiles: their per-tile rows dropped and their tokens taken out of the per-offset sums."""
    import numpy as np

    from genolong.evaluation.results import EvalResult
    from genolong.evaluation.score import read_tokens

    head = read_tokens(directory)
    head = head[head.tile < first]
    position_tokens = result.position_tokens - np.bincount(head.offset, minlength=result.context)
    position_nll = result.position_nll - np.bincount(
        head.offset, weights=head.nll.astype(np.float64), minlength=result.context
    )
    meta = {
        **result.meta,
        "tiles": result.n_tiles - first,
        "tokens": int(result.tile_tokens[first:].sum()),
        "nll_sum": float(result.tile_nll[first:].sum()),
    }
    tiles = result.tiles.iloc[first:].reset_index(drop=True)
    tiles["tile"] = np.arange(len(tiles))
    return EvalResult(
        meta=meta,
        tiles=tiles,
        tile_tokens=result.tile_tokens[first:],
        tile_nll=result.tile_nll[first:],
        position_tokens=position_tokens,
        position_nll=position_nll,
    )


if __name__ == "__main__":
    main()

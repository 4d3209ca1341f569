#!/usr/bin/env python
"""What the quickstart's long context buys over a spread of held-out human DNA, not one chosen slice.

The successor of ``quickstart_heldout.py`` for the claims: the quickstart's models scored, as
``genolong evaluate`` scores (tiles of ``--context`` tokens, every counted base), on every held-out
region of ``--data`` (default ``/work/shared/data/human``; none is in the quickstart's train split):

- ``chr22``: GRCh37 chr22:20-21 Mb, the quickstart's own held-out split (its store ``QUICKSTART/genome``);
  the region the quickstart's REPORT measures (its first 8 tiles; here tiles spread over all of it);
- ``HLA``: BA000025.2, 2.23 Mb of chromosome 6p21.3 (the HLA class I region), upper case;
- ``chr16``: hg38 chr16:186,964-397,118, soft-masked (42% lower case): split by soft-masking;
- ``chrM``: the mitochondrion (16,569 bp: 2 whole tiles of 8,192, both scored).

Per region, ``--tiles`` whole tiles spread evenly over the region (``numpy.linspace`` over its whole
tiles, first to last; a segment's short last tile is never chosen, so every tile fills every
context bucket). Models: ``base`` (the bundled base), ``base-read`` (the base read as the fine-tuned
model reads it: its recipe's ``model.overrides``, e.g. 2,048 DSA keys instead of 512; only when
they differ), ``tuned`` (``QUICKSTART/runs/quickstart/export``) with full context and with its view
cut at ``--cut`` bases (``genolong evaluate --context-cut``).

Comparisons, each per context bucket and overall: ``tuned: full - cut`` (what the context beyond the
cut buys the fine-tuned model), ``base-read: full - cut`` (the same for the base read that way,
before any step), ``tuned - base-read`` (the fine-tune's steps alone, same reading), ``base-read - base`` (the wider reading alone) and ``tuned - base``. Per region: the change with
its paired block-bootstrap interval over tiles (:func:`genolong.evaluation.stats.compare`; on
chr16 also by soft-masking). Pooled: every tile of every region (ratio of sums, so a region weighs
by its tiles: chrM's 2 tiles weigh 2 of the total) with a two-stage interval that counts regions as
the unit of variation (:func:`genolong.evaluation.bootstrap.hierarchical_paired_bootstrap`:
resample the regions, then the tiles inside each), and the range of the per-region figures.

Run ``genolong quickstart`` first::

    genolong quickstart --out /tmp/qs
    python benchmarks/heldout_spread.py --quickstart /tmp/qs --tiles 6 --threads 1

Prints a table and writes JSON (default benchmarks/results/heldout_spread.json) with the per-tile
token and loss sums of every run, so the pooled figures can be recomputed from it
(:func:`pooled_from_json`; tests/test_readme.py checks the README's figures against it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "heldout_spread.json"
DATA = Path("/work/shared/data/human")
#: region -> (FASTA in --data, its record name, the record the throwaway store trains on)
FASTAS = {
    "HLA": ("HLA_BA000025_chr6p21.3.fa.gz", "BA000025.2"),
    "chr16": ("hg38_chr16_186964-397118.softmasked.fa.gz", "chr16"),
    "chrM": ("chrM_rCRS.fa.gz", "MT_human"),
}
REGIONS = ("chr22", "HLA", "chr16", "chrM")
#: the runs: the base, the base read as the fine-tune reads it, the fine-tuned model, each cut at --cut where named
MODELS = ("base", "base-read", "base-read cut", "tuned", "tuned cut")
#: (run A, run B, label): B compared with A, B - A
COMPARISONS = (
    ("tuned cut", "tuned", "tuned: full - cut"),
    ("base-read cut", "base-read", "base-read: full - cut"),
    ("base-read", "tuned", "tuned - base-read"),
    ("base", "base-read", "base-read - base"),
    ("base", "tuned", "tuned - base"),
)


def spread(n_whole: int, n: int) -> np.ndarray:
    """Indices of ``n`` tiles spread evenly over ``n_whole`` (first and last included; all if fewer)."""
    if n >= n_whole:
        return np.arange(n_whole)
    return np.unique(np.round(np.linspace(0, n_whole - 1, n)).astype(np.int64))


def pooled(regions: dict[str, dict[str, Any]], a: str, b: str, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Pooled change B vs A over the regions' per-tile arrays (``{"tokens": [W, K], "nll": [W, K]}`` per run).

    Returns ``{"buckets": {label: {"change_pct", "ci"}}, "range": {label: [min, max]}}`` with the
    overall column labelled ``"all"``: the pooled relative change in percent, its two-stage 95%
    interval (regions, then tiles) and the smallest and largest per-region change.
    """
    from genolong.evaluation.bootstrap import hierarchical_paired_bootstrap

    groups, per_region = [], []
    for r in regions.values():
        cols = [np.asarray(r["runs"][x][key], dtype=np.float64) for x in (a, b) for key in ("tokens", "nll")]
        cols = [np.concatenate([c, c.sum(axis=1, keepdims=True)], axis=1) for c in cols]  # + the overall column
        groups.append(tuple(cols))
        sums = [c.sum(axis=0) for c in cols]
        per_region.append(100.0 * ((sums[3] / sums[2]) / (sums[1] / sums[0]) - 1.0))
    ci = hierarchical_paired_bootstrap(groups, n_boot=n_boot, seed=seed)
    labels = [*next(iter(regions.values()))["buckets"], "all"]
    spread_ = np.asarray(per_region)
    return {
        "buckets": {
            lab: {"change_pct": float(100 * ci.rel[i]), "ci": [float(100 * ci.rel_lo[i]), float(100 * ci.rel_hi[i])]}
            for i, lab in enumerate(labels)
        },
        "range": {lab: [float(spread_[:, i].min()), float(spread_[:, i].max())] for i, lab in enumerate(labels)},
    }


def pooled_from_json(doc: dict[str, Any], comparison: str, bucket: str = "all") -> dict[str, Any]:
    """The committed pooled figure of ``comparison`` in ``bucket`` (``{"change_pct", "ci", "range"}``)."""
    p = doc["pooled"][comparison]
    return {**p["buckets"][bucket], "range": p["range"][bucket]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quickstart",
        type=Path,
        default=Path("genolong-quickstart"),
        help="the quickstart's output directory (default: %(default)s)",
    )
    parser.add_argument("--data", type=Path, default=DATA, help="the held-out FASTAs (default: %(default)s)")
    parser.add_argument("--regions", default=",".join(REGIONS), help="regions, comma-separated (default: %(default)s)")
    parser.add_argument("--tiles", type=int, default=8, help="tiles spread over each region (default: %(default)s)")
    parser.add_argument(
        "--context", type=int, default=8192, help="tile length (default: %(default)s, the quickstart's)"
    )
    parser.add_argument("--cut", type=int, default=1024, help="the fine-tuned model's cut view (default: %(default)s)")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="runs to score and compare, comma-separated (default: %(default)s)"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="keep each region's store and each run's result here and reuse complete ones on a rerun "
        "(default: a temporary directory)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="MODELS",
        help="score only these runs (comma-separated, of --models' names) into --work "
        "and stop, e.g. the base's while the quickstart still trains (default: all, then compare)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output JSON (default: %(default)s)")
    args = parser.parse_args()

    import torch

    from genolong.config import reading_changes
    from genolong.data.prepare import prepare_genome
    from genolong.data.regions import Regions
    from genolong.data.store import GenomeStore
    from genolong.data.windows import EvalTiles
    from genolong.evaluation.results import EvalResult
    from genolong.evaluation.score import evaluate, load_eval_model
    from genolong.evaluation.stats import compare, compare_softmask
    from genolong.model.config import ModelConfig
    from genolong.quickstart import bundled_base

    torch.set_num_threads(args.threads)
    wanted = args.regions.split(",")
    if unknown := [r for r in wanted if r not in REGIONS]:
        parser.error(f"--regions: unknown {', '.join(unknown)}; choose from {', '.join(REGIONS)}")
    base_dir, tuned_dir = bundled_base(), args.quickstart / "runs" / "quickstart" / "export"
    only = None if args.only is None else args.only.split(",")
    chosen_models = args.models.split(",")
    if bad := [m for m in [*chosen_models, *(only or [])] if m not in MODELS]:
        parser.error(f"--models/--only: unknown {', '.join(bad)}; choose from {', '.join(MODELS)}")
    if only is not None and args.work is None:
        parser.error("--only scores into --work: name a --work directory")
    needs_tuned = any(m.startswith("tuned") for m in (only or chosen_models))
    if needs_tuned and not (tuned_dir / "config.json").is_file():
        parser.error(f"{tuned_dir} is not a model directory; run `genolong quickstart --out {args.quickstart}` first")
    # the reading of the quickstart's recipe (the export's config.json says the same once it exists)
    tuned_config = (
        ModelConfig.from_pretrained(tuned_dir)
        if (tuned_dir / "config.json").is_file()
        else ModelConfig.from_pretrained(base_dir).replace(**_recipe_overrides())
    )
    changes = reading_changes(ModelConfig.from_pretrained(base_dir), tuned_config)
    wanted_models = [
        m for m in MODELS if m in (only or chosen_models) and not (m.startswith("base-read") and not changes)
    ]
    models: dict[str, tuple[Any, int | None]] = {}
    for m in wanted_models:
        if m == "base":
            models[m] = (load_eval_model(base_dir)[0], None)
        elif m.startswith("base-read"):  # the base read as the fine-tune reads it: the reading apart from the training
            read = models["base-read"][0] if "base-read" in models else load_eval_model(base_dir, overrides=changes)[0]
            models[m] = (read, args.cut if m.endswith("cut") else None)
        else:
            tuned = models["tuned"][0] if "tuned" in models else load_eval_model(tuned_dir)[0]
            models[m] = (tuned, args.cut if m == "tuned cut" else None)
    comparisons = [c for c in COMPARISONS if c[0] in models and c[1] in models]
    regions: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="genolong-spread-") as work:
        work_dir = args.work or Path(work)
        work_dir.mkdir(parents=True, exist_ok=True)
        for name in wanted:
            if name == "chr22":
                split = GenomeStore.open(args.quickstart / "genome").split("eval")
            else:
                fasta, record = FASTAS[name]
                other = "MT_human" if name != "chrM" else "chr16"  # a store needs a train split: the other file
                other_fasta = FASTAS["chrM" if name != "chrM" else "chr16"][0]
                path = work_dir / f"store-{name}"
                if not (path / "DONE").is_file():  # a store of an earlier --work run is reused
                    prepare_genome(
                        [args.data / fasta, args.data / other_fasta],
                        path,
                        train=[other],
                        eval=[record],
                        progress=False,
                        force=True,
                    )
                    (path / "DONE").touch()
                split = GenomeStore.open(path).split("eval")
            frame = EvalTiles(split, args.context).tiles
            whole = frame[frame["length"] == args.context].reset_index(drop=True)
            chosen = whole.iloc[spread(len(whole), args.tiles)]
            # one base at each chosen tile's start selects exactly that tile (evaluate --regions)
            picks = Regions(
                intervals={
                    c: np.stack([g["start"].to_numpy(), g["start"].to_numpy() + 1], axis=1).astype(np.int64)
                    for c, g in chosen.groupby("contig")
                },
                source=f"{name} spread",
            )
            results = {}
            for label, (model, cut) in models.items():
                out_dir = work_dir / f"{name}-{args.context}-{args.tiles}-{label.replace(' ', '-')}"
                if (out_dir / "DONE").is_file():  # scored by an earlier --work run with these settings
                    results[label] = EvalResult.load(out_dir)
                    continue
                print(f"{name}: scoring {label} on {len(chosen)} of {len(whole)} whole tiles", flush=True)
                results[label] = evaluate(
                    model,
                    split,
                    out_dir,
                    args.context,
                    context_cut=cut,
                    write_tokens=False,
                    progress=False,
                    label=label,
                    regions=picks,
                    force=True,
                )
                (out_dir / "DONE").touch()
            if only is not None:
                continue
            first = next(iter(results.values()))
            # split by soft-masking where the FASTA is soft-masked (chr16: 42%); not for a stray lower-case base (chrM has 1)
            masked = first.has_softmask and int(first.softmask_tokens[:, :, 1].sum()) >= 0.01 * first.tokens
            region = {
                "tiles": len(chosen),
                "whole_tiles": len(whole),
                "bases": int(first.tokens),
                "starts": [int(s) for s in chosen["start"]],
                "softmasked": masked,
                "buckets": [str(b) for b in compare(first, first)["bucket"] if b != "all"],
                "nats": {label: float(r.mean_nll) for label, r in results.items()},
                "runs": {
                    label: {"tokens": r.tile_tokens.astype(int).tolist(), "nll": np.round(r.tile_nll, 4).tolist()}
                    for label, r in results.items()
                },
            }
            for a, b, what in comparisons:
                table = compare(results[a], results[b]).set_index("bucket")
                row = {"region": name, "comparison": what, "buckets": {str(k): _change(r) for k, r in table.iterrows()}}
                if masked:
                    split_table, _ = compare_softmask(results[a], results[b])
                    for flag, part in ((False, "unmasked"), (True, "softmasked")):
                        sub = split_table[split_table["softmask"] == flag].set_index("bucket")
                        row[part] = {str(k): {**_change(r), "tokens": int(r.tokens)} for k, r in sub.iterrows()}
                rows.append(row)
            regions[name] = region
    if only is not None:
        print(f"scored {', '.join(models)} into {work_dir}")
        return
    # the pooled figures from the rounded per-tile sums as written, so pooled_from_json's inputs reproduce them
    pooled_out = {what: pooled(regions, a, b) for a, b, what in comparisons}
    # the figure the README, the docs and the quickstart's REPORT quote: the fine-tuned model's full - cut, or
    # the base read as it reads (its starting point) where the fine-tuned model was not scored
    headline = next((w for w in ("tuned: full - cut", "base-read: full - cut") if w in pooled_out), None)
    _print(regions, rows, pooled_out, args)
    out = {
        "benchmark": "heldout_spread",
        **environment("date", "machine", "torch"),
        "base": str(base_dir),
        "tuned": str(tuned_dir),
        "reading": changes,
        "context": args.context,
        "cut": args.cut,
        "tiles_per_region": args.tiles,
        "models": list(models),
        "threads": args.threads,
        "regions": regions,
        "rows": rows,
        "pooled": pooled_out,
        "headline": headline,
    }
    write_json(args.json, out)
    print(f"\nwrote {args.json}")


def _recipe_overrides() -> dict[str, Any]:
    """``model.overrides`` of recipes/quickstart.yaml (the reading the quickstart's fine-tune is scored with)."""
    import yaml

    from genolong.quickstart import quickstart_recipe

    return dict(yaml.safe_load(quickstart_recipe().read_text())["model"].get("overrides") or {})


def _change(row: Any) -> dict[str, Any]:
    """One compare row's relative change: ``{"change_pct", "ci"}`` (percent)."""
    return {"change_pct": float(row.rel_pct), "ci": [float(row.rel_ci_lo), float(row.rel_ci_hi)]}


def _fmt(change: dict[str, Any]) -> str:
    """``-0.31% [-0.40, -0.21]``."""
    return f"{change['change_pct']:+.2f}% [{change['ci'][0]:+.2f}, {change['ci'][1]:+.2f}]"


def _print(regions: dict[str, Any], rows: list[dict[str, Any]], pooled_out: dict[str, Any], args: Any) -> None:
    """The spread table: per comparison, each region's figure (all bases, the last bucket) then the pooled one."""
    last = next(iter(regions.values()))["buckets"][-1]
    print(
        f"\ntiles of {args.context:,}, {args.tiles} spread over each region; cut at {args.cut:,}; change B - A in % "
        f"(95% CI: per region over tiles, pooled over regions then tiles)\n"
    )
    print(f"| comparison | region | tiles | bases | all | {last} |")
    print("|---|---|---:|---:|---|---|")
    for what, p in pooled_out.items():
        for r in rows:
            if r["comparison"] != what:
                continue
            reg = regions[r["region"]]
            print(
                f"| {what} | {r['region']} | {reg['tiles']} | {reg['bases']:,} | {_fmt(r['buckets']['all'])} | "
                f"{_fmt(r['buckets'][last])} |"
            )
            for part in ("unmasked", "softmasked"):
                if part in r:
                    print(
                        f"| {what} | {r['region']} {part} | | {r[part]['all']['tokens']:,} | {_fmt(r[part]['all'])} | "
                        f"{_fmt(r[part][last])} |"
                    )
        rng = p["range"]
        print(
            f"| {what} | **pooled** (range) | {sum(x['tiles'] for x in regions.values())} | "
            f"{sum(x['bases'] for x in regions.values()):,} | {_fmt(p['buckets']['all'])} ({rng['all'][0]:+.2f} .. "
            f"{rng['all'][1]:+.2f}) | {_fmt(p['buckets'][last])} ({rng[last][0]:+.2f} .. {rng[last][1]:+.2f}) |"
        )


if __name__ == "__main__":
    main()

"""``genolong evaluate``: held-out loss by preceding context (:func:`genolong.evaluation.score.evaluate`),
on one process or several (:mod:`genolong.cli.scoring`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import DTYPES, SEGMENT_TOKENS, Command, Subcommands, by_argument, scoring_arguments, verbose_argument

if TYPE_CHECKING:
    from ..data.regions import Regions
    from ..evaluation.distributed import ScoringGroup

__all__ = ["COMMAND", "add", "add_regions_argument", "run", "split_regions"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``evaluate`` to the subcommands and return its parser."""
    ev = sub.add_parser(
        "evaluate",
        help="held-out loss of a model, by how much preceding context each base had (tables, 95%% intervals)",
        description=(
            "Tile a held-out split into windows of --context tokens, score every base with the model and write "
            "the per-token table (parquet), per-window and per-position sums and the bucket table. With --recipe "
            "(or --set parallel.devices=N ...) it runs on several processes as finetune does: the model sharded "
            "over the (dp_replicate, dp_shard, cp) mesh, tiles dealt to the data-parallel groups, each tile split "
            "over a context-parallel group, rank 0 writing; a killed run resumes on the same layout."
        ),
    )
    scoring_arguments(ev, out_default="evaluations/NAME-SPLIT-LCONTEXT[-cutC]")
    ev.add_argument(
        "--context",
        type=int,
        metavar="L",
        help="tile length in tokens (default: the run's eval context when CHECKPOINT is a run or .ckpt)",
    )
    ev.add_argument(
        "--context-cut",
        type=int,
        metavar="C",
        help="score the same tokens with at most C bases of context each (the model restarts every C bases)",
    )
    ev.add_argument("--max-tiles", type=int, metavar="N", help="score only the first N tiles (default: all)")
    ev.add_argument("--label", help="name of this run in tables and figures (default: from CHECKPOINT)")
    ev.add_argument("--no-tokens", action="store_true", help="do not write the per-token table (aggregates only)")
    ev.add_argument(
        "--tracks",
        action="store_true",
        help="also write the per-base loss as bigWig and bedGraph into OUT/tracks (see `genolong tracks`)",
    )
    add_regions_argument(ev)
    ev.add_argument(
        "--segment-tokens",
        type=int,
        default=None,
        metavar="S",
        help="stream a tile longer than S tokens through the model S at a time, carrying the KDA states "
        "and DSA caches (peak memory of one segment plus the caches; equal to the one-shot forward "
        f"up to float rounding); 0: one forward per tile (default: {SEGMENT_TOKENS} in one process; "
        "0 in several, where context parallelism splits the tile instead)",
    )
    by_argument(ev, "the printed bucket table")
    verbose_argument(ev)
    return ev


def add_regions_argument(parser: argparse.ArgumentParser) -> None:
    """``evaluate --regions BED``."""
    parser.add_argument(
        "--regions",
        metavar="BED",
        help="score only the tiles that share a base with these regions (BED: 0-based, half-open; any "
        "alias of a chromosome name); each tile whole, with its context",
    )


def split_regions(path: str | os.PathLike[str], split: Any, store: str | os.PathLike[str]) -> Regions:
    """``evaluate --regions``: the BED file read against the split's chromosomes (their store
    ``name`` s, reached through any alias; a region off them or past their end is an error)."""
    from ..data.regions import read_bed

    sizes: dict[str, int] = {}
    for record in split.contigs:
        sizes[str(record["name"])] = max(
            sizes.get(str(record["name"]), 0), int(record["start"]) + int(record["length"])
        )
    return read_bed(path, sizes, where=f"split {split.name!r} of {store}")


def run(args: argparse.Namespace) -> int:
    """Run ``genolong evaluate``: every check before the model loads, then the scoring on every
    process of the job; the writer prints the bucket table (and ``--by``'s, and MoE routing)."""
    from ..data.store import GenomeStore
    from ..errors import InputError
    from ..evaluation.distributed import launch
    from ..evaluation.report import format_bucket_table, format_routing_table
    from ..evaluation.score import evaluate
    from ..model.stream import check_segment_tokens
    from .scoring import load_model, parallel_section, scored_meta, scored_name, scoring_backend, scoring_context
    from .scoring import segment_tokens as streaming

    context = scoring_context(args)
    parallel = parallel_section(args)
    backend = scoring_backend(args)
    segment_tokens = streaming(args, parallel.world_size, "a tile ", "rank's share")
    check_segment_tokens(segment_tokens)  # before the model loads
    if args.tracks and args.no_tokens:
        raise InputError("--tracks are drawn from the per-token table: drop --no-tokens, or drop --tracks")
    store = GenomeStore.open(args.store)
    split = store.split(args.split)
    regions = split_regions(args.regions, split, store.path) if args.regions else None  # before the model loads
    name = scored_name(args)
    cut = f"-cut{args.context_cut}" if args.context_cut is not None else ""
    out = Path(args.out) if args.out else Path("evaluations") / f"{name}-{args.split}-L{context}{cut}"

    def work(group: ScoringGroup) -> int:
        model, vocab = load_model(args, group, backend)
        result = evaluate(
            model,
            split,
            out,
            context,
            context_cut=args.context_cut,
            max_tiles=args.max_tiles,
            first_bucket=args.first_bucket,
            write_tokens=not args.no_tokens,
            vocab=vocab,
            label=args.label or f"{name}{' cut ' + str(args.context_cut) if args.context_cut is not None else ''}",
            meta={
                **scored_meta(args),
                "store": str(store.path.resolve()),
                "split": args.split,
                "dtype": DTYPES[args.dtype],
                "device": args.device,
            },
            force=args.force,
            progress=None if not args.quiet else False,
            segment_tokens=segment_tokens,
            group=group,
            tracks=args.tracks,
            regions=regions,
        )
        if result is None:  # not the writer
            return 0
        print(
            f"genolong evaluate: {result.meta['tokens']:,} tokens in {result.meta['tiles']} tiles of {context:,} -> {out}"
        )
        print(format_bucket_table(result.bucket_table()))
        if args.by is not None:
            print(f"\nsplit by {args.by} (soft-masked = lower case in the FASTA, RepeatMasker's repeats):")
            print(format_bucket_table(result.bucket_table(by=args.by)))
        if result.meta.get("routing"):
            print("\nMoE routing over the scored tiles:")
            print(format_routing_table(result.meta["routing"]))
        return 0

    return launch(parallel, work)


COMMAND = Command("evaluate", add, run, model=True, scoring=True)

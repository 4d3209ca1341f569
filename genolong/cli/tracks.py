"""``genolong tracks``: genome-browser tracks (bigWig, bedGraph) of the per-base loss of ``evaluate``
results (:mod:`genolong.evaluation.tracks`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import Command, Subcommands

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``tracks`` to the subcommands and return its parser."""
    trk = sub.add_parser(
        "tracks",
        help="genome-browser tracks (bigWig, bedGraph) of the per-base loss of a result, or of B - A for two",
        description=(
            "From the per-token table of `genolong evaluate` results: the per-base loss (nats) of RESULT_DIR as "
            "NAME.nll.bw and NAME.nll.bedGraph (NAME: the result's label, file-safe); with a second result B on the "
            "same tiles also B's and the per-base difference B - A (NAMEB-minus-NAMEA.diff.*; negative: B predicts "
            "the base better), plus chrom.sizes. Genomic coordinates of the store; chromosome names and sizes from "
            "the store's manifest (the source FASTA's names and records) or --chrom-sizes (whose names the files "
            "then use). Unscored bases have no value."
        ),
    )
    trk.add_argument(
        "results",
        nargs="+",
        metavar="RESULT_DIR",
        help="one evaluate result, or two: A (reference, e.g. the base or the cut run) then B",
    )
    trk.add_argument("--out", metavar="DIR", help="output directory (default: the last RESULT_DIR/tracks)")
    trk.add_argument(
        "--chrom-sizes",
        metavar="FILE",
        help="UCSC chrom.sizes file (name<TAB>length) or the reference FASTA's .fai, instead of the sizes "
        "the store records; its names are the names written",
    )
    trk.add_argument(
        "--regions",
        metavar="BED",
        help="write only the bases inside these regions (BED: 0-based, half-open; any alias of a chromosome name)",
    )
    trk.add_argument(
        "--bin",
        type=int,
        default=1,
        metavar="N",
        help="mean per N-base bin (bins aligned to the chromosome start; zoom levels over the bins) "
        "instead of one value per base (default: %(default)s)",
    )
    trk.add_argument(
        "--formats",
        default="bigwig,bedgraph",
        metavar="LIST",
        help="files to write: bigwig, bedgraph or both, comma-separated (bedGraph takes about 35 bytes "
        "a base; bigWig about 6) (default: %(default)s)",
    )
    trk.add_argument(
        "--store", metavar="DIR", help="the genome store evaluated, if it moved since (default: from the result)"
    )
    trk.add_argument("--force", action="store_true", help="replace an existing --out")
    return trk


def run(args: argparse.Namespace) -> int:
    """Run ``genolong tracks`` (see :mod:`genolong.evaluation.tracks`)."""
    from ..errors import InputError
    from ..evaluation.results import EvalResult
    from ..evaluation.tracks import TRACKS_DIR, parse_formats, read_chrom_sizes, tracks_for_results, write_tracks

    formats = parse_formats(args.formats)
    results = [EvalResult.load(d) for d in args.results]
    out = Path(args.out) if args.out else Path(args.results[-1]) / TRACKS_DIR
    if out.exists() and not args.force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    sizes = read_chrom_sizes(args.chrom_sizes) if args.chrom_sizes else None
    tracks, sizes, source = tracks_for_results(results, sizes, args.store, regions=args.regions, bin_size=args.bin)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = write_tracks(out, tracks, sizes, source, formats)
    print(f"genolong tracks: {len(written)} files in {out}: {', '.join(p.name for p in written)}")
    return 0


COMMAND = Command("tracks", add, run)

"""``genolong prepare``: encode a genome into a store (:func:`genolong.data.prepare.prepare_genome`)."""

from __future__ import annotations

import argparse

# help defaults from genolong.defaults, never from the modules that use them (tests/cli/test_cli_startup.py)
from ..defaults import DEFAULT_MIN_GAP, DEFAULT_SPLITS
from .common import Command, Subcommands

__all__ = ["COMMAND", "add", "add_names_argument", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``prepare`` to the subcommands and return its parser."""
    prep = sub.add_parser(
        "prepare",
        help="encode a genome (FASTA, GenBank, EMBL) into a store of training and held-out chromosomes",
        description=(
            "Encode chromosomes of FASTA (plain, gzip or bgzip, with or without .fai/.gzi indexes), GenBank or "
            "EMBL files into a genome store, the input of finetune and evaluate: one token per base, "
            "soft-masked (lower-case) bases kept as such, long runs of N dropped (they split a chromosome into "
            "segments). Chromosomes not named in --train or --eval are skipped."
        ),
    )
    prep.add_argument("fasta", nargs="+", metavar="FASTA", help="input sequence file(s)")
    prep.add_argument("--out", required=True, metavar="DIR", help="store directory to create")
    prep.add_argument(
        "--train",
        default=",".join(DEFAULT_SPLITS["train"]),
        metavar="NAMES",
        help="comma-separated training chromosomes; chr1 and 1 name the same one (default: %(default)s)",
    )
    prep.add_argument(
        "--eval",
        default=",".join(DEFAULT_SPLITS["eval"]),
        metavar="NAMES",
        help="comma-separated held-out chromosomes (default: %(default)s)",
    )
    prep.add_argument(
        "--min-gap",
        type=int,
        default=DEFAULT_MIN_GAP,
        metavar="N",
        help="runs of at least N unknown bases (N) split a chromosome and are dropped (default: %(default)s)",
    )
    add_names_argument(prep)
    prep.add_argument("--force", action="store_true", help="replace an existing store at --out")
    prep.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return prep


def add_names_argument(parser: argparse.ArgumentParser) -> None:
    """``prepare --names source|ucsc`` (default ``source``)."""
    parser.add_argument(
        "--names",
        choices=("source", "ucsc"),
        default="source",
        help="chromosome names the store's outputs (tracks) use: source = the input's own (a b37 `>20` "
        "stays 20), ucsc = chr20; any alias (20, chr20, NC_000020.10) finds it either way "
        "(default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``genolong prepare``: encode, then print the summary (unless ``--quiet``)."""
    from ..data.prepare import format_summary, prepare_genome

    result = prepare_genome(
        args.fasta,
        args.out,
        train=args.train,
        eval=args.eval,
        min_gap=args.min_gap,
        force=args.force,
        names=args.names,
        progress=None if not args.quiet else False,
    )
    if not args.quiet:
        print(format_summary(result))
    return 0


COMMAND = Command("prepare", add, run)

"""The ``genolong`` command line: each subcommand parses its arguments and calls one function.

User errors (:class:`genolong.errors.GenolongError`) print as one line on stderr with exit code 2;
Ctrl-C exits with 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .errors import GenolongError

__all__ = ["main", "build_parser"]


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .data.prepare import format_summary, prepare_genome

    result = prepare_genome(
        args.fasta,
        args.out,
        train=args.train,
        eval=args.eval,
        min_gap=args.min_gap,
        force=args.force,
        progress=None if not args.quiet else False,
    )
    if not args.quiet:
        print(format_summary(result))
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import run_quickstart

    run_quickstart(out=Path(args.out), progress=None if not args.quiet else False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    from .data.prepare import DEFAULT_MIN_GAP, DEFAULT_SPLITS

    parser = argparse.ArgumentParser(prog="genolong", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"genolong {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prep = sub.add_parser(
        "prepare",
        help="FASTA -> packed zarr genome store (train / held-out splits by chromosome)",
        description=(
            "Encode chromosomes of FASTA (plain, gzip, bgzip +/- .fai/.gzi), GenBank or EMBL files into a "
            "genome store: one token per base, case kept, long N runs split chromosomes into segments."
        ),
    )
    prep.add_argument("fasta", nargs="+", metavar="FASTA", help="input sequence file(s)")
    prep.add_argument("--out", required=True, metavar="DIR", help="store directory to create")
    prep.add_argument("--train", default=",".join(DEFAULT_SPLITS["train"]), metavar="NAMES",
                      help="comma-separated train chromosomes, any naming convention (default: %(default)s)")
    prep.add_argument("--eval", default=",".join(DEFAULT_SPLITS["eval"]), metavar="NAMES",
                      help="comma-separated held-out chromosomes (default: %(default)s)")
    prep.add_argument("--min-gap", type=int, default=DEFAULT_MIN_GAP, metavar="N",
                      help="N runs of at least N bases split a chromosome and are dropped (default: %(default)s)")
    prep.add_argument("--force", action="store_true", help="replace an existing store at --out")
    prep.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    prep.set_defaults(func=_cmd_prepare)

    quick = sub.add_parser(
        "quickstart",
        help="the whole story on the bundled real human sample, on a CPU",
        description="Prepare the bundled human sample genome and print its summary.",
    )
    quick.add_argument("--out", default="genolong-quickstart", metavar="DIR",
                       help="working directory for the quickstart outputs (default: %(default)s)")
    quick.add_argument("--quiet", action="store_true", help="no progress bar")
    quick.set_defaults(func=_cmd_quickstart)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``genolong`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except GenolongError as exc:
        print(f"genolong {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"genolong {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

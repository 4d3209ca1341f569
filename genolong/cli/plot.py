"""``genolong plot``: figures from saved ``evaluate`` results (:func:`genolong.evaluation.plots.plot_results`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import Command, Subcommands, by_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``plot`` to the subcommands and return its parser."""
    plot = sub.add_parser(
        "plot",
        help="figures from evaluate results: loss vs position, bucket means, relative change",
        description=(
            "Draw per-position loss (log x, smoothed; runs overlaid), bucket means with 95% intervals and the relative "
            "change of each run vs the first, from saved `genolong evaluate` tables only."
        ),
    )
    plot.add_argument("results", nargs="+", metavar="RESULT_DIR", help="evaluate results; the first is the reference")
    plot.add_argument("--out", required=True, metavar="DIR", help="directory for the figures (created)")
    plot.add_argument(
        "--format",
        action="append",
        choices=["png", "pdf", "svg"],
        default=None,
        help="figure format, repeatable (default: png and pdf)",
    )
    plot.add_argument(
        "--n-boot", type=int, default=2000, metavar="N", help="bootstrap resamples (default: %(default)s)"
    )
    plot.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    by_argument(plot, "the bucket and relative-change figures (buckets_softmask, relative_change_softmask: two panels)")
    plot.set_defaults(format=None)
    return plot


def run(args: argparse.Namespace) -> int:
    """Run ``genolong plot``: write the figures and name them."""
    from ..evaluation.plots import plot_results
    from ..evaluation.results import EvalResult

    results = [EvalResult.load(d) for d in args.results]
    written = plot_results(
        results, Path(args.out), formats=args.format or ("png", "pdf"), n_boot=args.n_boot, seed=args.seed, by=args.by
    )
    print(f"genolong plot: {len(written)} files in {args.out}: {', '.join(sorted(written))}")
    return 0


COMMAND = Command("plot", add, run)

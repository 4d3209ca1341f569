"""``genolong quickstart``: the whole story on the bundled human sample, on a CPU
(:func:`genolong.quickstart.run_quickstart`)."""

from __future__ import annotations

import argparse
from pathlib import Path

# help defaults from genolong.defaults, never from the modules that use them (tests/cli/test_cli_startup.py)
from ..defaults import DEFAULT_EVAL_TILES, DEFAULT_PROBE_TILES, PROBE_CONTEXT
from .common import Command, Subcommands, set_argument, verbose_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``quickstart`` to the subcommands and return its parser."""
    quick = sub.add_parser(
        "quickstart",
        help="the whole story on a bundled sample of real human DNA, on a CPU (a few minutes)",
        description=(
            "Prepare the bundled human sample genome, evaluate the bundled short-context base model on held-out "
            "chr22, fine-tune it at long context (recipes/quickstart.yaml), evaluate it with full and with cut "
            "context (and a short-context control with --control), compare with bootstrap CIs, draw the figures "
            "and write OUT/REPORT.md."
        ),
    )
    quick.add_argument(
        "--out",
        default="genolong-quickstart",
        metavar="DIR",
        help="working directory for the quickstart outputs (default: %(default)s)",
    )
    quick.add_argument("--quiet", action="store_true", help="no progress bar")
    set_argument(quick, "override a key of recipes/quickstart.yaml, e.g. --set train.max_steps=2 (repeatable)")
    quick.add_argument("--prepare-only", action="store_true", help="prepare the sample store and stop")
    quick.add_argument(
        "--control",
        action="store_true",
        help="also train and evaluate the short-context control (same windows, context cut at the base's "
        "training length; a few more minutes)",
    )
    quick.add_argument(
        "--eval-tiles",
        type=int,
        default=DEFAULT_EVAL_TILES,
        metavar="N",
        help="held-out tiles scored per model (default: %(default)s)",
    )
    quick.add_argument(
        "--probe-tiles",
        type=int,
        default=DEFAULT_PROBE_TILES,
        metavar="N",
        help=f"held-out tiles of {PROBE_CONTEXT:,} bases the planted-repeat probe (genolong probe) runs on "
        "per model; 0: no probe (default: %(default)s)",
    )
    verbose_argument(quick)
    return quick


def run(args: argparse.Namespace) -> int:
    """Run ``genolong quickstart`` (its report: OUT/REPORT.md)."""
    from ..quickstart import run_quickstart

    run_quickstart(
        out=Path(args.out),
        progress=None if not args.quiet else False,
        overrides=args.set,
        train=not args.prepare_only,
        control=args.control,
        eval_tiles=args.eval_tiles,
        probe_tiles=args.probe_tiles,
    )
    return 0


COMMAND = Command("quickstart", add, run, model=True)

"""``genolong compare``: the change in held-out loss from one ``evaluate`` result to another, per
context bucket, with paired block-bootstrap intervals (:mod:`genolong.evaluation.stats`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import Command, Subcommands, by_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``compare`` to the subcommands and return its parser."""
    cmp_ = sub.add_parser(
        "compare",
        help="change in held-out loss from evaluation A to evaluation B, per context length, with 95%% intervals",
        description=(
            "Compare two `genolong evaluate` results on the same tokens (base vs tuned, full vs --context-cut, "
            "tuned vs control): per context bucket and overall, B - A in nats and in percent with 95% paired "
            "block-bootstrap intervals over tiles."
        ),
    )
    cmp_.add_argument("a", metavar="A_DIR", help="reference result (e.g. the base model, or the cut run)")
    cmp_.add_argument("b", metavar="B_DIR", help="result compared with it (e.g. the fine-tuned model)")
    cmp_.add_argument("--out", metavar="DIR", help="also write DIR/compare.csv")
    cmp_.add_argument(
        "--n-boot", type=int, default=2000, metavar="N", help="bootstrap resamples (default: %(default)s)"
    )
    cmp_.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    by_argument(
        cmp_,
        "the table (written as compare_softmask.csv, with softmask_gap.csv: the gap between the two "
        "classes' relative changes)",
    )
    return cmp_


def run(args: argparse.Namespace) -> int:
    """Run ``genolong compare``: print the table(s), and write them with ``--out``."""
    from ..evaluation.report import format_compare_table, format_gap_table, write_table
    from ..evaluation.results import EvalResult
    from ..evaluation.stats import compare, compare_softmask

    a, b = EvalResult.load(args.a), EvalResult.load(args.b)
    if args.by == "softmask":
        table, gap = compare_softmask(a, b, n_boot=args.n_boot, seed=args.seed)
        tables = {"compare_softmask.csv": table, "softmask_gap.csv": gap}
    else:
        tables = {"compare.csv": compare(a, b, n_boot=args.n_boot, seed=args.seed)}
    print(
        f"genolong compare: A = {a.label} ({args.a}), B = {b.label} ({args.b}); {a.tokens:,} tokens in {a.n_tiles} tiles; "
        f"95% paired block-bootstrap CIs over tiles ({args.n_boot} resamples)"
    )
    print(format_compare_table(next(iter(tables.values())), "A", "B"))
    if args.by == "softmask":
        print(
            "\nsoft-masked vs unmasked: the gap between the two relative changes (below 0: the loss falls more, "
            "or rises less, on soft-masked bases; the same resamples)"
        )
        print(format_gap_table(tables["softmask_gap.csv"]))
    if args.out:
        for name, table in tables.items():
            write_table(table, Path(args.out) / name)
        print(f"table(s) written to {', '.join(str(Path(args.out) / name) for name in tables)}")
    return 0


COMMAND = Command("compare", add, run)

"""``genolong check-logprobs``: the self-check that the training path and the step-by-step decode
path give the same log-probabilities (:func:`genolong.evaluation.logprobs.check_logprobs`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .common import DTYPES, Command, Subcommands, scoring_arguments, verbose_argument

if TYPE_CHECKING:
    from ..evaluation.distributed import ScoringGroup

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``check-logprobs`` to the subcommands and return its parser."""
    chk = sub.add_parser(
        "check-logprobs",
        help="self-check: the model's log-probabilities from training-style and step-by-step scoring agree",
        description=(
            "Score held-out tiles with the training path (chunked KDA, blockwise DSA top-k) and with the "
            "independent step-by-step decode path (recurrent KDA state, latent and index-key caches); report mean "
            "and max |difference| by preceding-context bucket, as a table and a figure. With --recipe (or --set "
            "parallel.*) the training path runs sharded and context-parallel, the decode path on the gathered model."
        ),
    )
    scoring_arguments(chk, out_default="evaluations/NAME-logprob-gap-LCONTEXT-DTYPE")
    chk.add_argument("--context", type=int, required=True, metavar="L", help="tile length in tokens")
    chk.add_argument("--max-tiles", type=int, default=1, metavar="N", help="tiles to check (default: %(default)s)")
    verbose_argument(chk)
    return chk


def run(args: argparse.Namespace) -> int:
    """Run ``genolong check-logprobs``: the gap per context bucket, saved by the writer and printed."""
    from ..data.store import GenomeStore
    from ..errors import InputError
    from ..evaluation.distributed import launch
    from ..evaluation.logprobs import check_logprobs
    from ..evaluation.report import markdown_table
    from .scoring import load_model, parallel_section, scored_meta, scored_name, scoring_backend

    name = Path(args.checkpoint).resolve().name
    if args.adapter is not None:
        name = scored_name(args)
    out = (
        Path(args.out) if args.out else Path("evaluations") / f"{name}-logprob-gap-L{args.context}-{DTYPES[args.dtype]}"
    )
    if out.exists() and not args.force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    parallel = parallel_section(args)
    backend = scoring_backend(args)
    split = GenomeStore.open(args.store).split(args.split)

    def work(group: ScoringGroup) -> int:
        model, vocab = load_model(args, group, backend)
        label = Path(args.checkpoint).name if args.adapter is None else scored_name(args)
        gap = check_logprobs(
            model,
            split,
            args.context,
            max_tiles=args.max_tiles,
            first_bucket=args.first_bucket,
            vocab=vocab,
            progress=None if not args.quiet else False,
            label=f"{label} {DTYPES[args.dtype]}",
            group=group,
        )
        if gap is None:  # not the writer
            return 0
        gap.extra.update(scored_meta(args))
        gap.save(out)
        table = gap.table()
        rows = [
            [str(r.bucket), f"{int(r.tokens):,}", f"{r.mean_abs_diff:.3g}", f"{r.max_abs_diff:.3g}"]
            for r in table.itertuples()
        ]
        print(
            f"genolong check-logprobs: training path vs step-by-step decode, {DTYPES[args.dtype]}, {args.max_tiles} tile(s) of "
            f"{args.context:,} -> {out}"
        )
        print(markdown_table(rows, ["preceding bases", "tokens", "mean |diff| (nats)", "max |diff| (nats)"]))
        return 0

    return launch(parallel, work)


COMMAND = Command("check-logprobs", add, run, model=True, scoring=True)

"""``genolong probe``: does the model use far context? The loss on a planted copy with its source in
view and cut away (:func:`genolong.evaluation.probe.probe`), on one process or several."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .common import DTYPES, SEGMENT_TOKENS, Command, Subcommands, int_list, scoring_arguments, verbose_argument

if TYPE_CHECKING:
    from ..evaluation.distributed import ScoringGroup

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``probe`` to the subcommands and return its parser."""
    prb = sub.add_parser(
        "probe",
        help="does the model use far context? loss on a planted copy with its source in view and cut away",
        description=(
            "On held-out tiles of --context bases, overwrite the last --repeat-bases bases with the segment d bases "
            "before them, for d in powers of two up to the context, and score the copy twice on the same model: with "
            "the whole tile in view (the source d bases back included) and with the model restarted d - 1 bases "
            "before the copy's end (no base of the source in view). Prints and writes, per distance, both losses and "
            "the drop (cut - full) with 95% paired block-bootstrap CIs over tiles; a figure (PNG + PDF) and JSON."
        ),
    )
    scoring_arguments(prb, out_default="evaluations/NAME-SPLIT-LCONTEXT-probeM", buckets=False)
    prb.add_argument(
        "--context",
        type=int,
        metavar="L",
        help="tile length in bases (default: the run's eval context when CHECKPOINT is a run or .ckpt)",
    )
    prb.add_argument("--repeat-bases", type=int, default=100, metavar="M", help="bases copied (default: %(default)s)")
    prb.add_argument(
        "--distances",
        metavar="D1,D2,...",
        help="distances from source to copy (default: the powers of two with M < d <= L - M)",
    )
    prb.add_argument(
        "--max-tiles", type=int, metavar="N", help="probe only the first N full-length tiles (default: all)"
    )
    prb.add_argument("--label", help="name of this run in tables and figures (default: from CHECKPOINT)")
    prb.add_argument(
        "--segment-tokens",
        type=int,
        default=None,
        metavar="S",
        help="stream forwards longer than S tokens S at a time (as evaluate); 0: one forward each "
        f"(default: {SEGMENT_TOKENS} in one process; 0 in several)",
    )
    verbose_argument(prb)
    return prb


def run(args: argparse.Namespace) -> int:
    """Run ``genolong probe``: the settings checked before the model loads, then the probe on every
    process of the job; the writer prints the table per distance."""
    from ..data.store import GenomeStore
    from ..evaluation.distributed import launch
    from ..evaluation.probe import ProbeSettings, probe
    from ..evaluation.report import format_probe_table
    from .scoring import load_model, parallel_section, scored_meta, scored_name, scoring_backend, scoring_context
    from .scoring import segment_tokens as streaming

    context = scoring_context(args)
    distances = int_list(args.distances, "--distances") if args.distances else ()
    parallel = parallel_section(args)
    backend = scoring_backend(args)
    segment_tokens = streaming(args, parallel.world_size, "", "view")  # streaming is one process's (as in evaluate)
    ProbeSettings(
        context, args.repeat_bases, distances, segment_tokens=segment_tokens
    )  # bad settings: before the model loads
    store = GenomeStore.open(args.store)
    split = store.split(args.split)
    name = scored_name(args)
    out = (
        Path(args.out) if args.out else Path("evaluations") / f"{name}-{args.split}-L{context}-probe{args.repeat_bases}"
    )

    def work(group: ScoringGroup) -> int:
        model, vocab = load_model(args, group, backend)
        result = probe(
            model,
            split,
            out,
            context,
            repeat_bases=args.repeat_bases,
            distances=distances,
            max_tiles=args.max_tiles,
            vocab=vocab,
            label=args.label or name,
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
        )
        if result is None:  # not the writer
            return 0
        print(
            f"genolong probe: a {args.repeat_bases}-base copy planted d bases after its source in {result.meta['tiles']} "
            f"tiles of {context:,} -> {out}; 95% paired block-bootstrap CIs over tiles"
        )
        print(format_probe_table(result.table()))
        return 0

    return launch(parallel, work)


COMMAND = Command("probe", add, run, model=True, scoring=True)

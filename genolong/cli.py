"""The ``genolong`` command line: each subcommand parses its arguments and calls one function.

User errors (:class:`genolong.errors.GenolongError`) print as one line on stderr with exit code 2;
Ctrl-C exits with 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
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

    run_quickstart(out=Path(args.out), progress=None if not args.quiet else False, overrides=args.set,
                   train=not args.prepare_only)
    return 0


def _cmd_finetune(args: argparse.Namespace) -> int:
    from .config import load_recipe
    from .train.finetune import run

    recipe = load_recipe(args.recipe, args.set)
    result = run(recipe, resume=args.resume)
    done = f"genolong finetune: {recipe.name}: {result.global_step} steps; logs in {result.paths.logs}"
    print(done + (f"; model exported to {result.export}" if result.export else ""))
    return 0


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _cmd_evaluate(args: argparse.Namespace) -> int:
    import torch

    from .data.store import GenomeStore
    from .errors import InputError
    from .evaluation.report import format_bucket_table
    from .evaluation.score import evaluate, load_eval_model, recipe_context

    context = args.context if args.context is not None else recipe_context(args.checkpoint)
    if context is None:
        raise InputError(f"give --context L: {args.checkpoint} is not a finetune run or checkpoint with a recipe to take it from")
    store = GenomeStore.open(args.store)
    split = store.split(args.split)
    dtype = getattr(torch, _DTYPES[args.dtype])
    model, vocab = load_eval_model(args.checkpoint, dtype=dtype, device=args.device)
    name = Path(args.checkpoint).resolve()
    name = name.parent.parent.name if name.suffix == ".ckpt" else (name.parent.name if name.name == "export" else name.name)
    cut = f"-cut{args.context_cut}" if args.context_cut is not None else ""
    out = Path(args.out) if args.out else Path("evaluations") / f"{name}-{args.split}-L{context}{cut}"
    result = evaluate(
        model, split, out, context, context_cut=args.context_cut, max_tiles=args.max_tiles,
        first_bucket=args.first_bucket, write_tokens=not args.no_tokens, vocab=vocab,
        label=args.label or f"{name}{' cut ' + str(args.context_cut) if args.context_cut is not None else ''}",
        meta={"checkpoint": str(Path(args.checkpoint).resolve()), "store": str(store.path.resolve()), "split": args.split,
              "dtype": _DTYPES[args.dtype], "device": args.device},
        force=args.force, progress=None if not args.quiet else False,
    )
    print(f"genolong evaluate: {result.meta['tokens']:,} tokens in {result.meta['tiles']} tiles of {context:,} -> {out}")
    print(format_bucket_table(result.bucket_table()))
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

    tune = sub.add_parser(
        "finetune",
        help="train GenoLM on a genome store from a YAML recipe (Lightning)",
        description=(
            "Fine-tune (or train from scratch) the GLM-5.3-Flash-architecture model on the windows of a genome "
            "store, with the recipe's memory techniques; checkpoints, logs and the exported model go to runs/NAME/."
        ),
    )
    tune.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/)")
    tune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a recipe key, e.g. --set train.max_steps=20 (repeatable)")
    tune.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of this run")
    tune.set_defaults(func=_cmd_finetune)

    ev = sub.add_parser(
        "evaluate",
        help="held-out loss per token and by preceding-context length (tables, block-bootstrap CIs)",
        description=(
            "Tile a held-out split into windows of --context tokens, score every base with the model and write "
            "the per-token table (parquet), per-window and per-position sums and the bucket table."
        ),
    )
    ev.add_argument("checkpoint", metavar="CHECKPOINT",
                    help="a model directory (config.json + safetensors, e.g. runs/NAME/export), a run directory "
                         "runs/NAME or a runs/NAME/checkpoints/step*.ckpt")
    ev.add_argument("--store", required=True, metavar="DIR", help="genome store (genolong prepare)")
    ev.add_argument("--split", default="eval", help="split to score (default: %(default)s)")
    ev.add_argument("--context", type=int, metavar="L",
                    help="tile length in tokens (default: the run's eval context when CHECKPOINT is a run or .ckpt)")
    ev.add_argument("--context-cut", type=int, metavar="C",
                    help="score the same tokens with at most C bases of context each (the model restarts every C bases)")
    ev.add_argument("--max-tiles", type=int, metavar="N", help="score only the first N tiles (default: all)")
    ev.add_argument("--first-bucket", type=int, default=1024, metavar="B",
                    help="upper edge of the first context bucket; later ones double (default: %(default)s)")
    ev.add_argument("--out", metavar="DIR", help="result directory (default: evaluations/NAME-SPLIT-LCONTEXT[-cutC])")
    ev.add_argument("--label", help="name of this run in tables and figures (default: from CHECKPOINT)")
    ev.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="parameter dtype (default: %(default)s)")
    ev.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    ev.add_argument("--no-tokens", action="store_true", help="do not write the per-token table (aggregates only)")
    ev.add_argument("--force", action="store_true", help="replace an existing --out")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=_cmd_evaluate)

    quick = sub.add_parser(
        "quickstart",
        help="the whole story on the bundled real human sample, on a CPU",
        description=(
            "Prepare the bundled human sample genome, measure the bundled base model on held-out chr22, fine-tune "
            "it at long context (recipes/quickstart.yaml) and measure it again."
        ),
    )
    quick.add_argument("--out", default="genolong-quickstart", metavar="DIR",
                       help="working directory for the quickstart outputs (default: %(default)s)")
    quick.add_argument("--quiet", action="store_true", help="no progress bar")
    quick.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of recipes/quickstart.yaml, e.g. --set train.max_steps=2 (repeatable)")
    quick.add_argument("--prepare-only", action="store_true", help="prepare the sample store and stop")
    quick.set_defaults(func=_cmd_quickstart)
    return parser


def _setup_logging() -> None:
    """genolong's own log lines (checkpoint loading, kernel backend) on stderr, once."""
    logger = logging.getLogger("genolong")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``genolong`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging()
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

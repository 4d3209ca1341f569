"""What several commands share: the :class:`Command` record every command module declares, and
the arguments that more than one parser takes (what to score, on which processes, with which
kernels), each added by one function so that their help reads the same everywhere.

Building a parser imports no numpy, pandas, zarr, torch or Lightning (tests/cli/test_cli_startup.py):
help defaults come from :mod:`genolong.defaults`, the ``--kernel-backend`` choices from the kernel
registry (:mod:`genolong.kernels.backends`, which imports a backend's modules only when the backend
is first asked for), never from the modules that do the work.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "Command",
    "DTYPES",
    "SEGMENT_TOKENS",
    "Subcommands",
    "backend_choices",
    "by_argument",
    "checkpoint_argument",
    "int_list",
    "kernel_backend_argument",
    "parallel_arguments",
    "placement_arguments",
    "scoring_arguments",
    "set_argument",
    "verbose_argument",
]

#: what ``build_parser`` hands each command's ``add``: the ``genolong`` parser's subcommands
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: ``evaluate --segment-tokens`` default: a tile up to 64k tokens runs in one forward (as before); a
#: longer one streams, so the peak is one segment's working set plus the caches instead of growing
#: with the tile (262k tokens of the bundled base: 0.42x the one-shot peak RSS at 0.95x its time,
#: benchmarks/stream_eval.py; a 1,048,576-token tile peaks at 6.32 GiB)
SEGMENT_TOKENS = 65536

#: ``--dtype`` choices -> the torch dtype's name
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Command:
    """One ``genolong`` subcommand, as its module declares it (``COMMAND = Command(...)``).

    Attributes:
        name: the subcommand (``genolong NAME``).
        add: adds its parser to the subcommands and returns it (:func:`genolong.cli.build_parser`
            then sets ``func`` to ``run``).
        run: does the work for the parsed arguments; returns the exit code. Imports what it needs
            inside (numpy, torch, ...), so that building the parser stays light.
        model: it runs a model: its CPU runs keep freed memory (:mod:`genolong.allocator`).
            Default False.
        scoring: it scores a model on one process or several (``--recipe`` / ``--set
            parallel.*``); several keep glibc's allocator (:func:`genolong.cli.main`). Default False.
    """

    name: str
    add: Callable[[Subcommands], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]
    model: bool = False
    scoring: bool = False


def backend_choices() -> tuple[str, ...]:
    """``--kernel-backend`` choices: every backend the kernel registry holds, ``auto`` (what a
    scoring command falls back to) first, then the others in the order they were registered."""
    from ..kernels.backends import available_backends

    names = available_backends()
    return (*(n for n in names if n == "auto"), *(n for n in names if n != "auto"))


def int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"128,256,1024"`` -> (128, 256, 1024); a one-line error naming ``flag`` otherwise."""
    from ..errors import InputError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{flag} must be comma-separated integers (e.g. 128,256,512), got {text!r}") from None


def checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """``CHECKPOINT``: the model a scoring command loads."""
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a model directory (config.json + safetensors, e.g. runs/NAME/export), a run directory "
        "runs/NAME or a runs/NAME/checkpoints/step*.ckpt",
    )


def placement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``: the parameters' dtype and where the model runs."""
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (default: %(default)s)"
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")


def kernel_backend_argument(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002 - argparse's keyword
    """``--kernel-backend NAME`` (default None: :func:`genolong.cli.scoring.scoring_backend`
    decides), one of :func:`backend_choices`."""
    parser.add_argument("--kernel-backend", choices=backend_choices(), default=None, help=help)


def set_argument(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002 - argparse's keyword
    """``--set KEY=VALUE`` (repeatable, a list in ``args.set``): an override of a recipe key."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help)


def scoring_arguments(parser: argparse.ArgumentParser, out_default: str, buckets: bool = True) -> None:
    """The arguments ``evaluate``, ``check-logprobs`` and ``probe`` share: what to score, where, how
    (``buckets``: with ``--first-bucket``)."""
    checkpoint_argument(parser)
    parser.add_argument(
        "--adapter",
        metavar="DIR",
        help="a LoRA adapter for the base model CHECKPOINT, in the PEFT format (adapter_config.json "
        "+ adapter_model.safetensors: a LoRA run's runs/NAME/adapter, or peft's save_pretrained): "
        "merged into the loaded weights in memory (W + alpha/r BA, summed in float32; equal to "
        "the base with separate adapters to float32 rounding), nothing written to disk; recorded "
        "in the results' metadata (default: none)",
    )
    parser.add_argument("--store", required=True, metavar="DIR", help="genome store (genolong prepare)")
    parser.add_argument("--split", default="eval", help="split to score (default: %(default)s)")
    if buckets:
        parser.add_argument(
            "--first-bucket",
            type=int,
            default=1024,
            metavar="B",
            help="upper edge of the first context bucket; later ones double (default: %(default)s)",
        )
    placement_arguments(parser)
    parser.add_argument("--out", metavar="DIR", help=f"result directory (default: {out_default})")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parallel_arguments(parser)
    kernel_backend_argument(
        parser,
        "the kernels the model runs, as in finetune: auto = genolong's Triton / "
        "fla-core GPU kernels on a GPU, the torch reference on a CPU (default: --recipe's "
        "model.overrides.kernel_backend, else the checkpoint's run recipe's, else auto); "
        "recorded in the results' metadata",
    )


def parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--recipe`` / ``--set``: the processes a scoring command runs on
    (:func:`genolong.cli.scoring.parallel_section`)."""
    parser.add_argument(
        "--recipe",
        metavar="RECIPE",
        help="run on this recipe's parallel section (devices, num_nodes, accelerator, cp, dp_shard, "
        "dp_replicate, ep), as `genolong finetune RECIPE` does: Lightning starts parallel.devices "
        "processes per node, or joins those torchrun / SLURM started; the model is sharded over "
        "the mesh (FSDP2, context and expert parallelism) and loaded shard by shard. Default: one "
        "process",
    )
    set_argument(
        parser,
        "override a key of --recipe, or without it set the parallel section alone, e.g. "
        "--set parallel.devices=4 --set parallel.cp=2 (repeatable)",
    )


def by_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--by softmask``: split ``what`` by the target base's soft-masking (RepeatMasker's lower case)."""
    parser.add_argument(
        "--by",
        choices=["softmask"],
        default=None,
        help=f"also split {what} by soft-masked (lower-case: repeats) vs unmasked bases, with the "
        "same paired block-bootstrap intervals (default: all bases pooled)",
    )


def verbose_argument(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` for the commands that run a model (genolong.console)."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show Lightning's and torch's own messages and warnings, from every process",
    )

"""The steps the scoring commands (``evaluate``, ``probe``, ``check-logprobs``, ``variants``) share
before and around their work: the processes they run on (the recipe layer's ``parallel`` section),
the kernel backend, the context, how a tile streams, the model each process loads and the name and
metadata of what was scored.

Everything heavy (the recipe schema, torch, the scorer) is imported inside the functions: the
parser never needs it.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import DTYPES, SEGMENT_TOKENS

if TYPE_CHECKING:
    import torch
    from pydantic.fields import FieldInfo

    from ..config import ParallelSection
    from ..evaluation.distributed import ScoringGroup
    from ..model.vocab import VocabMap

__all__ = [
    "dtype",
    "load_model",
    "parallel_from_sets",
    "parallel_section",
    "scored_meta",
    "scored_name",
    "scoring_backend",
    "scoring_context",
    "scoring_device",
    "segment_tokens",
]


def parallel_section(args: argparse.Namespace) -> ParallelSection:
    """The ``parallel`` section a scoring command runs on: ``--recipe R``'s (with its ``--set``
    overrides), or the one-process default with ``--set parallel.KEY=VALUE`` items on top
    (:func:`parallel_from_sets`).

    Raises:
        InputError: as :func:`genolong.config.load_recipe`, or :func:`parallel_from_sets`.
    """
    from ..config import load_recipe

    if args.recipe is not None:
        return load_recipe(args.recipe, args.set).parallel
    return parallel_from_sets(args.set)


def parallel_from_sets(items: Sequence[str]) -> ParallelSection:
    """The default :class:`~genolong.config.ParallelSection` with ``parallel.KEY=VALUE`` items on
    top (a later item of a key wins), each value checked by the section's own schema (its field
    types and bounds).

    Raises:
        InputError: an item's key outside ``parallel.`` or not a field of the section; a value the
            section refuses, worded from the field's type (:func:`_needs`).
    """
    import pydantic

    from ..config import ParallelSection, parse_set
    from ..errors import InputError

    fields = list(_section_fields())
    values: dict[str, Any] = {}
    for item in items:
        key, value = parse_set(item)
        name = key.removeprefix("parallel.")
        if not key.startswith("parallel.") or name not in fields:
            raise InputError(
                f"--set {item!r}: without --recipe only the parallel section can be set, one of "
                f"{', '.join('parallel.' + f for f in fields)}"
            )
        try:  # the section checks the value (a value as its field holds it: an integer number of seconds as a float)
            values[name] = getattr(ParallelSection(**{name: value}), name)
        except pydantic.ValidationError:
            raise InputError(f"--set {item!r}: {_needs(name)}") from None
    return ParallelSection(**values)


def _section_fields() -> dict[str, FieldInfo]:
    """The ``parallel`` section's fields in the order it declares them: pydantic's record of each
    (its type, its bounds)."""
    from pydantic.dataclasses import is_pydantic_dataclass

    from ..config import ParallelSection

    section: type[Any] = ParallelSection
    if not is_pydantic_dataclass(section):  # the recipe layer declares its sections as pydantic dataclasses
        raise TypeError(f"{section.__name__} is not a pydantic dataclass")
    return section.__pydantic_fields__


def _needs(name: str) -> str:
    """What the ``parallel`` section's field ``name`` holds, as one clause from its declared type:
    ``parallel.accelerator is one of cpu, gpu, cuda, auto``, ``parallel.cp must be an integer``,
    ``parallel.timeout_s must be a number of seconds > 0`` (a ``_s`` field holds seconds)."""
    field = _section_fields()[name]
    if typing.get_origin(field.annotation) is typing.Literal:
        return f"parallel.{name} is one of {', '.join(map(str, typing.get_args(field.annotation)))}"
    if field.annotation is float:
        unit = " of seconds" if name.endswith("_s") else ""
        bounds = "".join(f" > {bound.gt}" for bound in field.metadata if hasattr(bound, "gt"))
        return f"parallel.{name} must be a number{unit}{bounds}"
    return f"parallel.{name} must be an integer"


def scoring_backend(args: argparse.Namespace) -> str | None:
    """``--kernel-backend``, else ``--recipe``'s ``model.overrides.kernel_backend``; None leaves the
    choice to the checkpoint's run recipe, else ``auto`` (:func:`genolong.evaluation.score.scoring_kernel_backend`)."""
    if args.kernel_backend is not None or args.recipe is None:
        return args.kernel_backend
    from ..config import load_recipe

    backend = load_recipe(args.recipe, args.set).model.overrides.get("kernel_backend")
    return None if backend is None else str(backend)


def scoring_context(args: argparse.Namespace, give: str = "--context L") -> int:
    """``--context``, else the eval context of the run ``CHECKPOINT`` names.

    Raises:
        InputError: neither (the message asks for ``give``).
    """
    from ..errors import InputError
    from ..evaluation.score import recipe_context

    context = args.context if args.context is not None else recipe_context(args.checkpoint)
    if context is None:
        raise InputError(
            f"give {give}: {args.checkpoint} is not a finetune run or checkpoint with a recipe to take it from"
        )
    return int(context)


def segment_tokens(args: argparse.Namespace, world: int, streams: str, each: str) -> int | None:
    """``--segment-tokens`` of ``evaluate`` and ``probe`` (None: one forward): unset, the default
    :data:`~genolong.cli.common.SEGMENT_TOKENS` in one process and one forward in several (where a
    context-parallel group splits the tile instead); 0, one forward.

    Raises:
        InputError: a streaming length for a job of several processes (before they start: one
            line, not one per rank); ``streams`` and ``each`` word it (what streams, and what
            each rank runs in one forward instead).
    """
    from ..errors import InputError

    if args.segment_tokens is None:  # streaming is one process's: a multi-process job splits the tile instead
        return SEGMENT_TOKENS if world == 1 else None
    if world > 1 and args.segment_tokens != 0:
        raise InputError(
            f"--segment-tokens streams {streams}in one process; this job runs {world} processes, each "
            f"{each} in one forward: pass --segment-tokens 0 (context parallelism splits the tile)"
        )
    return None if args.segment_tokens == 0 else int(args.segment_tokens)


def scoring_device(args: argparse.Namespace, group: ScoringGroup) -> str:
    """``--device`` in one process; each rank's own device (Lightning's choice) in several."""
    import torch

    if not group.distributed:
        return str(args.device)
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def dtype(args: argparse.Namespace) -> torch.dtype:
    """``--dtype`` as a torch dtype."""
    import torch

    return typing.cast("torch.dtype", getattr(torch, DTYPES[args.dtype]))


def load_model(
    args: argparse.Namespace, group: ScoringGroup, backend: str | None
) -> tuple[torch.nn.Module, VocabMap | None]:
    """``CHECKPOINT`` (with ``--adapter`` merged) as this process of ``group`` scores it: ``--dtype``,
    its device (:func:`scoring_device`), the kernel ``backend`` (:func:`scoring_backend`)."""
    from ..evaluation.distributed import load_scoring_model

    return load_scoring_model(
        args.checkpoint,
        group,
        dtype=dtype(args),
        device=scoring_device(args, group),
        kernel_backend=backend,
        adapter=args.adapter,
    )


def scored_name(args: argparse.Namespace) -> str:
    """The scored model's name for default output paths and labels: the run's name for a run,
    its ``export/`` or a ``step*.ckpt``, else the checkpoint's; ``BASE+ADAPTER`` with ``--adapter``
    (the adapter's run name for a ``runs/NAME/adapter``)."""
    path = Path(args.checkpoint).resolve()
    if path.suffix == ".ckpt":  # runs/NAME/checkpoints/step*.ckpt
        name = path.parent.parent.name
    else:
        name = path.parent.name if path.name == "export" else path.name
    if args.adapter is None:
        return name
    adapter = Path(args.adapter).resolve()
    return f"{name}+{adapter.parent.name if adapter.name == 'adapter' else adapter.name}"


def scored_meta(args: argparse.Namespace) -> dict[str, str]:
    """What was scored, for the results' metadata: the checkpoint and, with ``--adapter``, the
    adapter directory (absolute paths)."""
    meta = {"checkpoint": str(Path(args.checkpoint).resolve())}
    if args.adapter is not None:
        meta["adapter"] = str(Path(args.adapter).resolve())
    return meta

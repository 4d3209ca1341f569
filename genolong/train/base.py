"""A run's base checkpoint (``model.checkpoint``): its weights read into the sharded model, the
reference to it that every checkpoint records, and the restore of a checkpoint that holds only
what training changed (the frozen weights come from the base again).

- :func:`load_base_weights`: the sharded loader (:mod:`genolong.parallel.load`) for the module's
  meta-device model, once parallelized;
- :func:`base_reference` / :func:`check_same_base`: the base's path and digest
  (:func:`genolong.parallel.load.base_digest`), saved in every checkpoint, checked on ``--resume``;
- :func:`load_partial_dcp`: Lightning's sharded restore for a checkpoint without the frozen weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..config import Recipe
from ..errors import InputError
from ..model.lm import GenoLM
from ..units import format_bytes

__all__ = ["absent_keys", "base_reference", "check_same_base", "load_base_weights", "load_partial_dcp"]

log = logging.getLogger("genolong")


def load_base_weights(
    recipe: Recipe, resume: bool, model: GenoLM, kept: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """The sharded loader (:mod:`genolong.parallel.load`) for a model built on the meta device
    from ``model.checkpoint`` and parallelized: the base's files checked (each rank a share of the
    checksums), this rank's shards allocated in their dtypes, ``kept`` (LoRA's adapters) put back,
    and this rank's rows of every base tensor read. With ``resume`` the trained parameters and the
    buffers are not read: the checkpoint restores them next."""
    from ..parallel.load import check_base, fill_from_safetensors, load_report, materialize, resident_peak

    base = recipe.model.checkpoint
    assert base is not None
    check_base(base)
    before = resident_peak(reset=True)
    materialize(model, device, kept)
    skip = None
    if resume:
        restored = {name for name, p in model.named_parameters() if p.requires_grad} | {
            name for name, _ in model.named_buffers()
        }
        skip = restored.__contains__
    counter = fill_from_safetensors(model, base, skip=skip)
    load_report(model, counter, before, resident_peak())
    log.info(
        "genolong: read %s of %s for this rank's shards (%d files)",
        format_bytes(counter.bytes),
        base,
        len(counter.files),
    )


def base_reference(recipe: Recipe) -> dict[str, str] | None:
    """What a run's checkpoints record of its base (``model.checkpoint``): its path and
    :func:`genolong.parallel.load.base_digest`; None for a run from a preset's fresh weights."""
    from ..parallel.load import base_digest

    base = recipe.model.checkpoint
    if base is None:
        return None
    return {"path": str(base), "digest": base_digest(base)}


def _saved_genolong_state(checkpoint: Path) -> dict[str, Any]:
    """The ``genolong`` entry of a checkpoint (file, or ``meta.pt`` of a sharded directory), read
    without its tensors (mmap)."""
    source = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint
    state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    return dict(state.get("genolong", {}))


def check_same_base(checkpoint: Path, base: dict[str, str] | None) -> None:
    """``--resume`` reads the frozen weights from the recipe's base again: it must be the base the
    checkpoint was trained from (its digest, recorded at every save).

    Raises:
        InputError: another base (or none) than the checkpoint's.
    """
    saved = _saved_genolong_state(checkpoint).get("base")
    if saved is None:
        return  # an older checkpoint, or a run from fresh weights: it holds every parameter
    if base is None or base["digest"] != saved.get("digest"):
        now = (
            "no model.checkpoint"
            if base is None
            else f"model.checkpoint {base['path']} (digest {base['digest'][:24]}...)"
        )
        raise InputError(
            f"--resume: {checkpoint.name} holds only what training changed on the base {saved.get('path')} "
            f"(digest {str(saved.get('digest'))[:24]}...), but the recipe has {now}; point model.checkpoint "
            "to that base"
        )


def load_partial_dcp(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    path: Path,
    stored: set[str],
    weights_only: bool | None,
) -> dict[str, Any]:
    """Lightning's sharded restore (``lightning.fabric.strategies.model_parallel._load_checkpoint``)
    of a checkpoint that holds only what training changed: the model keys it holds, into the
    sharded model in place, then the optimiser states; returns the rest (``meta.pt``)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    module_state = {k: v for k, v in get_model_state_dict(model).items() if k in stored}
    load({"state_dict": module_state}, checkpoint_id=path)
    model.load_state_dict(module_state, strict=False)
    for i, optimizer in enumerate(optimizers):
        optim_state = {f"optimizer_{i}": get_optimizer_state_dict(model, optimizer)}
        load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=optim_state[f"optimizer_{i}"], options=StateDictOptions(cpu_offload=True)
        )
    return torch.load(path / "meta.pt", weights_only=True if weights_only is None else weights_only)


def absent_keys(model: torch.nn.Module, module: Any, present: set[str], path: Path) -> list[str]:
    """The state keys of ``model`` (Lightning's, holding the GenoLM as ``model.``) a checkpoint
    lacks (``present``: the keys it holds), once checked to be frozen parameters that the base
    supplies (``module``: the :class:`~genolong.train.module.GenoLMModule`, whose
    ``checkpoint_frozen`` False says the base is read again).

    Raises:
        InputError: a trained parameter or a buffer missing, or frozen ones missing from the
            checkpoint of a run without a base to read them from.
    """
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    absent = [k for k in model.state_dict() if k not in present]
    trained = [k for k in absent if k not in frozen]
    if trained:
        raise InputError(
            f"{path} lacks {trained[0].removeprefix('model.')}, which this run trains: it was written by a run "
            "with other model.freeze / model.lora settings; resume with that recipe"
        )
    if absent and getattr(module, "checkpoint_frozen", True):
        raise InputError(
            f"{path} lacks the frozen {absent[0].removeprefix('model.')}, kept in the base checkpoint it was "
            "trained from; set model.checkpoint to that base"
        )
    return absent

"""The checkpoint a scoring command runs: find it, read its run's recipe, load the whole model.

``genolong evaluate``, ``check-logprobs`` and ``probe`` accept the same checkpoints: a
GLM-5.3-Flash-format directory (a run's ``export/``), a fine-tune run directory, or a Lightning
``step*.ckpt`` (a file from a one-process run, a sharded directory from a multi-process one).
:func:`load_eval_model` loads any of them into one process; the multi-process loader
(:func:`genolong.evaluation.distributed.load_scoring_model`) starts from the same recipe and kernel
backend (:func:`run_recipe`, :func:`scoring_kernel_backend`). Below both ``score`` and
``distributed``, which import it (``genolong.evaluation.score`` re-exports its public names).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..data.alphabet import VOCAB_SIZE
from ..errors import InputError
from ..integrity import check_weights
from ..model.lm import GenoLM
from ..model.vocab import VocabMap

__all__ = ["load_eval_model", "recipe_context", "run_recipe", "scoring_kernel_backend"]


def load_eval_model(checkpoint: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu",
                    kernel_backend: str | None = None) -> tuple[GenoLM, VocabMap | None]:
    """The model to evaluate and its vocabulary map, from any of:

    - a GLM-5.3-Flash-format directory (config.json + safetensors; e.g. a run's ``export/``);
    - a fine-tune run directory (``runs/NAME``, holding ``export/``);
    - a Lightning checkpoint ``runs/NAME/checkpoints/stepNNNNNNN.ckpt`` (weights and the resolved
      recipe inside it; read with ``weights_only=True``): a file from a one-process run, a
      directory of shards (torch.distributed.checkpoint) from a multi-process one.

    Args:
        checkpoint: any of the above.
        dtype: parameter dtype (default float32; a Lightning checkpoint only in float32).
        device: where the parameters are allocated (default cpu).
        kernel_backend: the kernel backend the model runs (``genolong.kernels.backends``); default
            None: :func:`scoring_kernel_backend` (the run's recipe's ``model.overrides.kernel_backend``,
            else ``auto``: the GPU kernels on a GPU, torch on a CPU), as ``genolong finetune`` runs it.

    Returns:
        (model in eval mode, VocabMap or None for the nucleotide vocabulary).

    Raises:
        InputError: none of the above, or a checkpoint that does not fit its recipe;
            :class:`~genolong.integrity.DamagedFileError` (an InputError): a damaged file, named
            with its problem (:func:`genolong.integrity.check_weights`).
    """
    from ..config import parse_recipe

    kernel_backend = scoring_kernel_backend(checkpoint, kernel_backend)
    path = Path(checkpoint)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "export" / "config.json").is_file():
        path = path / "export"
    if path.is_dir() and (path / "config.json").is_file():
        model = GenoLM.from_pretrained(path, dtype=dtype, device=device, kernel_backend=kernel_backend)
        vocab = None
        if model.config.vocab_size != VOCAB_SIZE:  # a text LLM checkpoint: bases through its tokenizer
            vocab = VocabMap.from_tokenizer(path, pad=model.config.pad_token_id, bos=model.config.bos_token_id)
        return model.eval(), vocab
    sharded = path.is_dir() and path.suffix == ".ckpt" and (path / _DCP_META).is_file()
    if (path.is_file() and path.suffix == ".ckpt") or sharded:
        check_weights(path)  # a damaged file in one line, before torch reads it
        state = torch.load(path / _DCP_META if sharded else path, map_location="cpu", weights_only=True)
        recipe_data = state.get("genolong", {}).get("recipe")
        if recipe_data is None or (not sharded and "state_dict" not in state):
            raise InputError(f"{path} is not a genolong finetune checkpoint (no recipe or state_dict inside); "
                             "give a run's export/ directory or a step*.ckpt written by genolong finetune")
        recipe = parse_recipe(recipe_data, source=str(path))
        config = recipe.model_config().replace(kernel_backend=kernel_backend)
        if dtype != torch.float32:
            raise InputError(f"{path}: a Lightning checkpoint is evaluated in float32; for --dtype {dtype} evaluate "
                             "the run's export/ directory (genolong finetune writes it at the end)")
        model = GenoLM(config)  # the whole model in this process: evaluation runs it unsharded
        if sharded:
            _load_sharded_weights(model, path)
        else:
            weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
            missing, unexpected = model.load_state_dict(weights, strict=False)
            if missing or unexpected:
                raise InputError(f"{path} does not fit its recipe's model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model = model.to(device=device)
        vocab = recipe.vocab_map(config)
        return model.eval(), None if vocab == VocabMap.identity() else vocab
    raise InputError(
        f"{path} is not a checkpoint: give a directory with config.json + safetensors (a run's export/), "
        "a run directory (runs/NAME) or a runs/NAME/checkpoints/step*.ckpt file"
    )


# Lightning's file of everything but the model and optimiser in a sharded (DCP) checkpoint directory
_DCP_META = "meta.pt"


def _load_sharded_weights(model: GenoLM, path: Path) -> None:
    """Fill ``model`` in place from a multi-process run's sharded checkpoint directory
    (torch.distributed.checkpoint, written by Lightning's ``ModelParallelStrategy``: the model
    under ``state_dict.model.*``), resharded to whole tensors in this one process; the optimiser
    states in it are not read."""
    import torch.distributed.checkpoint as dcp

    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({"state_dict": weights}, checkpoint_id=path, no_dist=True)
    except Exception as error:  # DCP reports a missing key or another shape as a CheckpointException
        raise InputError(f"{path} does not fit its recipe's model ({str(error).splitlines()[-1][:200]})") from error


def run_recipe(checkpoint: str | os.PathLike[str]) -> Mapping[str, Any] | None:
    """The resolved recipe (plain data) of the finetune run ``checkpoint`` belongs to: inside a
    ``step*.ckpt`` (file or sharded directory), or the ``recipe.yaml`` of a run directory or beside
    its ``export/``; None when it is not part of a genolong finetune run.

    Raises:
        DamagedFileError: a damaged ``step*.ckpt`` (:func:`genolong.integrity.check_weights`).
    """
    import yaml

    path = Path(checkpoint)
    if path.suffix == ".ckpt" and (path.is_file() or (path / _DCP_META).is_file()):
        # mmap: only the recipe is read, not the weights and optimiser states (but first the whole
        # checkpoint is checked: the loader reads it next, and a damaged one is named in one line)
        check_weights(path)
        meta = path / _DCP_META if path.is_dir() else path
        data = torch.load(meta, map_location="cpu", weights_only=True, mmap=True).get("genolong", {}).get("recipe")
    else:
        found = [p / "recipe.yaml" for p in (path, path.parent) if (p / "recipe.yaml").is_file()]
        data = yaml.safe_load(found[0].read_text()) if found else None
    return data if isinstance(data, Mapping) else None


def recipe_context(checkpoint: str | os.PathLike[str]) -> int | None:
    """The eval context of the run ``checkpoint`` belongs to (its recipe's ``eval.context`` or
    ``data.context``), or None when it is not part of a genolong finetune run."""
    data = run_recipe(checkpoint)
    if data is None:
        return None
    evaluation = data.get("eval") or {}
    context = evaluation.get("context") or (data.get("data") or {}).get("context")
    return int(context) if context else None


def scoring_kernel_backend(checkpoint: str | os.PathLike[str], requested: str | None = None) -> str:
    """The kernel backend a scoring command runs ``checkpoint`` with, as ``genolong finetune``
    chooses it: ``requested`` (a flag) when given, else the run's recipe's
    ``model.overrides.kernel_backend`` (:func:`run_recipe`), else ``"auto"`` (``triton`` / ``fla``
    on a CUDA machine, ``torch`` elsewhere; :func:`genolong.kernels.backends.resolve_auto`)."""
    if requested is not None:
        return requested
    overrides = ((run_recipe(checkpoint) or {}).get("model") or {}).get("overrides") or {}
    backend = overrides.get("kernel_backend") if isinstance(overrides, Mapping) else None
    return str(backend) if backend else "auto"

"""The checkpoint a scoring command runs: find it, read its run's recipe, load the whole model.

``genolong evaluate``, ``check-logprobs`` and ``probe`` accept the same checkpoints: a
GLM-5.3-Flash-format directory (a run's ``export/``), a fine-tune run directory, or a Lightning
``step*.ckpt`` (a file from a one-process run, a sharded directory from a multi-process one),
plus optionally a LoRA adapter directory in the PEFT format (``--adapter``: :func:`check_adapter`,
:func:`merge_adapter`), merged into the loaded weights in memory.
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
from ..model.config import ModelConfig
from ..model.lm import GenoLM
from ..model.lora import LoraSettings, apply_lora, merge_lora
from ..model.vocab import VocabMap

__all__ = [
    "check_adapter",
    "load_eval_model",
    "merge_adapter",
    "recipe_context",
    "run_recipe",
    "scoring_kernel_backend",
]


def load_eval_model(
    checkpoint: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    kernel_backend: str | None = None,
    adapter: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[GenoLM, VocabMap | None]:
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
        adapter: a PEFT LoRA adapter directory (``runs/NAME/adapter``) for the base ``checkpoint``,
            merged into the loaded weights in memory (:func:`merge_adapter`); default None.
        overrides: ModelConfig fields to read the weights with instead of the checkpoint's own
            (no parameter shape may change), e.g. ``{"index_topk": 2048}``: the base read as a
            fine-tune that widened its key budget reads (:func:`genolong.config.reading_changes`);
            default None.

    Returns:
        (model in eval mode, VocabMap or None for the nucleotide vocabulary).

    Raises:
        InputError: none of the above, or a checkpoint that does not fit its recipe; an adapter
            :func:`check_adapter` or :func:`merge_adapter` refuses;
            :class:`~genolong.integrity.DamagedFileError` (an InputError): a damaged file, named
            with its problem (:func:`genolong.integrity.check_weights`).
    """
    if adapter is not None:
        check_adapter(checkpoint, adapter)  # before the base loads
        model, vocab = load_eval_model(
            checkpoint, dtype=dtype, device=device, kernel_backend=kernel_backend, overrides=overrides
        )
        merge_adapter(model, adapter)
        return model, vocab
    from ..config import parse_recipe

    kernel_backend = scoring_kernel_backend(checkpoint, kernel_backend)
    path = Path(checkpoint)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "export" / "config.json").is_file():
        path = path / "export"
    if path.is_dir() and (path / "config.json").is_file():
        config = _with_overrides(ModelConfig.from_pretrained(path), overrides, path)
        model = GenoLM.from_pretrained(path, dtype=dtype, device=device, kernel_backend=kernel_backend, config=config)
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
            raise InputError(
                f"{path} is not a genolong finetune checkpoint (no recipe or state_dict inside); "
                "give a run's export/ directory or a step*.ckpt written by genolong finetune"
            )
        recipe = parse_recipe(recipe_data, source=str(path))
        config = _with_overrides(recipe.model_config(), overrides, path).replace(kernel_backend=kernel_backend)
        if dtype != torch.float32:
            raise InputError(
                f"{path}: a Lightning checkpoint is evaluated in float32; for --dtype {dtype} evaluate "
                "the run's export/ directory (genolong finetune writes it at the end)"
            )
        base = state.get("genolong", {}).get("base")
        lora = recipe.model.lora
        if base is not None:
            # the checkpoint holds what training changed; the frozen weights are the base's
            model = base_of_checkpoint(recipe, config, base, path)
        else:
            model = GenoLM(config)  # the whole model in this process: evaluation runs it unsharded
            if lora is not None:  # a LoRA run's checkpoint holds the adapted model's names (base + adapters)
                apply_lora(model, lora)
        from_base = _base_names(model) if base is not None else set()
        if sharded:
            _load_sharded_weights(model, path, from_base)
        else:
            weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
            missing, unexpected = model.load_state_dict(weights, strict=False)
            missing = [m for m in missing if m not in from_base]
            if missing or unexpected:
                raise InputError(
                    f"{path} does not fit its recipe's model: missing {missing[:3]}, unexpected {unexpected[:3]}"
                )
        if lora is not None:  # scored as the run's export/ is written: the adapters merged in fp32
            _to_float32(model)
            merge_lora(model)
        _to_float32(model)
        model = model.to(device=device)
        vocab = recipe.vocab_map(config)
        return model.eval(), None if vocab == VocabMap.identity() else vocab
    raise InputError(
        f"{path} is not a checkpoint: give a directory with config.json + safetensors (a run's export/), "
        "a run directory (runs/NAME) or a runs/NAME/checkpoints/step*.ckpt file"
    )


# Lightning's file of everything but the model and optimiser in a sharded (DCP) checkpoint directory
_DCP_META = "meta.pt"


def _with_overrides(config: ModelConfig, overrides: Mapping[str, Any] | None, checkpoint: Path) -> ModelConfig:
    """``config`` with ``overrides`` applied; an override that would change a parameter shape (or
    is no ModelConfig field) is refused, naming the checkpoint."""
    if not overrides:
        return config
    from ..config import SHAPE_FIELDS

    if shaped := sorted(set(overrides) & set(SHAPE_FIELDS)):
        raise InputError(
            f"{checkpoint}: cannot read its weights with another {', '.join(shaped)} (a parameter shape); "
            "override only fields such as index_topk"
        )
    try:
        return config.replace(**overrides)
    except TypeError as exc:
        raise InputError(f"{checkpoint}: overrides {dict(overrides)} are not ModelConfig fields ({exc})") from None


def _to_float32(model: torch.nn.Module) -> None:
    """Every floating parameter of ``model`` in float32 (a run's bf16 frozen weights), in place."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def _base_names(model: torch.nn.Module) -> set[str]:
    """``model``'s state names that a run's frozen parameters may be missing from its checkpoint
    for (they were read from the base): its frozen parameters."""
    return {name for name, param in model.named_parameters() if not param.requires_grad}


def base_of_checkpoint(
    recipe: Any,
    config: ModelConfig,
    base: Mapping[str, Any],
    checkpoint: Path,
    mesh_fn: Any = None,
    device: torch.device | str = "cpu",
) -> GenoLM:
    """The model a run's checkpoint that omits the frozen weights (``genolong`` ``base`` entry:
    path and digest of ``model.checkpoint``) is read into: built from ``config`` (the run's, with
    the scorer's kernel backend) as the run built it (meta device,
    LoRA, ``model.freeze``, the frozen weights in bf16 under ``bf16-mixed``), sharded by
    ``mesh_fn(model)`` when given (several processes), allocated and filled from the base by the
    sharded loader (:mod:`genolong.parallel.load`); the checkpoint's own tensors are read next by
    the caller.

    Raises:
        InputError: the base is gone or is another one than the run's (its digest).
    """
    from ..parallel.load import base_digest, check_base, fill_from_safetensors, materialize, to_meta
    from ..train.module import cast_frozen_parameters, freeze_parameters

    directory = Path(base["path"])
    if not (directory / "config.json").is_file() or base_digest(directory) != base.get("digest"):
        raise InputError(
            f"{checkpoint} holds only what its run trained on the base {directory}, which is "
            f"{'gone' if not (directory / 'config.json').is_file() else 'another model now (its digest differs)'}; "
            "score the run's export/ instead, or put that base back"
        )
    torch.manual_seed(recipe.seed)
    with torch.device("meta"):
        model = GenoLM(config)
    if recipe.model.lora is not None:
        apply_lora(model, recipe.model.lora)  # adapters drawn on the CPU; the checkpoint overwrites them
    if recipe.model.freeze:
        freeze_parameters(model, recipe.model.freeze)
    if recipe.train.precision == "bf16-mixed":  # the frozen weights as the run held them
        cast_frozen_parameters(model, torch.bfloat16)
    kept = to_meta(model)
    if mesh_fn is not None:
        mesh_fn(model)
    check_base(directory)
    materialize(model, device, kept)
    fill_from_safetensors(model, directory)
    return model


def _load_sharded_weights(model: GenoLM, path: Path, from_base: set[str] | None = None) -> None:
    """Fill ``model`` in place from a multi-process run's sharded checkpoint directory
    (torch.distributed.checkpoint, written by Lightning's ``ModelParallelStrategy``: the model
    under ``state_dict.model.*``), resharded to whole tensors in this one process; the optimiser
    states in it are not read. ``from_base``: names already read from the run's base that the
    checkpoint may lack (its frozen weights)."""
    import torch.distributed.checkpoint as dcp

    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    if from_base:
        stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        weights = {
            k: v for k, v in weights.items() if f"state_dict.{k}" in stored or k.removeprefix("model.") not in from_base
        }
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({"state_dict": weights}, checkpoint_id=path, no_dist=True)
    except Exception as error:  # DCP reports a missing key or another shape as a CheckpointException
        raise InputError(f"{path} does not fit its recipe's model ({str(error).splitlines()[-1][:200]})") from error


def check_adapter(checkpoint: str | os.PathLike[str], adapter: str | os.PathLike[str]) -> None:
    """Refuse, before any weight is read, an ``--adapter`` that cannot apply to ``checkpoint``: no
    such directory, no ``adapter_config.json``, not a LoRA adapter genolong computes
    (:func:`genolong.model.lora.read_adapter_config`), or a ``checkpoint`` of a LoRA fine-tune
    run (its recipe sets ``model.lora``: its ``export/`` already holds that run's adapters merged,
    its ``step*.ckpt`` its adapters), which would apply an adapter on top of an adapter.

    Raises:
        InputError: one of the above, naming the input and the fix.
    """
    from ..model.lora import read_adapter_config

    read_adapter_config(adapter)
    lora = ((run_recipe(checkpoint) or {}).get("model") or {}).get("lora")
    if lora:
        raise InputError(
            f"--adapter {adapter}: {checkpoint} belongs to a LoRA fine-tune run (its recipe sets model.lora), "
            "whose weights already hold its adapters; give the base model the adapter was trained on "
            "(the run's model.checkpoint) with --adapter, or this checkpoint without --adapter"
        )


def merge_adapter(model: GenoLM, adapter: str | os.PathLike[str]) -> LoraSettings:
    """Merge a PEFT LoRA adapter directory into ``model``'s weights, in place: every adapted
    weight ``W [out, in]`` (and each routed expert's ``[out, in]`` slice) becomes ``W + (alpha / r)
    B A``, computed in float32 and stored in ``W``'s dtype, as :func:`genolong.model.lora.merge_lora`
    and ``genolong finetune``'s merged ``export/`` compute it; ``modules_to_save`` replace their
    modules' weights. In float32 the result equals the adapter model (base plus separate adapters)
    to float32 rounding; in bfloat16 the merged weight is rounded once to bfloat16.

    ``model`` may be sharded (FSDP2 / expert-parallel DTensor parameters): each rank merges its
    own part (no collective). The adapter is checked and read first on a meta-device copy of
    ``model``'s architecture (:func:`genolong.model.lora.load_adapter`), so a refused adapter
    leaves ``model`` unchanged.

    Args:
        model: a plain GenoLM (any dtype, any device but meta), or one sharded for scoring.
        adapter: the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, as
            genolong's ``runs/NAME/adapter/`` or peft's ``save_pretrained`` writes it).

    Returns:
        The adapter's settings, with GenoLM module names as ``targets``.

    Raises:
        InputError: as :func:`genolong.model.lora.load_adapter` (a module or shape this base does
            not have, missing tensors, a damaged file, ...).
    """
    from ..model.lora import ExpertAdapters, load_adapter, lora_modules, saved_module_tensors

    with torch.device("meta"):
        skeleton = GenoLM(model.config)
    settings = load_adapter(skeleton, adapter)  # the adapters real (on the CPU), the base weights meta
    saved = saved_module_tensors(skeleton, adapter)
    with torch.no_grad():
        for name, module in lora_modules(skeleton).items():
            _merge_part(model.get_parameter(f"{name}.weight"), (), module.delta_weight())
        for name, module in skeleton.named_modules():
            if isinstance(module, ExpertAdapters):
                experts = name.removesuffix(".lora")
                for param_name in module.lora_A.keys():
                    param = model.get_parameter(f"{experts}.{param_name}")
                    for e in range(module.num_experts):
                        _merge_part(param, (e,), module.delta(param_name, e).float())
        for name, value in saved.items():
            _merge_part(model.get_parameter(name), (), value, add=False)
    return settings


def _merge_part(param: torch.Tensor, index: tuple[int, ...], value: torch.Tensor, add: bool = True) -> None:
    """``param[index] += value`` (float32 sum, stored in ``param``'s dtype; ``add=False``:
    ``param[index] = value``) on this rank's part of ``param`` (a DTensor: its local shard; a
    plain tensor: all of it). ``value``: the whole ``param[index]`` region, on any device."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    offset, shape = _local_box(param)
    lead = len(index)
    if any(not o <= i < o + s for i, o, s in zip(index, offset, shape)):
        return  # this rank holds none of param[index]
    dest = local[tuple(i - o for i, o in zip(index, offset))] if lead else local
    source = value[tuple(slice(o, o + s) for o, s in zip(offset[lead:], shape[lead:]))].to(dest.device)
    dest.copy_((dest.float() + source.float() if add else source).to(dest.dtype))


def _local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's part of ``tensor`` (a DTensor, or a whole tensor:
    zeros and its shape)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


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

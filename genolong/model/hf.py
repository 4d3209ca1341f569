"""The GLM-5.3-Flash checkpoint format: safetensors shards read onto a meta model, and written back.

A released GLM-5.3-Flash directory holds ``config.json`` (``model_type: glm5_next`` with a
``text_config``), ``model.safetensors.index.json`` and its shards, in the *original* tensor layout
that transformers 5.24 reads through its ``glm5_next`` conversion mapping and writes back by default
(``save_original_format=True``), and that vLLM, SGLang and llama.cpp read:

- text tower under ``model.language_model.``, the LM head as ``lm_head.weight``; the vision tower
  (``model.visual.``) and the MTP block (``layers.{num_hidden_layers}.``, ``shared_head``) are not
  part of GenoLM and are skipped;
- routed experts one by one: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (GenoLM, like
  transformers in memory, fuses them into ``experts.gate_up_proj [E, 2I, H]`` and
  ``experts.down_proj [E, H, I]``);
- the KDA short convolutions as ``self_attn.{q,k,v}_conv1d.weight`` (fused: ``conv1d.weight``),
  the forget gate as ``self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}`` (GenoLM:
  ``self_attn.forget_gate.*``), the hyper-connections as ``hc_{attn,ffn}_{fn,base,scale}``
  (GenoLM: ``{attn,ffn}_hc.{fn,base,scale}``).

One table (:func:`checkpoint_layout`) lists, for a model, every checkpoint tensor with the GenoLM
tensor and the slice of it that it fills; loading and saving both walk it. Checkpoints saved by
transformers with ``save_original_format=False`` (fused names) load too.

Loading streams shard by shard, tensor by tensor, into parameters allocated on first touch, so a
313B checkpoint never needs two copies in memory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import InputError
from ..files import unique_sibling, writing
from ..integrity import DamagedFileError, check_weights, write_manifest
from ..units import format_bytes
from .config import ModelConfig

__all__ = [
    "CheckpointTensor",
    "checkpoint_layout",
    "config_text",
    "export_config",
    "export_entries",
    "layout_of",
    "load_checkpoint",
    "save_checkpoint",
    "shard_file",
]

log = logging.getLogger("genolong")

#: where the text tower sits in a GLM-5.3-Flash (``Glm5NextForConditionalGeneration``) checkpoint
TEXT_PREFIX = "model.language_model."
#: prefixes tried, in order, when reading (a bare text model is saved without the wrapper prefix)
_READ_PREFIXES = (TEXT_PREFIX, "model.", "language_model.", "")
HEAD = "lm_head.weight"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: tensors transformers keeps in fp32 whatever the checkpoint dtype (``_keep_in_fp32_modules_strict``)
FP32_TENSORS = re.compile(r"e_score_correction_bias|mlp\.gate\.weight|conv1d|dt_bias|A_log|hc_(attn|ffn)_(base|scale)")
#: the smallest vision tower transformers accepts: written into config.json for genolong's DNA
#: models (which have none) so that ``Glm5NextForConditionalGeneration`` loads the text tower
_MINIMAL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
_SLICE = tuple[slice | int, ...]


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the checkpoint format and where it lives in GenoLM.

    Attributes:
        name: checkpoint name relative to the text tower (``layers.0.self_attn.q_conv1d.weight``;
            the head is ``lm_head.weight``).
        target: GenoLM ``state_dict`` name (``layers.0.self_attn.conv1d.weight``).
        index: the part of ``target`` this tensor fills (``()`` = all of it).
        shape: the checkpoint tensor's shape.
    """

    name: str
    target: str
    index: _SLICE
    shape: tuple[int, ...]


def _renamed(name: str) -> str:
    """GenoLM name -> checkpoint name for tensors that are renamed, not split."""
    name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
    return name.replace(".self_attn.forget_gate.", ".self_attn.")


def checkpoint_layout(model: nn.Module) -> list[CheckpointTensor]:
    """Every tensor of ``model``'s checkpoint, in GenoLM ``state_dict`` order.

    Args:
        model: a GenoLM (any device, meta included).
    """
    return layout_of((name, tuple(tensor.shape)) for name, tensor in model.state_dict(keep_vars=True).items())


def layout_of(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[CheckpointTensor]:
    """:func:`checkpoint_layout` from ``(GenoLM state_dict name, global shape)`` pairs, in their
    order: for a model whose names differ from a plain GenoLM's (LoRA's wrapped layers), mapped
    back to them by the caller (:func:`genolong.parallel.load.base_targets`)."""
    layout: list[CheckpointTensor] = []
    for target, shape in shapes:
        if target.endswith(".mlp.experts.gate_up_proj"):
            base, half = target[: -len("gate_up_proj")], shape[1] // 2
            for e in range(shape[0]):
                layout.append(
                    CheckpointTensor(f"{base}{e}.gate_proj.weight", target, (e, slice(0, half)), (half, shape[2]))
                )
                layout.append(
                    CheckpointTensor(f"{base}{e}.up_proj.weight", target, (e, slice(half, None)), (half, shape[2]))
                )
        elif target.endswith(".mlp.experts.down_proj"):
            base = target[: -len("down_proj")]
            layout.extend(
                CheckpointTensor(f"{base}{e}.down_proj.weight", target, (e,), shape[1:]) for e in range(shape[0])
            )
        elif target.endswith(".self_attn.conv1d.weight"):
            # q, k and v convolutions have the same width (heads x linear_head_dim)
            base, width = target[: -len("conv1d.weight")], shape[0] // 3
            for i, part in enumerate("qkv"):
                rows = slice(i * width, (i + 1) * width)
                layout.append(CheckpointTensor(f"{base}{part}_conv1d.weight", target, (rows,), (width, *shape[1:])))
        else:
            layout.append(CheckpointTensor(_renamed(target), target, (), shape))
    return layout


# -- reading ---------------------------------------------------------------------------------------
def _weight_map(directory: Path) -> dict[str, str]:
    """Checkpoint tensor name -> shard file name, from the index or the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(f"{index} is not a safetensors index ({exc!r}); re-download it") from None
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise InputError(
                f"checkpoint {directory}: shard {missing[0]} listed in {INDEX_FILE} is missing"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; download the missing shards"
            )
        return dict(weight_map)
    single = directory / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(single, framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except Exception as exc:  # SafetensorError: a damage check_weights's structural check missed
            raise DamagedFileError(single, f"safetensors cannot read it: {exc}") from None
    raise InputError(
        f"checkpoint {directory} has neither {INDEX_FILE} nor {SINGLE_FILE}; point to a GLM-5.3-Flash-format directory"
    )


def _text_prefix(names: Iterable[str], directory: Path) -> str:
    names = set(names)
    for prefix in _READ_PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise InputError(
        f"checkpoint {directory} has no embed_tokens.weight under any of {_READ_PREFIXES}; it is not a GLM-5.3-Flash text model"
    )


def _skip_reason(name: str, prefix: str, num_layers: int) -> str | None:
    """Why a checkpoint tensor is not loaded (vision tower, MTP block), or None."""
    if name == HEAD:
        return None
    if not name.startswith(prefix):
        return "vision tower"
    layer = re.match(r"layers\.(\d+)\.", name[len(prefix) :])
    if (layer and int(layer.group(1)) >= num_layers) or ".shared_head." in name:
        return "MTP block"
    return None


def _materialise(model: nn.Module, target: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Replace the meta parameter/buffer ``target`` by an uninitialised real one; return it."""
    module_name, _, leaf = target.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        assert old is not None
        new = nn.Parameter(
            torch.empty(old.shape, dtype=dtype if old.is_floating_point() else old.dtype, device=device),
            requires_grad=old.requires_grad,
        )
        module._parameters[leaf] = new
        return new.data
    old_buffer = module._buffers[leaf]
    assert old_buffer is not None
    # buffers keep their own dtype (the router bias stays fp32, as in transformers)
    module._buffers[leaf] = torch.empty(old_buffer.shape, dtype=old_buffer.dtype, device=device)
    return module._buffers[leaf]


def load_checkpoint(
    model: nn.Module,
    directory: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> None:
    """Fill ``model`` (built on the meta device) from a GLM-5.3-Flash-format checkpoint, streaming.

    Each checkpoint tensor is read, cast to ``dtype`` and copied into its slice of a parameter that
    is allocated on ``device`` when first touched; at most one checkpoint tensor is held besides
    the model. Buffers keep their dtype.

    Raises:
        InputError: missing shard or index, a tensor of the wrong shape or kind of dtype (named), a
            tensor GenoLM has no place for, a parameter the checkpoint lacks, the same tensor in
            two shards; :class:`~genolong.integrity.DamagedFileError`: a damaged file (truncated,
            not safetensors, changed since written: :func:`genolong.integrity.check_weights`).
    """
    directory = Path(directory)
    device = torch.device(device)
    check_weights(directory)
    layout = {entry.name: entry for entry in checkpoint_layout(model)}
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    shapes_float = {name: t.is_floating_point() for name, t in model.state_dict(keep_vars=True).items()}
    weight_map = _weight_map(directory)
    prefix = _text_prefix(weight_map, directory)
    num_layers = model.config.num_hidden_layers
    skipped: dict[str, int] = {}
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        reason = _skip_reason(name, prefix, num_layers)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            by_shard.setdefault(shard, []).append(name)

    filled: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    tensors: dict[str, torch.Tensor] = {}
    loaded_bytes = 0
    for shard, names in by_shard.items():
        with safe_open(directory / shard, framework="pt", device="cpu") as f:
            for name in names:
                relative = name if name == HEAD else name[len(prefix) :]
                # a fused tensor (transformers' in-memory names, save_original_format=False) fills its target
                entry = layout.get(relative) or (
                    CheckpointTensor(relative, relative, (), shapes[relative]) if relative in shapes else None
                )
                if entry is None:
                    raise InputError(
                        f"checkpoint {directory}: tensor {name} in {shard} has no place in GenoLM built from its "
                        "config.json; the checkpoint and config.json disagree (or it is not GLM-5.3-Flash)"
                    )
                key = (entry.target, repr(entry.index))
                if key in seen:
                    raise InputError(f"checkpoint {directory}: tensor {name} is stored twice; repair {INDEX_FILE}")
                seen.add(key)
                source = f.get_slice(name)
                shape = tuple(source.get_shape())
                if shape != entry.shape:
                    raise InputError(
                        f"checkpoint {directory}: tensor {name} in {shard} has shape {list(shape)} but the model "
                        f"built from config.json expects {list(entry.shape)}; config.json does not match the weights"
                    )
                stored = source.get_dtype()
                floating = stored.startswith(("F", "BF"))
                if floating != shapes_float[entry.target]:
                    raise InputError(
                        f"checkpoint {directory}: tensor {name} in {shard} is stored as {stored} but the model expects "
                        f"{'a floating' if shapes_float[entry.target] else 'an integer'} tensor; the checkpoint is damaged "
                        "or not GLM-5.3-Flash"
                    )
                if entry.target not in tensors:
                    tensors[entry.target] = _materialise(model, entry.target, dtype, device)
                value = f.get_tensor(name)
                tensors[entry.target][entry.index].copy_(value)
                filled[entry.target] = filled.get(entry.target, 0) + value.numel()
                loaded_bytes += value.numel() * value.element_size()
                del value

    missing = [
        name for name, tensor in model.state_dict(keep_vars=True).items() if filled.get(name, 0) != tensor.numel()
    ]
    if missing:
        raise InputError(
            f"checkpoint {directory} lacks {len(missing)} tensor(s) the model needs, first {missing[0]}; "
            "the checkpoint is incomplete or config.json describes another model"
        )
    skip_text = ", ".join(f"{reason} ({n} tensors)" for reason, n in sorted(skipped.items()))
    log.info(
        "genolong: loaded %d tensors (%s) from %s%s",
        sum(len(v) for v in by_shard.values()),
        format_bytes(loaded_bytes),
        directory,
        f"; skipped {skip_text}" if skipped else "",
    )


# -- writing ---------------------------------------------------------------------------------------
def export_config(config: ModelConfig) -> ModelConfig:
    """``config`` as the export writes it: a model without a vision tower (genolong's DNA presets)
    gets transformers' wrapper with a minimal ``vision_config`` (see :func:`save_checkpoint`)."""
    if config.wrapper is not None:
        return config
    wrapper = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "tie_word_embeddings": False,
        "vision_config": {**_MINIMAL_VISION, "out_hidden_size": config.hidden_size},
    }
    return replace(config, wrapper=wrapper)


def export_entries(model: nn.Module) -> dict[str, CheckpointTensor]:
    """Every tensor of ``model``'s export by its checkpoint name (text tower under
    ``model.language_model.``, the head as ``lm_head.weight``), in the order the shards hold them."""
    return {(e.name if e.name == HEAD else TEXT_PREFIX + e.name): e for e in checkpoint_layout(model)}


def shard_file(index: int, count: int) -> str:
    """The file name of shard ``index`` (from 0) of ``count``: transformers' names."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def config_text(config: ModelConfig, head_dtype: torch.dtype) -> str:
    """``config.json`` of an export whose LM head is written in ``head_dtype``."""
    hf = config.to_hf_dict()
    hf["dtype"] = str(head_dtype).removeprefix("torch.")
    return json.dumps(hf, indent=2) + "\n"


def _out_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in (``dtype`` for floating tensors but the fp32-kept ones)."""
    if dtype is not None and tensor.is_floating_point() and not FP32_TENSORS.search(name):
        return dtype
    return tensor.dtype


def _shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save_checkpoint(
    model: nn.Module,
    directory: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 10**9,
    copy_files: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """Write ``model`` as a GLM-5.3-Flash-format checkpoint directory (config.json + safetensors).

    The layout is transformers' original format (per-expert, split convolutions; see the module
    docstring), readable by transformers' ``Glm5NextForConditionalGeneration.from_pretrained``,
    by :func:`load_checkpoint` and by the serving engines. A model without a vision tower (genolong's
    DNA presets) gets a minimal ``vision_config`` so that transformers can build the class; its
    vision weights are absent (transformers initialises them and says so). Shards are written one
    at a time: besides the model, memory holds at most one shard.

    The directory is built beside ``directory``, its checksum manifest ``checksums.json`` written
    (:mod:`genolong.integrity`) and renamed into place when complete; an existing checkpoint
    directory there is replaced.

    Args:
        model: the GenoLM to save.
        directory: output directory.
        dtype: cast floating tensors to this dtype (e.g. ``torch.bfloat16`` for serving); the
            tensors transformers keeps in fp32 stay fp32. Default None: as in the model.
        max_shard_bytes: shard size limit (default 5 GB, as transformers).
        copy_files: files to copy into the directory (tokenizer files, generation_config.json).

    Returns:
        The directory.

    Raises:
        InputError: ``directory`` exists, is not empty and holds no config.json (not a checkpoint).
    """
    out = Path(directory)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        raise InputError(f"refusing to replace {out}: it exists and is not a checkpoint directory; choose another path")
    config = export_config(model.config)
    state = model.state_dict()
    entries = export_entries(model)
    out_dtypes = {name: _out_dtype(name, state[e.target], dtype) for name, e in entries.items()}
    sizes = [(name, math.prod(e.shape) * out_dtypes[name].itemsize) for name, e in entries.items()]
    groups = _shards(sizes, max_shard_bytes)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_sibling(out, "tmp")
    tmp.mkdir()
    try:
        with writing(out, needed=sum(size for _, size in sizes), work=tmp):
            weight_map: dict[str, str] = {}
            for i, group in enumerate(groups):
                file = shard_file(i, len(groups))
                shard = {
                    name: state[entries[name].target][entries[name].index]
                    .detach()
                    .to("cpu", out_dtypes[name])
                    .contiguous()
                    for name in group
                }
                save_file(shard, tmp / file, metadata={"format": "pt"})
                del shard
                weight_map.update(dict.fromkeys(group, file))
            if len(groups) > 1:
                index = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            (tmp / "config.json").write_text(config_text(config, out_dtypes[HEAD]))
            for extra in copy_files:
                shutil.copy2(extra, tmp / Path(extra).name)
            write_manifest(tmp)
            if out.exists():
                old = unique_sibling(out, "old")
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old)
            else:
                tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

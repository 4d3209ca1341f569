"""The export of a trained model without a gather: every rank writes its own share of the shards.

Today's reference path (:func:`genolong.train.finetune._full_model`, kept for the tests) gathers
the whole state dict to rank 0, which then writes every shard alone: a 313B model is ~640 GB in
rank 0's host memory while the other ranks wait. Here, instead:

- the output layout is planned exactly as :func:`genolong.model.hf.save_checkpoint` plans it (the
  same tensor names, order, dtypes, shard grouping by ``max_shard_bytes`` and file names), so the
  files are bitwise those of the gathered export;
- output shard ``i`` is written by rank ``i % world`` (its *owner*);
- the model's tensors are visited one at a time, in the layout's order: a sharded one (a DTensor,
  FSDP2 / expert parallelism) is assembled with an all-gather of *that tensor only*
  (``DTensor.full_tensor``), the ranks owning one of the shards it feeds slice their entries out
  of it, the others drop it at once. A shard is written as soon as its last tensor is in, and
  freed. Peak host memory on every rank: one output shard plus the largest tensor (plus, under
  ``merged``, that tensor's float32 merge);
- each rank hashes the files it wrote; rank 0 gathers the digests and writes the index, the
  ``config.json``, the copied files and the checksum manifest last, then renames the directory
  (built as ``.NAME.tmp-*`` beside it, as the project's other writers do, :mod:`genolong.files`)
  into place: the export appears whole or not at all.

With LoRA adapters the merged export (``merged=True``) computes ``W + s B A`` per adapted tensor
from the gathered base weight and factors, with the same functions as :func:`merge_lora`
(:func:`genolong.model.lora.merged_linear_weight`, :func:`~genolong.model.lora.merged_expert_weight`),
in float32 like the reference. The PEFT adapter (:func:`export_adapter`) gathers the adapters
only (a few MB to GB), one tensor at a time, onto a meta copy of the model on rank 0 and writes
them with :func:`genolong.model.lora.save_adapter`.

Every rank of a sharded model must call these functions (they are collectives); an unsharded model
(one process) is exported by the calling process alone through the same code.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import InputError
from ..files import fsync_tree, replace_dir, unique_sibling, writing
from ..integrity import ALGORITHM, file_checksum, write_manifest
from ..model.hf import HEAD, INDEX_FILE, _out_dtype, _shards, config_text, export_config, export_entries, shard_file
from ..model.lm import GenoLM

if TYPE_CHECKING:
    from ..config import Recipe

__all__ = ["ExportStats", "export_adapter", "export_model", "is_sharded", "release_offload_pool", "write_exports"]

log = logging.getLogger("genolong")


@dataclass
class ExportStats:
    """What one rank did in :func:`export_model`.

    Attributes:
        files: the shard files this rank wrote.
        bytes_written: their bytes.
        gathered_bytes: bytes of the full tensors this rank assembled (those of the shards it owns).
        seconds: the rank's wall time in the export.
    """

    files: list[str]
    bytes_written: int = 0
    gathered_bytes: int = 0
    seconds: float = 0.0


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2, expert parallelism)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _ranks(model: nn.Module) -> tuple[int, int]:
    """(rank, world) of the export: the default group's for a sharded model, (0, 1) otherwise."""
    if is_sharded(model) and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _live_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state by the names of a plain GenoLM (wrappers' prefixes removed): references
    to this rank's shards, nothing copied."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)
    return model.state_dict()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: a DTensor all-gathered (a collective of its mesh; every rank
    of it must call), a plain tensor as it is (detached)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu")


def _pieces(tensor: DTensor) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]] | None:
    """(rank, local shape, global offset) of each distinct piece of ``tensor`` (one rank per piece:
    coordinate 0 on the replicated mesh dimensions), or None when a placement is not a plain
    ``Shard`` / ``Replicate`` (strided or partial: :func:`_gather_to` all-gathers those instead)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = tensor.placements
    if any(type(p) not in (Shard, Replicate) for p in placements):
        return None
    mesh = tensor.device_mesh
    ranks = mesh.mesh
    replicated = [d for d, p in enumerate(placements) if type(p) is Replicate]
    found = []
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        if any(coord[d] != 0 for d in replicated):
            continue
        shape, offset = _compute_local_shape_and_global_offset(
            tuple(tensor.shape), tuple(mesh.shape), list(coord), placements
        )
        found.append((int(ranks[coord]), tuple(shape), tuple(offset)))
    return found


def _gather_to(tensor: torch.Tensor, owner: int, rank: int) -> torch.Tensor | None:
    """The whole ``tensor`` on the CPU of rank ``owner`` (None on the others): each rank holding a
    distinct piece of a DTensor sends it to ``owner``, which receives it straight into its place in
    the one full tensor it allocates (so the owner's peak is the tensor, once); the others allocate
    nothing. Every rank of the tensor's mesh must call, in the same order. A plain (replicated)
    tensor is the owner's own."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().to("cpu") if rank == owner else None
    pieces = _pieces(tensor)
    if pieces is None or owner not in {int(r) for r in tensor.device_mesh.mesh.flatten()}:
        full = _full(tensor)  # strided / partial placements: torch's all-gather
        return full if rank == owner else None
    local = tensor.to_local().detach()
    if rank != owner:
        if any(src == rank for src, _, _ in pieces) and local.numel() > 0:
            dist.send(local.contiguous(), owner)
        return None
    full = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
    for src, shape, offset in pieces:
        if math.prod(shape) == 0:
            continue
        view = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if src == rank:
            view.copy_(local)
            continue
        direct = local.device.type == "cpu" and view.is_contiguous()
        buffer = view if direct else torch.empty(shape, dtype=tensor.dtype, device=local.device)
        dist.recv(buffer, src)
        if not direct:
            view.copy_(buffer)
    return full


@dataclass(frozen=True)
class _Source:
    """How one GenoLM tensor of the export comes from the live model's state: ``key`` (the
    tensor, or the adapted base weight), and under a merge the LoRA factors' keys and scaling."""

    key: str
    lora_a: str | None = None
    lora_b: str | None = None
    scaling: float = 1.0
    experts: bool = False  # routed experts [E, out, in]: merged expert by expert


def _plain_and_sources(model: GenoLM, lora: Any | None, merged: bool) -> tuple[GenoLM, dict[str, _Source]]:
    """A meta copy of the exported model (plain: adapters merged away) and, by its state-dict
    name, where each tensor comes from in ``model``'s state."""
    from ..model.lora import ExpertAdapters, apply_lora, lora_modules

    with torch.device("meta"):
        plain = GenoLM(model.config)
        adapted = GenoLM(model.config)
    if lora is None:
        return plain, {name: _Source(name) for name in plain.state_dict(keep_vars=True)}
    if not merged:
        raise InputError(
            "export_model of a model with LoRA adapters writes the merged model: pass merged=True "
            "(the adapters alone: export_adapter)"
        )
    apply_lora(adapted, lora)
    sources: dict[str, _Source] = {}
    for name, module in lora_modules(adapted).items():
        for leaf, _ in module.base.named_parameters():
            key = f"{name}.base.{leaf}"
            if leaf == "weight":
                sources[f"{name}.weight"] = _Source(
                    key, f"{name}.lora_A.weight", f"{name}.lora_B.weight", module.scaling
                )
            else:
                sources[f"{name}.{leaf}"] = _Source(key)
    for name, module in adapted.named_modules():
        adapters = getattr(module, "lora", None)
        if isinstance(adapters, ExpertAdapters):
            for param in ("gate_up_proj", "down_proj"):
                sources[f"{name}.{param}"] = _Source(
                    f"{name}.{param}",
                    f"{name}.lora.lora_A.{param}.weight",
                    f"{name}.lora.lora_B.{param}.weight",
                    adapters.scaling,
                    experts=True,
                )
    for name in plain.state_dict(keep_vars=True):
        sources.setdefault(name, _Source(name))
    return plain, sources


def _value(
    source: _Source, state: dict[str, torch.Tensor], stats: ExportStats, owners: set[int], rank: int
) -> torch.Tensor | None:
    """The exported value of one tensor on each rank of ``owners`` (those owning one of its
    entries), None on the others; every rank calls (the gathers are collectives of the tensor's
    mesh), in the same order."""
    from ..model.lora import merged_expert_weight, merged_linear_weight

    keys = [source.key] + ([source.lora_a, source.lora_b] if source.lora_a is not None else [])  # type: ignore[list-item]
    parts: list[torch.Tensor] = []
    for owner in sorted(owners):
        for key in keys:
            full = _gather_to(state[key], owner, rank)
            if full is not None:
                stats.gathered_bytes += full.nbytes
                parts.append(full)
    if rank not in owners:
        return None
    if source.lora_a is None:
        return parts[0]
    weight, a, b = parts
    with torch.no_grad():
        if source.experts:
            # float32 like the reference (_merged_export takes the adapted bases to float32 first)
            return torch.stack([merged_expert_weight(weight, a, b, source.scaling, e) for e in range(weight.shape[0])])
        return merged_linear_weight(weight, a, b, source.scaling)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with a storage of its own: a slice of a gathered tensor must not
    keep the whole gathered tensor alive until its shard is written."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() > tensor.nbytes:
        tensor = tensor.clone()
    return tensor


#: safetensors' dtype names, ranked as its serializer orders tensors in a file (higher first, then by
#: name): the Rust ``Dtype`` enum's order for the dtypes a GenoLM holds
_ST_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 2),
    torch.int16: ("I16", 5),
    torch.float16: ("F16", 7),
    torch.bfloat16: ("BF16", 8),
    torch.int32: ("I32", 9),
    torch.float32: ("F32", 11),
    torch.float64: ("F64", 12),
    torch.int64: ("I64", 13),
}


class _ShardWriter:
    """One safetensors file written tensor by tensor at precomputed offsets, so that a shard is
    never held in memory: the header (names, dtypes, shapes, offsets) is known before any tensor
    is, and each tensor is written into its place as it arrives, straight from its memory. The
    bytes are ``safetensors.torch.save_file``'s (the same header JSON, order and padding; the
    tests compare the files), for the dtypes of :data:`_ST_DTYPES`.

    Args:
        path: the file.
        tensors: ``(name, dtype, shape)`` of every tensor the file will hold.
        metadata: the header's ``__metadata__``.
    """

    def __init__(
        self, path: Path, tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
    ):
        import json
        import struct

        ordered = sorted(tensors, key=lambda t: (-_ST_DTYPES[t[1]][1], t[0]))
        header: dict[str, Any] = {"__metadata__": metadata}
        self.offsets: dict[str, tuple[int, int]] = {}
        end = 0
        for name, dtype, shape in ordered:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype][0], "shape": list(shape), "data_offsets": [end, end + size]}
            self.offsets[name] = (end, size)
            end += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.start = 8 + len(text)
        self.left = len(ordered)
        self.file = open(path, "wb")  # noqa: SIM115 (closed by put() with the last tensor, or close())
        self.file.write(struct.pack("<Q", len(text)) + text)

    def put(self, name: str, tensor: torch.Tensor) -> bool:
        """Write ``tensor`` (CPU, of the dtype and shape announced) as ``name``; True once the file is complete (closed)."""
        import ctypes

        begin, size = self.offsets[name]
        assert tensor.nbytes == size and tensor.device.type == "cpu", (name, tensor.shape)
        tensor = tensor.contiguous()
        self.file.seek(self.start + begin)
        if size:
            self.file.write((ctypes.c_ubyte * size).from_address(tensor.data_ptr()))  # no copy of the data
        self.left -= 1
        if self.left == 0:
            self.close()
            return True
        return False

    def close(self) -> None:
        self.file.close()


def _broadcast(value: Any, world: int) -> Any:
    """Rank 0's ``value`` on every rank (as is in one process)."""
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_out(out: Path, marker: str, what: str) -> None:
    """Refuse to replace a directory that is not an export (one line naming it)."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / marker).is_file())):
        raise InputError(f"refusing to replace {out}: it exists and is not {what}; choose another path")


def export_model(
    model: GenoLM,
    directory: str | os.PathLike[str],
    lora: Any | None = None,
    merged: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 10**9,
    copy_files: Sequence[str | os.PathLike[str]] = (),
    stats: ExportStats | None = None,
) -> Path | None:
    """Write ``model`` (sharded or not) as a GLM-5.3-Flash checkpoint directory, each rank its own
    shards (see the module docstring); the files equal :func:`genolong.model.hf.save_checkpoint`'s
    of the gathered model bitwise.

    Args:
        model: the live GenoLM: FSDP2 / expert-parallel (every rank calls) or plain (one process).
        directory: the output directory (replaced if it holds an export).
        lora: the LoRA settings ``model`` was adapted with (the recipe's ``model.lora``), or None.
        merged: with ``lora``, write the adapters merged into the base (float32 adapted weights).
        dtype: cast floating tensors (the fp32-kept ones excepted), as ``save_checkpoint``; None: as stored.
        max_shard_bytes: shard size limit (default 5 GB, as transformers).
        copy_files: files copied into the directory by rank 0 (tokenizer files).
        stats: filled with what this rank did, when given.

    Returns:
        The directory on rank 0, None on the other ranks.

    Raises:
        InputError: ``directory`` exists and is not a checkpoint directory; a LoRA model without ``merged``.
    """
    start = time.perf_counter()
    rank, world = _ranks(model)
    stats = stats if stats is not None else ExportStats(files=[])
    out = Path(directory)
    _check_out(out, "config.json", "a checkpoint directory")
    plain, sources = _plain_and_sources(model, lora, merged)
    state = _live_state(model)
    missing = sorted({s.key for s in sources.values()} - set(state))
    if missing:
        raise InputError(
            f"the model to export lacks {missing[0]} (it does not match its config); export the model it was trained as"
        )

    def out_dtype(name: str, target: str) -> torch.dtype:
        source = sources[target]
        stored = torch.float32 if source.lora_a is not None else state[source.key].dtype
        return _out_dtype(name, torch.empty((), dtype=stored, device="meta"), dtype)

    entries = export_entries(plain)
    dtypes = {name: out_dtype(name, e.target) for name, e in entries.items()}
    sizes = [(name, math.prod(e.shape) * dtypes[name].itemsize) for name, e in entries.items()]
    groups = _shards(sizes, max_shard_bytes)
    files = [shard_file(i, len(groups)) for i in range(len(groups))]
    group_of = {name: i for i, group in enumerate(groups) for name in group}
    last_of = {group[-1]: i for i, group in enumerate(groups)}
    mine = [i for i in range(len(groups)) if i % world == rank]
    size_of = dict(sizes)

    tmp: Path | None = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = unique_sibling(out, "tmp")
        tmp.mkdir()
    tmp = Path(_broadcast(None if tmp is None else str(tmp), world))
    try:
        needed = sum(size_of[name] for i in mine for name in groups[i])
        with writing(out, needed=needed, work=tmp):
            streamable = all(d in _ST_DTYPES for d in dtypes.values())
            writers: dict[int, _ShardWriter] = {}
            pending: dict[int, dict[str, torch.Tensor]] = {}  # save_file's way (other dtypes): whole shards
            try:
                for target, group_entries in itertools.groupby(entries.items(), key=lambda item: item[1].target):
                    named = list(group_entries)
                    owners = {group_of[name] % world for name, _ in named}
                    value = _value(sources[target], state, stats, owners, rank)
                    for name, entry in named:
                        i = group_of[name]
                        if i % world != rank:
                            continue
                        assert value is not None
                        piece = value[entry.index].to("cpu", dtypes[name])
                        if streamable:
                            # straight into its place in the file: memory holds the gathered tensor only
                            if i not in writers:
                                writers[i] = _ShardWriter(
                                    tmp / files[i],
                                    [(n, dtypes[n], entries[n].shape) for n in groups[i]],
                                    {"format": "pt"},
                                )
                            if writers[i].put(name, piece):
                                del writers[i]
                                stats.files.append(files[i])
                        else:
                            pending.setdefault(i, {})[name] = _owned(piece)
                            if last_of.get(name) == i:
                                save_file(pending.pop(i), tmp / files[i], metadata={"format": "pt"})
                                stats.files.append(files[i])
                        del piece
                    del value
            finally:
                for writer in writers.values():
                    writer.close()
            stats.bytes_written = sum((tmp / f).stat().st_size for f in stats.files)
            # each rank hashes what it wrote (from the page cache); rank 0 lists every file
            # (1 MiB reads: the export's memory stays that of one tensor)
            digests = {
                files[i]: {
                    "bytes": (tmp / files[i]).stat().st_size,
                    ALGORITHM: file_checksum(tmp / files[i], chunk=2**20),
                }
                for i in mine
            }
            gathered: list[dict[str, dict[str, Any]] | None] = [digests]
            if world > 1:
                gathered = [None] * world
                dist.all_gather_object(gathered, digests)
            if rank == 0:
                known = {name: entry for part in gathered for name, entry in (part or {}).items()}
                if len(groups) > 1:
                    weight_map = {name: files[i] for i, group in enumerate(groups) for name in group}
                    index = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
                    (tmp / INDEX_FILE).write_text(_json(index))
                (tmp / "config.json").write_text(config_text(export_config(model.config), dtypes[HEAD]))
                for extra in copy_files:
                    shutil.copy2(extra, tmp / Path(extra).name)
                index_file = tmp / INDEX_FILE
                for small in [index_file] if index_file.is_file() else []:  # in 1 MiB reads too
                    known[small.name] = {"bytes": small.stat().st_size, ALGORITHM: file_checksum(small, chunk=2**20)}
                write_manifest(tmp, known=known)
                fsync_tree(tmp)
                replace_dir(tmp, out)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if world > 1:
        dist.barrier()  # the export is in place when this returns on any rank
    stats.seconds = time.perf_counter() - start
    return out if rank == 0 else None


def _json(data: Any) -> str:
    import json

    return json.dumps(data, indent=2) + "\n"


def export_adapter(
    model: GenoLM, directory: str | os.PathLike[str], lora: Any, base_model_name_or_path: str | None = None
) -> Path | None:
    """Write ``model``'s LoRA adapters as a PEFT adapter directory
    (:func:`genolong.model.lora.save_adapter`), gathering the adapter tensors only (one at a time;
    the frozen base stays where it is): the same files as ``save_adapter`` of the gathered model.

    Args:
        model: the live GenoLM with adapters (sharded: every rank calls).
        directory: the output directory.
        lora: the LoRA settings ``model`` was adapted with (the recipe's ``model.lora``).
        base_model_name_or_path: recorded in ``adapter_config.json`` (default None).

    Returns:
        The directory on rank 0, None on the other ranks.
    """
    from ..model.lora import adapter_parameters, apply_lora, save_adapter

    rank, _ = _ranks(model)
    state = _live_state(model)
    with torch.device("meta"):
        copy = GenoLM(model.config)
    apply_lora(copy, lora)
    wanted = list(adapter_parameters(copy))
    full = {}
    for name in wanted:  # a collective per tensor on a sharded model: every rank, the same order
        tensor = _gather_to(state[name], 0, rank)
        if tensor is not None:
            full[name] = tensor
    if rank != 0:
        return None
    copy.load_state_dict(full, assign=True, strict=False)
    return save_adapter(copy, directory, base_model_name_or_path=base_model_name_or_path)


# -- a run's exports ---------------------------------------------------------------------------------
def release_offload_pool(model: GenoLM) -> None:
    """Give back the activation offloader's pinned host pool (before the export, at the end of a
    run): the export needs that host memory, and nothing offloads any more."""
    from ..parallel.offload import offloader_of

    offloader = offloader_of(model)
    if offloader is not None:
        offloader.release()


def write_exports(
    recipe: Recipe, model: GenoLM, root: Path, model_export: bool | None = None, adapter_export: bool | None = None
) -> tuple[Path | None, Path | None]:
    """What a run writes at its end, into ``root`` (the run's directory, or ``genolong export
    --out``): ``root/adapter`` (PEFT adapters, under ``model.lora``) and ``root/export`` (the
    model, adapters merged, with ``checkpoint.export_safetensors``); each rank writes its own
    shards (:mod:`genolong.train.export`: every rank must call this).

    Args:
        recipe: the run's recipe.
        model: the live (sharded or plain) trained model.
        root: where ``export/`` and ``adapter/`` go.
        model_export, adapter_export: override what is written (default None: as the recipe says).

    Returns:
        (adapter directory, export directory) on rank 0, each None when not written; (None, None)
        on the other ranks.
    """
    lora = recipe.model.lora
    write_adapter = lora is not None if adapter_export is None else adapter_export and lora is not None
    write_model = recipe.checkpoint.export_safetensors if model_export is None else model_export
    source = recipe.model.checkpoint
    adapter = export = None
    if write_adapter:
        # the adapters first, as the gathered path wrote them
        adapter = export_adapter(model, root / "adapter", lora, base_model_name_or_path=str(source) if source else None)
    if write_model:
        extras = [p for p in (source.glob("tokenizer*") if source else []) if p.is_file()]
        export = export_model(model, root / "export", lora=lora, merged=lora is not None, copy_files=extras)
    return adapter, export

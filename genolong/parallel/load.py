"""The sharded loader: a GLM-5.3-Flash-format checkpoint read straight into each rank's shards.

Training (``genolong finetune``, fresh start and ``--resume``) and multi-process scoring
(:func:`genolong.evaluation.distributed.load_scoring_model`) load the same way:

1. the model is built on the meta device (no storage), LoRA applied, the frozen parameters cast
   to the run's low-precision dtype (still meta: only the dtype changes);
2. :func:`genolong.parallel.parallelize` applies context and expert parallelism and FSDP2, in its
   fixed order, to the meta model (expert parallelism slices meta tensors: no copy);
3. :func:`materialize` allocates each rank's local shards only (``to_empty``), in their final
   dtypes (frozen weights in bf16, trained ones as fp32 masters), and puts back the tensors that
   were real before (LoRA's freshly initialised adapters: each rank keeps its part);
4. :func:`fill_from_safetensors` reads, for every checkpoint tensor, only the rows of this rank's
   shard (:class:`SafetensorsFile`: ``pread`` of the byte runs of a box, straight into the
   destination when the dtypes agree, else through one temporary of that box's size).

Per rank, the memory is the local shards plus at most one checkpoint tensor's box, and the bytes
read are the local shards' (replicated tensors, the norms and the routing biases, read by every
rank). The reads do not go through ``mmap``: pages of a mapped file count in the process's
resident set while the mapping lives, so an mmap reader would show twice the shard.

Every checkpoint tensor is checked against the model before any byte is read (headers only): a
tensor the model has no place for, one it lacks, another shape or kind of dtype is one line naming
the tensor (:class:`~genolong.errors.InputError`), on every rank.

In one process without a mesh the same steps run (no sharding: the whole model, each tensor read
once in its final dtype), which is what :meth:`genolong.model.GenoLM.from_pretrained` followed by
:func:`genolong.train.module.cast_frozen_parameters` gave, bitwise.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import InputError
from ..model.hf import (
    _READ_PREFIXES,
    HEAD,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointTensor,
    _skip_reason,
    _weight_map,
    layout_of,
)

__all__ = [
    "REPORT_VARIABLE",
    "ReadCounter",
    "SafetensorsFile",
    "base_digest",
    "base_targets",
    "check_base",
    "fill_from_safetensors",
    "load_report",
    "local_box",
    "materialize",
    "resident_peak",
    "to_meta",
]

#: safetensors dtype names -> torch dtypes
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class ReadCounter:
    """Bytes a rank read from safetensors files (tensor data only; headers are a few KB per file).

    Attributes:
        bytes: all bytes read.
        replicated: of them, bytes of tensors that every rank holds whole (not sharded).
        largest: the largest single read (one checkpoint tensor's box), bytes.
        files: the files opened.
    """

    bytes: int = 0
    replicated: int = 0
    largest: int = 0
    files: set[str] = field(default_factory=set)


class SafetensorsFile:
    """One ``.safetensors`` file read with ``pread`` (no mmap): its header, and boxes of its tensors.

    Args:
        path: the file.
        counter: where the bytes read are counted (default: a new one).
    """

    def __init__(self, path: Path, counter: ReadCounter | None = None):
        self.path = path
        self.counter = counter if counter is not None else ReadCounter()
        self.fd = os.open(path, os.O_RDONLY)
        try:
            head = os.pread(self.fd, 8, 0)
            if len(head) != 8:
                raise InputError(f"{path} is not a safetensors file (shorter than its header); re-download it")
            size = int.from_bytes(head, "little")
            text = os.pread(self.fd, size, 8)
            header = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            os.close(self.fd)
            raise InputError(f"{path} is not a safetensors file ({exc}); re-download it") from None
        except BaseException:
            os.close(self.fd)
            raise
        header.pop("__metadata__", None)
        self.header: dict[str, dict[str, Any]] = header
        self.data_start = 8 + size
        self.counter.files.add(str(path))

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name``."""
        return tuple(self.header[name]["shape"])

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype name of tensor ``name`` (``"BF16"``, ``"F32"``...)."""
        return str(self.header[name]["dtype"])

    def read_box(
        self, name: str, box: tuple[tuple[int, int], ...], into: torch.Tensor, replicated: bool = False
    ) -> None:
        """Read ``tensor[name][box]`` into ``into`` (any dtype and device, ``box``'s number of elements).

        ``box``: per stored dimension ``(start, stop)``. The box is cut into contiguous byte runs
        (the dimensions after the first partial one are whole); read into ``into`` itself when it
        is a contiguous CPU tensor of the stored dtype, else into one temporary of the box's size.
        """
        entry = self.header[name]
        dtype = _DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        begin = int(entry["data_offsets"][0])
        item = dtype.itemsize
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        # the first dimension (from the end) where the box is not the whole extent
        cut = -1
        for d in range(len(shape) - 1, -1, -1):
            if box[d] != (0, shape[d]):
                cut = d
                break
        runs: list[tuple[int, int]] = []  # (element offset, elements)
        if cut < 0:
            runs.append((0, math.prod(shape)))
        else:
            run = (box[cut][1] - box[cut][0]) * strides[cut]
            lead = [range(a, b) for a, b in box[:cut]]
            for index in itertools.product(*lead):
                offset = sum(i * s for i, s in zip(index, strides)) + box[cut][0] * strides[cut]
                runs.append((offset, run))
        total = sum(n for _, n in runs)
        assert total == into.numel(), (name, box, into.shape)
        direct = into.device.type == "cpu" and into.dtype == dtype and into.is_contiguous()
        target = into if direct else torch.empty(total, dtype=dtype)
        buffer = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B") if total else memoryview(b"")
        position = 0
        for offset, count in runs:
            self._pread(buffer[position : position + count * item], self.data_start + begin + offset * item)
            position += count * item
        if not direct:
            into.copy_(target.view(into.shape))
        nbytes = total * item
        self.counter.bytes += nbytes
        self.counter.largest = max(self.counter.largest, nbytes)
        if replicated:
            self.counter.replicated += nbytes

    def _pread(self, into: memoryview, offset: int) -> None:
        done = 0
        while done < len(into):
            got = os.preadv(self.fd, [into[done:]], offset + done)
            if got <= 0:
                raise InputError(f"{self.path} ends before its header says (truncated); re-download it")
            done += got


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's part of ``tensor`` (a DTensor; a plain tensor:
    zeros and its shape)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def base_targets(model: nn.Module) -> dict[str, str]:
    """Plain-GenoLM ``state_dict`` name -> ``model``'s name, for every tensor a base checkpoint
    fills: LoRA's wrapped layers hold the base weight as ``M.base.weight`` (``M.weight`` in the
    base); the adapters (``lora_A`` / ``lora_B``, ``experts.lora.*``) are in no base checkpoint."""
    from ..model.lora import LoraLinear

    wrapped = [name for name, module in model.named_modules() if isinstance(module, LoraLinear)]
    out: dict[str, str] = {}
    for name in model.state_dict(keep_vars=True):
        if re.search(r"\.lora_[AB]\.|\.experts\.lora\.", name):
            continue
        base = name
        for module in wrapped:
            if name.startswith(module + ".base."):
                base = module + "." + name[len(module) + len(".base.") :]
                break
        out[base] = name
    return out


def to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Move every real (non-meta) parameter of ``model`` to the meta device, in place; returns
    their values by name (LoRA's adapters, initialised when applied to the meta base), for
    :func:`materialize` to put back after sharding."""
    kept: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or param.device.type == "meta":
                continue
            kept[f"{module_name}.{leaf}" if module_name else leaf] = param.detach()
            module._parameters[leaf] = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    return kept


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, kept: Mapping[str, torch.Tensor] | None = None) -> None:
    """Allocate ``model``'s local shards (``to_empty``: uninitialised, each tensor in its dtype)
    on ``device`` and copy this rank's part of each of ``kept`` (:func:`to_meta`) into place."""
    model.to_empty(device=device)
    state = model.state_dict(keep_vars=True)
    for name, value in (kept or {}).items():
        target = state[name]
        offset, shape = local_box(target)
        box = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        _local(target).copy_(value[box])


def _float(dtype: str) -> bool:
    return dtype.startswith(("F", "BF"))


def fill_from_safetensors(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    skip: Callable[[str], bool] | None = None,
    counter: ReadCounter | None = None,
) -> ReadCounter:
    """Fill ``model``'s local parts (materialised: :func:`materialize`) from a GLM-5.3-Flash-format
    directory, each rank reading only the rows of its own shards.

    Args:
        model: a GenoLM (LoRA-wrapped or not), sharded (FSDP2 / EP DTensors) or whole; every tensor
            in the dtype it should have (values are cast on the way in; buffers keep theirs).
        directory: config.json + ``model.safetensors`` or an index and its shards.
        skip: ``model`` state names not to read (they come from elsewhere: a resumed checkpoint);
            default None: every tensor of the base.
        counter: where the bytes read are counted (default: a new one).

    Returns:
        The counter.

    Raises:
        InputError: a missing shard or index, a checkpoint tensor the model has no place for, one
            it lacks, another shape or kind of dtype (each named), before anything is read.
    """
    directory = Path(directory)
    counter = counter if counter is not None else ReadCounter()
    targets = base_targets(model)  # base name -> model name
    state = model.state_dict(keep_vars=True)
    shapes = {base: tuple(state[name].shape) for base, name in targets.items()}
    floating = {base: state[name].is_floating_point() for base, name in targets.items()}
    weight_map = _weight_map(directory)
    prefix = next((p for p in _READ_PREFIXES if f"{p}embed_tokens.weight" in weight_map), None)
    if prefix is None:
        raise InputError(
            f"checkpoint {directory} has no embed_tokens.weight under any of {_READ_PREFIXES}; "
            "it is not a GLM-5.3-Flash text model"
        )
    num_layers = model.config.num_hidden_layers  # type: ignore[union-attr]
    stored: dict[str, str] = {}  # relative name -> full name
    for name in weight_map:
        if _skip_reason(name, prefix, num_layers) is None:
            stored[name if name == HEAD else name[len(prefix) :]] = name
    # every target from its split tensors (the original layout) or from one fused tensor
    by_target: dict[str, list[CheckpointTensor]] = {}
    for entry in layout_of(shapes.items()):
        by_target.setdefault(entry.target, []).append(entry)
    plan: list[CheckpointTensor] = []
    for target, entries in by_target.items():
        if any(e.name not in stored for e in entries) and target in stored:
            entries = [CheckpointTensor(target, target, (), shapes[target])]  # transformers' fused names
        for entry in entries:
            if entry.name not in stored:
                raise InputError(
                    f"checkpoint {directory} lacks tensor {prefix if entry.name != HEAD else ''}{entry.name} "
                    "the model needs; the checkpoint is incomplete or config.json describes another model"
                )
        plan.extend(entries)
    used = {e.name for e in plan}
    extra = [stored[n] for n in stored if n not in used]
    if extra:
        raise InputError(
            f"checkpoint {directory}: tensor {extra[0]} in {weight_map[extra[0]]} has no place in GenoLM built "
            "from its config.json; the checkpoint and config.json disagree (or it is not GLM-5.3-Flash)"
        )
    files: dict[str, SafetensorsFile] = {}
    try:

        def source(name: str) -> SafetensorsFile:
            shard = weight_map[name]
            if shard not in files:
                files[shard] = SafetensorsFile(directory / shard, counter)
            return files[shard]

        for entry in plan:  # headers only: every problem before any byte is read
            full = stored[entry.name]
            f = source(full)
            if full not in f.header:
                raise InputError(
                    f"checkpoint {directory}: {INDEX_FILE} puts tensor {full} in {weight_map[full]}, which does "
                    "not hold it; repair the index or re-download"
                )
            if f.shape(full) != entry.shape:
                raise InputError(
                    f"checkpoint {directory}: tensor {full} in {weight_map[full]} has shape {list(f.shape(full))} "
                    f"but the model built from config.json expects {list(entry.shape)}; config.json does "
                    "not match the weights"
                )
            if _float(f.dtype_name(full)) != floating[entry.target]:
                raise InputError(
                    f"checkpoint {directory}: tensor {full} in {weight_map[full]} is stored as "
                    f"{f.dtype_name(full)} but the model expects {'a floating' if floating[entry.target] else 'an integer'} "
                    "tensor; the checkpoint is damaged or not GLM-5.3-Flash"
                )
        filled: dict[str, int] = {}
        with torch.no_grad():
            for entry in plan:
                name = targets[entry.target]
                if skip is not None and skip(name):
                    continue
                target = state[name]
                offset, local_shape = local_box(target)
                lo, hi, squeeze = [], [], []
                for d in range(target.dim()):  # the entry's region of the target
                    part = entry.index[d] if d < len(entry.index) else slice(None)
                    if isinstance(part, int):
                        lo.append(part), hi.append(part + 1), squeeze.append(True)
                    else:
                        start, stop, _ = part.indices(target.shape[d])
                        lo.append(start), hi.append(stop), squeeze.append(False)
                a = [max(x, o) for x, o in zip(lo, offset)]
                b = [min(x, o + s) for x, o, s in zip(hi, offset, local_shape)]
                if any(x >= y for x, y in zip(a, b)):
                    continue  # none of this checkpoint tensor lies in this rank's shard
                dest = _local(target)[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, offset))]
                # the stored tensor's dims are the target's without the integer-indexed ones
                box = tuple((x - l, y - l) for x, y, l, sq in zip(a, b, lo, squeeze) if not sq)
                sharded = isinstance(target, DTensor) and any(not p.is_replicate() for p in target.placements)
                source(stored[entry.name]).read_box(stored[entry.name], box, dest, replicated=not sharded)
                filled[name] = filled.get(name, 0) + dest.numel()
    finally:
        for f in files.values():
            f.close()
    for name in targets.values():
        if skip is not None and skip(name):
            continue
        if filled.get(name, 0) != _local(state[name]).numel():
            raise InputError(
                f"checkpoint {directory} does not fill {name} of the model built from config.json; "
                "the checkpoint is incomplete or describes another model"
            )
    return counter


def base_digest(directory: str | os.PathLike[str]) -> str:
    """A digest naming a base checkpoint's weights, recorded in a run's checkpoints (its frozen
    weights are read from the base again on ``--resume``, which must be the same): the checksum
    manifest's own digest when the directory has one (:mod:`genolong.integrity`, covering every
    weights file), else a sha256 of the index (or single file's header) and every weights file's
    size. Reads no tensor data."""
    from ..integrity import manifest_path

    path = Path(directory)
    manifest = manifest_path(path)
    if manifest.is_file():
        try:
            return "manifest:" + str(json.loads(manifest.read_text())["manifest_sha256"])
        except (ValueError, KeyError):
            pass  # a damaged manifest: check_weights names it when the weights are checked
    h = hashlib.sha256()
    index = path / INDEX_FILE
    if index.is_file():
        h.update(index.read_bytes())
    elif (path / SINGLE_FILE).is_file():
        f = SafetensorsFile(path / SINGLE_FILE)
        h.update(json.dumps(f.header, sort_keys=True).encode())
        f.close()
    for file in sorted(path.glob("*.safetensors")):
        h.update(f"{file.name}:{file.stat().st_size}".encode())
    return "sizes:" + h.hexdigest()


def check_base(directory: str | os.PathLike[str]) -> None:
    """Check a base checkpoint's files before the ranks read it (:func:`genolong.integrity.check_weights`):
    in a job each rank hashes a ``1/world`` share of the weights files (sizes and structure on
    every rank), and a damaged file found by any rank is raised on every rank (a collective)."""
    import torch.distributed as dist

    from ..integrity import DamagedFileError, check_weights

    joined = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not joined:
        check_weights(directory)
        return
    found: str | None = None
    try:
        check_weights(directory, shards=(dist.get_rank(), dist.get_world_size()))
    except DamagedFileError as error:
        found = str(error)
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, found)
    for report in reports:
        if report is not None:
            raise InputError(report)


#: an environment variable naming a directory: each rank's load figures are written there as
#: ``load-rank{R}.json`` (:func:`load_report`; the tests and benchmarks/sharded_load.py read them)
REPORT_VARIABLE = "GENOLONG_LOAD_REPORT"


def resident_peak(reset: bool = False) -> int | None:
    """This process's resident-set peak (``VmHWM``) in bytes, or with ``reset`` its resident set
    now (``VmRSS``) after starting the peak again from it (``/proc/self/clear_refs``); None where
    /proc has neither (not Linux)."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    if reset:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return None
    field = "VmRSS:" if reset else "VmHWM:"
    for line in status.read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return None


def load_report(model: nn.Module, counter: ReadCounter, before: int | None, peak: int | None) -> None:
    """Write this rank's load figures to ``$GENOLONG_LOAD_REPORT/load-rank{R}.json`` when that
    variable is set: ``read`` and ``replicated`` (bytes, :class:`ReadCounter`), ``largest`` (the
    largest read), ``share`` (bytes of this rank's local tensors), ``increase`` (resident-set peak
    during the load over the resident set before it; None off Linux)."""
    directory = os.environ.get(REPORT_VARIABLE)
    if not directory:
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    share = sum(_local(t).numel() * t.element_size() for t in model.state_dict(keep_vars=True).values())
    figures = {
        "read": counter.bytes,
        "replicated": counter.replicated,
        "largest": counter.largest,
        "share": share,
        "increase": None if before is None or peak is None else peak - before,
    }
    Path(directory).mkdir(parents=True, exist_ok=True)
    Path(directory, f"load-rank{rank}.json").write_text(json.dumps(figures) + "\n")

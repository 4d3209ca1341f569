"""Measured activation memory: the bytes autograd keeps for backward, per layer, and device peaks.

:class:`ActivationMeter` is a context manager around one (or more) training steps. While it is
active, every tensor that autograd saves for backward outside a recompute region goes through its
``saved_tensors_hooks`` pack hook and is counted once per storage (two views of one tensor, or a
tensor saved by two ops, cost memory once); the count drops when autograd releases the tensor
(after the node's backward, or when the graph is dropped). Parameters and buffers saved by an op
(a weight saved by ``F.linear``) are not activations and are not counted.

Attribution: forward pre/post hooks on ``model.layers[i]`` tell the meter which layer is running;
tensors saved outside any layer (embedding, final norm, loss) count as ``outside``.

Offload: :class:`genolong.parallel.offload.ActivationOffloader` installs its own per-layer hooks
(innermost hooks win in torch, so the meter's hooks do not see what it packs) and reports to the
active meter instead: bytes it moves to the host pool count as *offloaded*, bytes it keeps on the
device as *resident*, and bytes it brings back for backward (its prefetch window) as resident
again until autograd releases them.

Not seen by the meter: activations rebuilt inside a recompute region during backward (they live
only while their layer's backward runs; the device peak and the RSS peak include them).

Device peaks: ``torch.cuda.max_memory_allocated`` since entering (CUDA models); on CPU the peak
resident set size of the process since entering (Linux ``VmHWM``, reset on entry through
``/proc/self/clear_refs``; where that is impossible, the lifetime peak and ``rss_peak_reset`` is
False).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "LiveBytes",
    "ActivationMeter",
    "Charge",
    "LayerMemory",
    "current_meter",
    "peak_rss_bytes",
    "tensor_bytes",
    "track_saved",
    "untrack_saved",
]

_ACTIVE: list[ActivationMeter] = []


def current_meter() -> ActivationMeter | None:
    """The innermost active :class:`ActivationMeter`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of memory a saved tensor keeps alive: its whole storage (a view keeps all of it)."""
    if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
        return 0 if tensor.device.type == "meta" else tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().nbytes()


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _param_storages(modules: Sequence[nn.Module]) -> set[tuple[str, int]]:
    keys = set()
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if isinstance(t, DTensor):
                t = t.to_local()  # an FSDP2 shard: its local storage (the gathered copies are Parameters)
            if t.device.type != "meta" and t.numel() and t.untyped_storage().nbytes():
                keys.add(_storage_key(t))
    return keys


@dataclass
class LayerMemory:
    """Saved-activation bytes packed while one layer ran forward (cumulative over the meter's life).

    Attributes:
        resident_bytes: saved tensors left on the device (unique storages).
        offloaded_bytes: saved tensors moved to the host pool by the offloader.
    """

    resident_bytes: int = 0
    offloaded_bytes: int = 0


class _Resident:
    """What the meter's pack hook returns for a tensor kept on the device: the tensor plus a charge."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: tuple[str, int]):
        self.tensor = tensor
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        self.meter._release_storage(self.key)


class Charge:
    """A byte charge on a meter that lasts as long as this object (the offloader keeps one per
    offloaded tensor and one per prefetched device copy)."""

    __slots__ = ("meter", "kind", "nbytes")

    def __init__(self, meter: ActivationMeter, kind: str, nbytes: int):
        self.meter, self.kind, self.nbytes = meter, kind, nbytes
        meter._add(kind, nbytes)

    def __del__(self) -> None:
        self.meter._add(self.kind, -self.nbytes)


def track_saved(tensor: torch.Tensor) -> Any:
    """Pack ``tensor`` as a device-resident saved activation of the active meter (if any).

    For other ``saved_tensors_hooks`` (the offloader) that keep a tensor on the device; undo with
    :func:`untrack_saved`.
    """
    meter = current_meter()
    return meter._pack(tensor) if meter is not None else tensor


def untrack_saved(packed: Any) -> torch.Tensor:
    """The tensor behind :func:`track_saved`'s result."""
    return packed.tensor if isinstance(packed, _Resident) else packed


class ActivationMeter:
    """Counts saved-activation bytes per layer, resident vs offloaded, and device peaks.

    Args:
        model: the model (its ``layers`` are attributed; its parameters and buffers are excluded
            from the count). Default None: no per-layer attribution, only ``nn.Parameter``
            instances are excluded.
        layers: the modules to attribute to (default ``model.layers`` when it exists).

    Use::

        with ActivationMeter(model) as meter:
            nll, weight = model.loss(tokens)     # tokens [B, T]
            (nll / weight).backward()
        meter.peak_resident_bytes, meter.layers[i].resident_bytes, meter.summary()

    Live figures (``resident_bytes``, ``offloaded_bytes``) move while the meter is active; peaks
    and per-layer totals are over the whole ``with`` block. The meter does not nest with itself.
    """

    def __init__(self, model: nn.Module | None = None, layers: Sequence[nn.Module] | None = None):
        self.model = model
        if layers is None and model is not None and isinstance(getattr(model, "layers", None), nn.ModuleList):
            layers = list(model.layers)  # type: ignore[arg-type]
        self._layer_modules: list[nn.Module] = list(layers or [])
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._hooks: saved_tensors_hooks | None = None
        self._layer_stack: list[int] = []
        self._live: dict[tuple[str, int], list[int]] = {}  # storage key -> [bytes, refcount]
        self._params: set[tuple[str, int]] = set()
        self._device: torch.device | None = None
        self.reset()

    # -- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero every figure (live tensors already counted keep being released correctly)."""
        with self._lock:
            self.resident_bytes = sum(v[0] for v in self._live.values())
            self.offloaded_bytes = 0
            self.peak_resident_bytes = self.resident_bytes
            self.peak_offloaded_bytes = 0
            self.peak_total_bytes = self.resident_bytes
            self.layers = [LayerMemory() for _ in self._layer_modules]
            self.outside = LayerMemory()
            self.device_peak_bytes: int | None = None
            self.peak_rss_bytes: int | None = None
            self.rss_peak_reset = False

    @property
    def current_layer(self) -> int | None:
        """Index of the innermost layer now running forward (None outside the layers)."""
        return self._layer_stack[-1] if self._layer_stack else None

    def _bucket(self) -> LayerMemory:
        layer = self.current_layer
        return self.outside if layer is None else self.layers[layer]

    def _add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            if kind == "resident":
                self.resident_bytes += nbytes
                self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
            else:
                self.offloaded_bytes += nbytes
                self.peak_offloaded_bytes = max(self.peak_offloaded_bytes, self.offloaded_bytes)
            self.peak_total_bytes = max(self.peak_total_bytes, self.resident_bytes + self.offloaded_bytes)

    def charge(self, kind: str, nbytes: int, *, per_layer: bool = True) -> Charge:
        """A charge of ``nbytes`` as ``kind`` ("resident" or "offloaded") that ends when the returned
        object is garbage; with ``per_layer`` it is also added to the running layer's totals."""
        if kind not in ("resident", "offloaded"):
            raise ValueError(f"charge kind must be 'resident' or 'offloaded', got {kind!r}")
        if per_layer:
            bucket = self._bucket()
            if kind == "resident":
                bucket.resident_bytes += nbytes
            else:
                bucket.offloaded_bytes += nbytes
        return Charge(self, kind, nbytes)

    def is_parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a parameter or buffer (or a view of one): not an activation."""
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return True
        if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
            return False
        return _storage_key(tensor) in self._params

    # -- saved tensor hooks ---------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested or self.is_parameter(tensor):
            return tensor
        # Keep a detached alias, not the tensor itself: a saved *output* carries the grad_fn that
        # owns this packed object, and holding it would close a cycle through C++ (grad_fn ->
        # SavedVariable -> _Resident -> tensor -> grad_fn) that Python's gc cannot see. A graph
        # that never runs backward (a branch the loss does not use) then leaks every step.
        # Lossless: autograd restores the grad_fn when it unpacks a saved output.
        tensor = tensor.detach()
        key = _storage_key(tensor)
        with self._lock:
            entry = self._live.get(key)
            if entry is not None:
                entry[1] += 1
                return _Resident(tensor, self, key)
            nbytes = tensor_bytes(tensor)
            self._live[key] = [nbytes, 1]
        self._bucket().resident_bytes += nbytes
        self._add("resident", nbytes)
        return _Resident(tensor, self, key)

    def _release_storage(self, key: tuple[str, int]) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1]:
                return
            del self._live[key]
        self._add("resident", -entry[0])

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return untrack_saved(packed)

    # -- layer attribution ----------------------------------------------------------------------
    def _enter_layer(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._layer_stack.append(index)

        return hook

    def _exit_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._layer_stack:
            self._layer_stack.pop()

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> ActivationMeter:
        if self in _ACTIVE:
            raise RuntimeError("this ActivationMeter is already active")
        self._params = _param_storages([self.model]) if self.model is not None else set()
        self.reset()
        for i, layer in enumerate(self._layer_modules):
            # prepend: set the layer before any other pre-hook (offload, checkpoint) saves inputs
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(i), prepend=True))
            self._handles.append(layer.register_forward_hook(self._exit_layer, always_call=True))
        self._device = _model_device(self.model)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        self.rss_peak_reset = _reset_rss_peak()
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _ACTIVE.remove(self)
        assert self._hooks is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._layer_stack.clear()
        self.update_peaks()

    def start(self) -> ActivationMeter:
        """Same as entering the ``with`` block (for callbacks: start at batch start...)."""
        return self.__enter__()

    def stop(self) -> None:
        """...and stop after backward and the optimizer step (same as leaving the ``with`` block)."""
        self.__exit__(None, None, None)

    def update_peaks(self) -> None:
        """Read the device peak (CUDA) and the process peak RSS now (done on exit too)."""
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            self.device_peak_bytes = int(torch.cuda.max_memory_allocated(self._device))
        self.peak_rss_bytes = peak_rss_bytes()

    def summary(self) -> dict[str, Any]:
        """Plain-dict figures (bytes) for logs and JSON: peaks, live bytes, per-layer totals."""
        return {
            "peak_resident_bytes": self.peak_resident_bytes,
            "peak_offloaded_bytes": self.peak_offloaded_bytes,
            "peak_total_bytes": self.peak_total_bytes,
            "resident_bytes": self.resident_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "layers": [asdict(layer) for layer in self.layers],
            "outside": asdict(self.outside),
            "device_peak_bytes": self.device_peak_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "rss_peak_reset": self.rss_peak_reset,
        }


def _model_device(model: nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    for p in model.parameters():
        return p.device
    return None


def _reset_rss_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0); False where impossible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (since the last reset on Linux)."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{os.getpid()}/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages torch creates while active and still alive (each storage counted
    once, released when torch frees it): what a step (e.g. a backward, rebuilt activations
    included) allocates, free of the allocator's rounding and fragmentation. A
    ``TorchDispatchMode``, so it slows what runs under it. ``peak`` after the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out

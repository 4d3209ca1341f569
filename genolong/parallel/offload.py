"""CPU activation offload: saved activations of each layer go to host memory, and come back
(prefetched one layer ahead) for backward.

:class:`ActivationOffloader` hooks every block of the model. While block ``i`` runs forward it
installs ``saved_tensors_hooks`` whose pack hook copies each saved tensor of at least
``min_bytes`` into a host buffer and hands autograd a small handle instead; smaller tensors,
parameters and buffers stay where they are. During backward, the first unpack of a handle of
block ``i`` brings all of block ``i``'s tensors back to the device and starts bringing block
``i - 1``'s (the next block backward will need), so the copies overlap the computation.

On CUDA the host buffers are pinned (torch's caching host allocator pools them across steps),
device-to-host copies run on a side stream that waits for the producing kernels, host-to-device
copies on another side stream, and the compute stream waits for a block's copies only when it
first needs one of its tensors. Memory safety across streams uses ``record_stream``: a device
tensor is not reused before the copy that reads it has run.

On CPU the "device" is host memory too. The same code path runs with real, synchronous copies
(pack copies into a separate host tensor, fetch copies it back): the tests then check that
backward reads the restored copies, the meter's accounting (resident vs offloaded, the prefetch
window) is the one a GPU run would show, and the step time includes the copying, an upper bound
of what overlapped copies cost on a GPU. It does not lower the process RSS (both "sides" are RAM).

With full recompute (:func:`genolong.parallel.recompute.apply_recompute`, mode "full") the only
tensors a block saves are its inputs, so the device keeps at most two blocks' inputs (the one
backward works on and the prefetched one) whatever the number of layers.

Assumption (as for ``torch.autograd.graph.save_on_cpu``): a saved tensor is not modified in
place after it is saved; autograd's version check cannot see through the copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ..errors import InputError
from ..memory.meter import Charge, current_meter, track_saved, untrack_saved

__all__ = ["ActivationOffloader", "apply_offload", "offloader_of", "pinned_block_bytes"]

_OFFLOADERS: weakref.WeakKeyDictionary[nn.Module, ActivationOffloader] = weakref.WeakKeyDictionary()


def _in_backward() -> bool:
    # -1 outside the autograd engine; hooks must not offload while backward recomputes a module
    return torch._C._current_graph_task_id() != -1


def _storages(module: nn.Module) -> set[tuple[str, int]]:
    """(device, storage address) of every parameter and buffer of ``module`` (a DTensor's local
    tensor's)."""
    out = set()
    for t in (*module.parameters(), *module.buffers()):
        t = t._local_tensor if isinstance(t, DTensor) else t
        if t.device.type != "meta":
            out.add((str(t.device), t.untyped_storage().data_ptr()))
    return out


class _Group:
    """The offloaded tensors of one forward call of one layer."""

    def __init__(self, position: int, prev: _Group | None):
        self.position = position
        self.prev = weakref.ref(prev) if prev is not None and prev.position == position - 1 else None
        self.handles: list[weakref.ReferenceType[_Offloaded]] = []
        self.keep: list[torch.Tensor] = []  # device tensors referenced until the layer ends (dedupe)
        self.dedupe: dict[tuple[Any, ...], _Offloaded] = {}
        self.params: set[tuple[str, int]] = set()
        self.module: nn.Module | None = None  # the layer (its parameter storages are re-read on a miss)
        self.d2h_done: torch.cuda.Event | None = None
        self.h2d_done: torch.cuda.Event | None = None
        self.fetched = False
        self.device: torch.device | None = None  # of the offloaded tensors (one device per layer)

    def previous(self) -> _Group | None:
        return self.prev() if self.prev is not None else None


class _Offloaded:
    """Handle autograd stores for an offloaded tensor: the host copy and, once fetched, the device copy."""

    __slots__ = ("host", "device", "group", "device_copy", "host_charge", "reload_charge", "pool", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group, pool: ActivationOffloader):
        self.host = host
        self.device = device
        self.group = group
        self.device_copy: torch.Tensor | None = None
        meter = current_meter()
        self.host_charge: Charge | None = meter.charge("offloaded", host.nbytes) if meter is not None else None
        self.reload_charge: Charge | None = None
        self.pool = pool
        pool._host_add(host.nbytes)

    def __del__(self) -> None:
        self.pool._host_add(-self.host.nbytes)


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's caching host allocator reserves for a pinned buffer of ``nbytes``: the next
    power of two (``CachingHostAllocator``: "Round up the allocation to the nearest power of two
    to improve reuse", for sizes up to ``pinned_max_round_threshold``, unlimited by default);
    0 for 0."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


class ActivationOffloader:
    """Moves each layer's saved activations of at least ``min_bytes`` to host memory.

    Args:
        min_bytes: smallest tensor (bytes) worth a copy (default 1 MiB); smaller ones, and empty
            ones whatever the threshold, stay.
        prefetch: during backward, fetch the previous layer's tensors while the current layer
            computes (default True).

    Attach with :meth:`attach` (or :func:`apply_offload`). Host pool figures:
    ``host_bytes`` (now) and ``peak_host_bytes``; ``pinned_bytes`` / ``peak_pinned_bytes``: the
    same buffers as torch's pinned caching allocator reserves them on CUDA (each rounded up to a
    power of two, :func:`pinned_block_bytes`); ``copies_to_host``/``copies_to_device`` count
    tensors copied since construction.
    """

    def __init__(self, min_bytes: int = 2**20, prefetch: bool = True):
        if min_bytes < 0:
            raise InputError(f"offload_min_bytes must be >= 0, got {min_bytes}")
        self.min_bytes = int(min_bytes)
        self.prefetch = prefetch
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self.copies_to_host = 0
        self.copies_to_device = 0
        self._handles: list[Any] = []
        self._stack: list[tuple[saved_tensors_hooks | None, _Group | None]] = []
        self._last_group: _Group | None = None
        self._d2h: dict[torch.device, torch.cuda.Stream] = {}
        self._h2d: dict[torch.device, torch.cuda.Stream] = {}

    # -- attachment -----------------------------------------------------------------------------
    def attach(self, layers: Sequence[nn.Module]) -> ActivationOffloader:
        """Hook ``layers`` (in forward order; position ``i`` prefetches position ``i - 1``)."""
        if self._handles:
            raise InputError("this ActivationOffloader is already attached; detach() it first")
        for position, layer in enumerate(layers):
            # prepend: enter before other pre-hooks so everything the layer saves is seen
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(position), prepend=True))
            self._handles.append(layer.register_forward_hook(self._post_hook, always_call=True))
        return self

    def detach(self) -> None:
        """Remove the hooks (tensors already offloaded still come back in backward)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, position: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled() or _in_backward():
                self._stack.append((None, None))
                return
            group = _Group(position, self._last_group)
            group.params, group.module = _storages(module), module
            self._last_group = group
            ctx = saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._stack.append((ctx, group))
        return hook

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        ctx, group = self._stack.pop()
        if ctx is None or group is None:
            return
        ctx.__exit__(None, None, None)
        if group.device is not None and group.device.type == "cuda":
            group.d2h_done = self._stream(self._d2h, group.device).record_event()
        group.keep.clear()  # record_stream already protects memory still being read by a copy
        group.dedupe.clear()
        group.params.clear()
        group.module = None

    # -- streams --------------------------------------------------------------------------------
    def _stream(self, table: dict[torch.device, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
        stream = table.get(device)
        if stream is None:
            stream = table[device] = torch.cuda.Stream(device)
        return stream

    def _host_add(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        # the pinned pool the same buffers take on CUDA (each rounded up to a power of two)
        self.pinned_bytes += pinned_block_bytes(abs(nbytes)) * (1 if nbytes >= 0 else -1)
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    # -- saved tensor hooks ---------------------------------------------------------------------
    @staticmethod
    def _is_parameter(tensor: torch.Tensor, group: _Group) -> bool:
        """Whether ``tensor`` lives in a parameter's (or buffer's) storage. A nested FSDP2 unit
        (the routed experts under expert parallelism) unshards its parameters after the layer's
        pre-hook ran, into storages that hook could not see: on a miss, read them again."""
        key = (str(tensor.device), tensor.untyped_storage().data_ptr())
        if key in group.params:
            return True
        if group.module is not None:
            group.params = _storages(group.module)
        return key in group.params

    def _pack(self, tensor: torch.Tensor) -> Any:
        group = self._stack[-1][1]
        assert group is not None
        # an empty tensor is never worth a copy, whatever min_bytes says (torch 2.11's checkpoint
        # saves one per recomputed layer: offloading it cost a D2H and an H2D launch for 0 bytes)
        if (tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested or isinstance(tensor, nn.Parameter)
                or isinstance(tensor._base, nn.Parameter) or tensor.numel() == 0
                or tensor.numel() * tensor.element_size() < self.min_bytes
                or self._is_parameter(tensor, group)):
            return track_saved(tensor)
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        handle = group.dedupe.get(key)
        if handle is not None:
            return handle
        if tensor.device.type == "cuda":
            stream = self._stream(self._d2h, tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            host.copy_(tensor)
        self.copies_to_host += 1
        group.device = tensor.device
        handle = _Offloaded(host, tensor.device, group, self)
        group.handles.append(weakref.ref(handle))
        group.keep.append(tensor)
        group.dedupe[key] = handle
        return handle

    def _fetch(self, group: _Group) -> None:
        """Copy every live tensor of ``group`` back to its device (on CUDA: on the side stream)."""
        if group.fetched:
            return
        group.fetched = True
        handles = [h for h in (ref() for ref in group.handles) if h is not None and h.device_copy is None]
        meter = current_meter()
        cuda = [h for h in handles if h.device.type == "cuda"]
        if cuda:
            stream = self._stream(self._h2d, cuda[0].device)
            if group.d2h_done is not None:
                stream.wait_event(group.d2h_done)
            with torch.cuda.stream(stream):
                for h in cuda:
                    h.device_copy = h.host.to(h.device, non_blocking=True)
            group.h2d_done = stream.record_event()
        for h in handles:
            if h.device.type != "cuda":
                h.device_copy = torch.empty(h.host.shape, dtype=h.host.dtype, device=h.device)
                h.device_copy.copy_(h.host)
            if meter is not None:
                h.reload_charge = meter.charge("resident", h.host.nbytes, per_layer=False)
        self.copies_to_device += len(handles)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return untrack_saved(packed)
        group = packed.group
        if packed.device_copy is None:
            group.fetched = False  # a handle of a fetched group that lost its copy: fetch again
            self._fetch(group)
        if self.prefetch:
            prev = group.previous()
            if prev is not None:
                self._fetch(prev)
        tensor = packed.device_copy
        assert tensor is not None
        if tensor.device.type == "cuda":
            current = torch.cuda.current_stream(tensor.device)
            if group.h2d_done is not None:
                current.wait_event(group.h2d_done)
            tensor.record_stream(current)
        return tensor


def apply_offload(model: nn.Module, min_bytes: int = 2**20, prefetch: bool = True) -> ActivationOffloader:
    """Attach an :class:`ActivationOffloader` to ``model.layers`` (see :func:`offloader_of`).

    Raises:
        InputError: a model without ``layers`` or one that already has an offloader.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise InputError(f"apply_offload needs a model with layers (a GenoLM); got {type(model).__name__}")
    if model in _OFFLOADERS:
        raise InputError("activation offload is already applied to this model")
    offloader = ActivationOffloader(min_bytes, prefetch).attach(list(layers))
    _OFFLOADERS[model] = offloader
    return offloader


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The offloader :func:`apply_offload` attached to ``model`` (None if none)."""
    return _OFFLOADERS.get(model)

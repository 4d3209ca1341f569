"""CPU activation offload: saved activations of each layer go to host memory, and come back
(prefetched one layer ahead) for backward.

:class:`ActivationOffloader` hooks every block of the model. While block ``i`` runs forward it
installs ``saved_tensors_hooks`` whose pack hook copies each saved tensor of at least
``min_bytes`` into a host buffer and hands autograd a small handle instead; smaller tensors,
parameters and buffers stay where they are. During backward, the first unpack of a handle of
block ``i`` brings all of block ``i``'s tensors back to the device and starts bringing block
``i - 1``'s (the next block backward will need), so the copies overlap the computation.

The host copies are carved out of one buffer, :class:`HostPool` (pinned on CUDA), allocated once:
at the first copy when its size is given (``pool_bytes``: the planner's pinned-host figure,
``genolong plan``), otherwise at the first copy of the second step, sized by what the first step
took from it (its copies allocated one by one, as before; copies that die during forward free no
room before the step ends, so this can exceed the step's peak of live copies). It is reused every step (a bump
allocator that rewinds when no copy is alive, i.e. once backward has consumed a step's copies); a
copy that does not fit is allocated on its own (``unpooled_copies``). :meth:`ActivationOffloader.release`
gives the pool back (before the export, at the end of a run). The time to pin it is logged once.
Device-to-host copies run on a side stream that waits for the producing kernels, host-to-device
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

import logging
import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ..errors import InputError
from ..memory.meter import Charge, current_meter, track_saved, untrack_saved
from ..units import format_bytes

__all__ = ["ActivationOffloader", "HostPool", "apply_offload", "offloader_of", "pinned_block_bytes"]

log = logging.getLogger("genolong")

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


class HostPool:
    """One host buffer the offloader's copies are carved from (pinned on CUDA), allocated once.

    A bump allocator: :meth:`take` hands out the next ``nbytes`` (rounded up to :attr:`ALIGN`),
    :meth:`give` returns them; when nothing taken is alive the next :meth:`take` starts again at
    the buffer's start (a training step's copies all die in its backward, before the next forward).

    Args:
        nbytes: the buffer's size in bytes.
        pin: page-lock it (a CUDA device's host copies), else plain host memory (the CPU path).
    """

    #: every slot starts at a multiple of this many bytes (any dtype's alignment; cache lines)
    ALIGN = 512

    def __init__(self, nbytes: int, pin: bool):
        start = time.perf_counter()
        self.buffer = torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pin)
        #: seconds the allocation (and pinning) took
        self.seconds = time.perf_counter() - start
        self.pinned = pin
        self.offset = 0  # the next free byte
        self.live = 0  # slots taken and not given back

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @classmethod
    def slot_bytes(cls, nbytes: int) -> int:
        """The bytes a copy of ``nbytes`` takes in the pool (rounded up to :attr:`ALIGN`)."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of ``shape`` / ``dtype`` in the pool, or None when it does not fit."""
        if self.live == 0:
            self.offset = 0
        nbytes = math.prod(shape) * dtype.itemsize
        size = self.slot_bytes(nbytes)
        if self.offset + size > self.nbytes:
            return None
        tensor = self.buffer[self.offset : self.offset + nbytes].view(dtype).view(tuple(shape))
        self.offset += size
        self.live += 1
        return tensor

    def give(self) -> None:
        """One slot of :meth:`take` is dead (its memory is reused once every slot is)."""
        self.live -= 1


class _Offloaded:
    """Handle autograd stores for an offloaded tensor: the host copy and, once fetched, the device copy."""

    __slots__ = (
        "host",
        "device",
        "group",
        "device_copy",
        "host_charge",
        "reload_charge",
        "pool",
        "slot",
        "__weakref__",
    )

    def __init__(
        self,
        host: torch.Tensor,
        device: torch.device,
        group: _Group,
        pool: ActivationOffloader,
        slot: HostPool | None = None,
    ):
        self.host = host
        self.device = device
        self.group = group
        self.device_copy: torch.Tensor | None = None
        meter = current_meter()
        self.host_charge: Charge | None = meter.charge("offloaded", host.nbytes) if meter is not None else None
        self.reload_charge: Charge | None = None
        self.pool = pool
        self.slot = slot  # the HostPool the host copy sits in, or None (allocated on its own)
        pool._host_add(host.nbytes, HostPool.slot_bytes(host.nbytes))

    def __del__(self) -> None:
        self.pool._host_add(-self.host.nbytes, -HostPool.slot_bytes(self.host.nbytes))
        if self.slot is not None:
            self.slot.give()


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

        pool_bytes: the host pool's size (the planner's pinned-host figure); default None: the
            first step's peak, allocated at the start of the second step.

    Attach with :meth:`attach` (or :func:`apply_offload`). Host pool figures:
    ``host_bytes`` (now) and ``peak_host_bytes``; ``pinned_bytes`` / ``peak_pinned_bytes``: the
    same buffers as torch's pinned caching allocator reserves them on CUDA when each is allocated
    on its own (each rounded up to a power of two, :func:`pinned_block_bytes`: the planner's
    figure, an upper bound of the pool's size); ``copies_to_host``/``copies_to_device`` count
    tensors copied since construction; ``pool`` (the :class:`HostPool`, None before it is
    allocated and after :meth:`release`), ``pool_allocations`` (pools allocated: 1 in a run),
    ``unpooled_copies`` (copies allocated on their own: the first step's, and any that did not fit).
    """

    def __init__(self, min_bytes: int = 2**20, prefetch: bool = True, pool_bytes: int | None = None):
        if min_bytes < 0:
            raise InputError(f"offload_min_bytes must be >= 0, got {min_bytes}")
        if pool_bytes is not None and pool_bytes < 0:
            raise InputError(f"the offload pool size must be >= 0 bytes, got {pool_bytes}")
        self.min_bytes = int(min_bytes)
        self.prefetch = prefetch
        self.pool_bytes = pool_bytes
        self.pool: HostPool | None = None
        self.pool_allocations = 0
        self.unpooled_copies = 0
        self._released = False
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self._slot_bytes = 0  # host_bytes in pool slots (rounded up)
        self._extent = self._peak_extent = 0  # see _host_add
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

    def _host_add(self, nbytes: int, slot_bytes: int) -> None:
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        # the pinned pool the same buffers take on CUDA (each rounded up to a power of two)
        self.pinned_bytes += pinned_block_bytes(abs(nbytes)) * (1 if nbytes >= 0 else -1)
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)
        if slot_bytes > 0:
            # a bump allocator's extent: the slots taken since nothing was alive (copies that die
            # during forward free no room before the step ends), the size a pool needs
            self._extent = slot_bytes if self._slot_bytes == 0 else self._extent + slot_bytes
            self._peak_extent = max(self._peak_extent, self._extent)
        self._slot_bytes += slot_bytes

    # -- the host pool --------------------------------------------------------------------------
    def _host_buffer(self, tensor: torch.Tensor) -> tuple[torch.Tensor, HostPool | None]:
        """A host tensor for ``tensor``'s copy: a pool slot, or (no pool yet, released, or full)
        a tensor of its own (pinned for a CUDA tensor)."""
        cuda = tensor.device.type == "cuda"
        if self.pool is None and not self._released:
            # the planner's size at the first copy; else the first step's peak, once that step is
            # over (nothing offloaded alive: this copy is the second step's first)
            size = (
                self.pool_bytes
                if self.pool_bytes is not None
                else (self._peak_extent if self._peak_extent > 0 and self._slot_bytes == 0 else None)
            )
            if size:
                self._allocate_pool(size, pin=cuda)
        if self.pool is not None:
            host = self.pool.take(tensor.shape, tensor.dtype)
            if host is not None:
                return host, self.pool
        self.unpooled_copies += 1
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda), None

    def _allocate_pool(self, nbytes: int, pin: bool) -> None:
        self.pool = HostPool(nbytes, pin)
        self.pool_allocations += 1
        if pin:
            # the first step's copies, pinned one by one, went back to torch's caching host
            # allocator, which keeps them: give them back, or the pool would come on top of them
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
        # once per run: pinning a large pool takes seconds (the kernel maps every page)
        log.info(
            "genolong: activation offload pool: %s of %s host memory in %.2f s",
            format_bytes(nbytes),
            "pinned" if pin else "plain",
            self.pool.seconds,
        )

    def release(self) -> None:
        """Give the host pool back (before the export, at the end of a run); copies still alive
        keep their memory until they die. Later copies are allocated one by one."""
        self.pool = None
        self._released = True

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
        if (
            tensor.device.type == "meta"
            or tensor.is_sparse
            or tensor.is_nested
            or isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)
            or tensor.numel() == 0
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or self._is_parameter(tensor, group)
        ):
            return track_saved(tensor)
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        handle = group.dedupe.get(key)
        if handle is not None:
            return handle
        host, slot = self._host_buffer(tensor)
        if tensor.device.type == "cuda":
            # a pool slot is rewritten only after backward consumed the step's copies: the compute
            # stream waited for their host-to-device copies, and this stream waits for it
            stream = self._stream(self._d2h, tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
        else:
            host.copy_(tensor)
        self.copies_to_host += 1
        group.device = tensor.device
        handle = _Offloaded(host, tensor.device, group, self, slot)
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


def apply_offload(
    model: nn.Module, min_bytes: int = 2**20, prefetch: bool = True, pool_bytes: int | None = None
) -> ActivationOffloader:
    """Attach an :class:`ActivationOffloader` to ``model.layers`` (see :func:`offloader_of`);
    ``pool_bytes``: its host pool's size (default None: the first step's peak).

    Raises:
        InputError: a model without ``layers`` or one that already has an offloader.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise InputError(f"apply_offload needs a model with layers (a GenoLM); got {type(model).__name__}")
    if model in _OFFLOADERS:
        raise InputError("activation offload is already applied to this model")
    offloader = ActivationOffloader(min_bytes, prefetch, pool_bytes).attach(list(layers))
    _OFFLOADERS[model] = offloader
    return offloader


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The offloader :func:`apply_offload` attached to ``model`` (None if none)."""
    return _OFFLOADERS.get(model)

"""Checkpoints written in the background (``checkpoint.async_save``): what makes them equal the
synchronous ones, and the one write in flight.

At the step boundary :func:`snapshot` copies every tensor of the checkpoint (model, optimiser
moments, loop state) to host memory: the only part of a save the next step waits for. A
:class:`BackgroundWriter` thread then writes that copy (the same atomic, checksummed write as a
synchronous save) while training goes on; the optimiser step that follows cannot change what is
written. At most one write is in flight: the next save, and the end of the run, wait for it, and an
error of the write (a full disk) is raised there, in the training thread.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["BackgroundWriter", "first_difference", "snapshot"]


def _copy_tensor(t: torch.Tensor, storages: dict[tuple[int, int, str], torch.UntypedStorage]) -> torch.Tensor:
    """A host copy of ``t`` with the same dtype, shape, strides and storage offset; tensors that
    shared a storage share the copy's (so ``torch.save`` writes the same bytes)."""
    if isinstance(t, DTensor):
        if t.device.type != "cpu":
            # from_local would move a host shard back to the mesh's device: DCP's own staging does this
            return t.detach().to("cpu")
        local = _copy_tensor(t.to_local(), storages)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    t = t.detach()
    storage = t.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), str(storage.device))
    copied = storages.get(key) if storage.nbytes() else None
    if copied is None:
        copied = storage.cpu().clone() if storage.device.type == "cpu" else storage.cpu()
        if storage.nbytes():
            storages[key] = copied
    out = torch.empty(0, dtype=t.dtype)
    return out.set_(copied, t.storage_offset(), t.size(), t.stride())


def snapshot(state: Any, _storages: dict[tuple[int, int, str], torch.UntypedStorage] | None = None) -> Any:
    """A copy of a (nested) checkpoint dict whose tensors live in host memory and share nothing with
    ``state``'s: dicts, lists and tuples copied, tensors (DTensors: their local shard) copied to the
    CPU, anything else deep-copied. Must run at the step boundary, before the optimiser moves on."""
    storages = {} if _storages is None else _storages
    if isinstance(state, torch.Tensor):
        return _copy_tensor(state, storages)
    if isinstance(state, dict):
        items = [(k, snapshot(v, storages)) for k, v in state.items()]
        try:
            return type(state)(items)  # dict, OrderedDict, Lightning's AttributeDict
        except TypeError:
            return dict(items)
    if isinstance(state, list):
        return [snapshot(v, storages) for v in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(snapshot(v, storages) for v in state)
    return copy.deepcopy(state)


class BackgroundWriter:
    """One background thread that runs writes in order, one at a time.

    :meth:`submit` first waits for the write in flight (raising its error); :meth:`then` queues
    work that runs only if the write before it succeeded (removing an older checkpoint once the new
    one is in place); :meth:`wait` blocks until everything queued is done and raises the first error.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genolong-checkpoint")
        self._last: Future[None] | None = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], None]) -> None:
        """Wait for the previous write (raising its error), then start ``work`` in the background."""
        self.wait()
        with self._lock:
            self._last = self._pool.submit(work)

    def then(self, work: Callable[[], None]) -> None:
        """Run ``work`` after the queued write, only if that succeeded (now, when none is queued)."""
        with self._lock:
            before = self._last
            if before is None:
                work()
                return

            def after() -> None:
                before.result()  # the write failed: its error, and ``work`` is not done
                work()

            self._last = self._pool.submit(after)

    def failed(self) -> BaseException | None:
        """The error of a finished write, without waiting (None while one runs, or when it succeeded)."""
        with self._lock:
            last = self._last
        return last.exception() if last is not None and last.done() else None

    def wait(self) -> None:
        """Block until the queued writes are done; raise the error of a failed one (once)."""
        with self._lock:
            last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self) -> None:
        """Wait for the queued writes (errors are left to :meth:`wait`) and stop the thread."""
        self._pool.shutdown(wait=True)


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where two (nested) checkpoint states differ, or None when they are the same: tensors bit for
    bit (dtype, shape, strides and every byte), dicts by keys, lists and tuples by items, anything
    else by ``==``. For checking that an asynchronous checkpoint is the synchronous one."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return where or "."
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            return where or "."
        same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        return None if same else (where or ".")
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where} (keys)"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{where}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{where} (length)"
        return next(
            (d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}[{i}]")) is not None),
            None,
        )
    return None if a == b else (where or ".")

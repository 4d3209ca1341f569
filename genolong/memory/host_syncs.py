"""Counting device-to-host synchronisations: the reads of device data that stall the host.

A training step on a GPU runs ahead of its kernels only while the host never waits for a result.
Each read of a device tensor's values by Python (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``, ``.numpy()``) and each op whose output size depends on the data (``nonzero``, boolean
indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``,
``bincount``) waits for every kernel queued before it. :class:`HostSyncCounter` counts them while
active: a ``TorchDispatchMode`` sees the ops (``aten._local_scalar_dense``, the data-dependent ones,
copies from a device to the host), and the three Python-level reads that issue no op on a CPU
tensor (``Tensor.tolist``, ``Tensor.cpu``, ``Tensor.numpy``) are wrapped while it is active.

Which tensors count: those on the counter's ``device`` type. On a GPU (``device="cuda"``) that is
exactly the syncs of the step (reads of host tensors are free). On CPU (``device="cpu"``, the
default; the test suite and CPU rehearsals) every read counts, host-side bookkeeping included: an
upper bound of what the same code syncs on a GPU, and the figure whose growth with T, tiles, recompute
segments and MoE chunks the tests bound (benchmarks/host_syncs.py prints it per layer).

Used by ``tests/parallel/test_host_syncs.py`` and ``benchmarks/host_syncs.py``.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter"]

_aten = torch.ops.aten

# op overload packets whose result size (or value) the host must read back: name in the counts
_SYNC_OPS: dict[Any, str] = {
    _aten._local_scalar_dense: "item",
    _aten.nonzero: "nonzero",
    _aten.masked_select: "masked_select",
    _aten._unique2: "unique",
    _aten.unique_dim: "unique",
    _aten.unique_consecutive: "unique",
    _aten.bincount: "bincount",
    _aten.equal: "equal",
}
_PACKAGE = str(Path(__file__).resolve().parents[1])  # genolong/ (sites are reported inside it)
_KERNELS = str(Path(__file__).resolve().parents[2] / "kernels")  # genolong.kernels' sources


def _tensors(args: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


class HostSyncCounter(TorchDispatchMode):
    """Counts device-to-host synchronisations while active (a context manager).

    Args:
        device: the device type whose tensors count (default ``"cpu"``: every tensor, an upper
            bound of the GPU count; ``"cuda"`` on a GPU: the real syncs).
        sites: also record where each sync comes from (the innermost frame in genolong's sources,
            ``path:line``); default False (a stack walk per sync).

    Attributes:
        counts: ``Counter`` by kind (``item``, ``tolist``, ``cpu``, ``numpy``, ``nonzero``,
            ``index_bool``, ``masked_select``, ``unique``, ``repeat_interleave``, ``bincount``,
            ``equal``, ``copy_to_host``).
        by_site: ``Counter`` of ``(kind, "path:line")`` when ``sites`` is on.

    Example::

        with HostSyncCounter() as syncs:
            loss = model.loss(tokens)[0]; loss.backward()
        syncs.total  # reads of device data during the step
    """

    def __init__(self, device: str | torch.device = "cpu", sites: bool = False):
        super().__init__()
        self.device_type = torch.device(device).type
        self.sites = sites
        self.counts: Counter[str] = Counter()
        self.by_site: Counter[tuple[str, str]] = Counter()
        self._saved: dict[str, Callable] = {}
        self._reading = 0  # inside a wrapped Python-level read: its own copy op is not a second sync

    @property
    def total(self) -> int:
        """All syncs counted so far."""
        return sum(self.counts.values())

    def reset(self) -> None:
        """Zero the counts."""
        self.counts.clear()
        self.by_site.clear()

    def _counts_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device_type

    def _record(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.sites:
            site = "?"
            for frame in reversed(traceback.extract_stack()[:-2]):
                if (
                    frame.filename.startswith(_PACKAGE) or frame.filename.startswith(_KERNELS)
                ) and not frame.filename.endswith("host_syncs.py"):
                    site = f"{Path(frame.filename).name}:{frame.lineno}"
                    break
            self.by_site[kind, site] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _SYNC_OPS.get(func.overloadpacket)
        tensors = _tensors(args)
        if (
            kind is None
            and func.overloadpacket is _aten.repeat_interleave
            and kwargs.get("output_size") is None
            and tensors
            and not (len(args) > 1 and isinstance(args[1], int))
        ):
            kind = "repeat_interleave"  # repeats as a tensor, no output_size: the host sums them
        if kind is None and func.overloadpacket in (_aten.index, _aten.index_put, _aten.index_put_):
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                kind = "index_bool"  # a boolean mask index: nonzero inside
        if kind is None and func.overloadpacket in (_aten._to_copy, _aten.copy_):
            src = (
                tensors[1]
                if func.overloadpacket is _aten.copy_ and len(tensors) > 1
                else (tensors[0] if tensors else None)
            )
            dst_device = kwargs.get("device") if func.overloadpacket is _aten._to_copy else tensors[0].device
            if (
                src is not None
                and dst_device is not None
                and torch.device(dst_device).type == "cpu"
                and src.device.type != "cpu"
                and self._counts_tensor(src)
            ):
                kind = "copy_to_host"
        if kind is not None and not self._reading and (not tensors or any(self._counts_tensor(t) for t in tensors)):
            self._record(kind)
        return func(*args, **kwargs)

    def _wrap(self, name: str) -> None:
        real = getattr(torch.Tensor, name)
        counter = self

        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._reading or not counter._counts_tensor(t):
                return real(t, *args, **kwargs)
            counter._record(name)
            counter._reading += 1
            try:
                return real(t, *args, **kwargs)
            finally:
                counter._reading -= 1

        self._saved[name] = real
        setattr(torch.Tensor, name, read)

    def __enter__(self) -> HostSyncCounter:
        for name in ("tolist", "cpu", "numpy"):
            self._wrap(name)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        self._saved.clear()

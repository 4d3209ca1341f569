"""genolong.memory: measured activation memory (:class:`ActivationMeter`), the live bytes of a
step (:class:`LiveBytes`) and its device-to-host syncs (:class:`HostSyncCounter`)."""

from __future__ import annotations

from .host_syncs import HostSyncCounter
from .meter import ActivationMeter, LayerMemory, LiveBytes, current_meter, peak_rss_bytes, tensor_bytes

__all__ = [
    "ActivationMeter",
    "HostSyncCounter",
    "LayerMemory",
    "LiveBytes",
    "current_meter",
    "peak_rss_bytes",
    "tensor_bytes",
]

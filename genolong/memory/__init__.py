"""genolong.memory: measured activation memory (:class:`ActivationMeter`)."""

from __future__ import annotations

from .meter import ActivationMeter, LayerMemory, current_meter, peak_rss_bytes, tensor_bytes

__all__ = ["ActivationMeter", "LayerMemory", "current_meter", "peak_rss_bytes", "tensor_bytes"]

"""genolong.memory: measured activation memory (:class:`ActivationMeter`) and the live bytes of a
step (:class:`LiveBytes`)."""

from __future__ import annotations

from .meter import ActivationMeter, LayerMemory, LiveBytes, current_meter, peak_rss_bytes, tensor_bytes

__all__ = ["ActivationMeter", "LayerMemory", "LiveBytes", "current_meter", "peak_rss_bytes", "tensor_bytes"]

"""genolong.model: the GLM-5.3-Flash architecture family (KDA + KPool-DSA + MoE + mHC).

Today: :class:`ModelConfig` (config.json round trip, presets, parameter counts). The modules,
``GenoLM`` and checkpoint I/O follow (issue 3).
"""

from __future__ import annotations

from .config import PRESETS, ModelConfig, ParameterCount, layer_types_from_pattern, parameter_count

__all__ = ["PRESETS", "ModelConfig", "ParameterCount", "layer_types_from_pattern", "parameter_count"]

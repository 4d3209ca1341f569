"""genolong.model: the GLM-5.3-Flash architecture family (KDA + KPool-DSA + MoE + mHC).

Today: :class:`ModelConfig` (config.json round trip, presets, parameter counts) and the blocks
checked against transformers: RMS norms and the clamped SwiGLU (``layers``), the chunked MoE
(``moe``) and the hyper-connection streams (``mhc``). The KDA/DSA mixers, ``GenoLM`` and
checkpoint I/O follow (issue 3).
"""

from __future__ import annotations

from .config import PRESETS, ModelConfig, ParameterCount, layer_types_from_pattern, parameter_count

__all__ = ["PRESETS", "ModelConfig", "ParameterCount", "layer_types_from_pattern", "parameter_count"]

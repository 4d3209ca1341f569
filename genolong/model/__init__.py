"""genolong.model: the GLM-5.3-Flash architecture family (KDA + KPool-DSA + MoE + mHC).

- :class:`ModelConfig` (config.json round trip, presets, parameter counts);
- blocks: RMS norms and the clamped SwiGLU (``layers``), the chunked MoE (``moe``), the
  hyper-connection streams (``mhc``), the KDA mixer (``kda``) and the DSA mixer (``dsa``);
- :class:`GenoLM`, the whole language model, equal to transformers' glm5_next text model.

- checkpoints in the GLM-5.3-Flash format (``hf``: :meth:`GenoLM.from_pretrained`,
  :meth:`GenoLM.save_pretrained`);
- :class:`Decoder`, the step-by-step inference path (``decode``).
"""

from __future__ import annotations

from .config import PRESETS, ModelConfig, ParameterCount, layer_types_from_pattern, parameter_count
from .decode import Decoder, DecodeState, decode_log_probs, sequence_log_probs
from .dsa import DSAMixer
from .kda import KDAMixer
from .lm import GenoLM

__all__ = ["PRESETS", "DSAMixer", "DecodeState", "Decoder", "GenoLM", "decode_log_probs", "sequence_log_probs", "KDAMixer", "ModelConfig", "ParameterCount", "layer_types_from_pattern", "parameter_count"]

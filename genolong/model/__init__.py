"""genolong.model: the GLM-5.3-Flash architecture family (KDA + KPool-DSA + MoE + mHC).

- :class:`ModelConfig` (config.json round trip, presets, parameter counts);
- blocks: RMS norms and the clamped SwiGLU (``layers``), the chunked MoE (``moe``), the
  hyper-connection streams (``mhc``), the KDA mixer (``kda``) and the DSA mixer (``dsa``);
- :class:`GenoLM`, the whole language model, equal to transformers' glm5_next text model.

- checkpoints in the GLM-5.3-Flash format (``hf``: :meth:`GenoLM.from_pretrained`,
  :meth:`GenoLM.save_pretrained`);
- :class:`Decoder`, the step-by-step inference path (``decode``), and the chunked prefill
  (``stream``); the KDA state both carry between calls is in ``cache``;
- low-rank adapters in the PEFT format (``lora``: :func:`apply_lora`, :func:`load_adapter`,
  :func:`save_adapter`, :func:`merge_lora`).

The names below load their module on first use (module ``__getattr__``): the torch-free parts
(``genolong.model.config``, ``genolong.model.vocab``) import without torch, which keeps
``genolong plan`` and the recipe loader from paying torch's import time.
"""

from __future__ import annotations

from ..lazy import lazy_exports

__all__ = [
    "PRESETS",
    "DSAMixer",
    "DecodeState",
    "Decoder",
    "GenoLM",
    "decode_log_probs",
    "sequence_log_probs",
    "KDAMixer",
    "ModelConfig",
    "ParameterCount",
    "layer_types_from_pattern",
    "parameter_count",
    "apply_lora",
    "load_adapter",
    "merge_lora",
    "save_adapter",
]

#: public name -> the submodule that defines it
_LAZY = {
    "PRESETS": "config",
    "ModelConfig": "config",
    "ParameterCount": "config",
    "layer_types_from_pattern": "config",
    "parameter_count": "config",
    "Decoder": "decode",
    "DecodeState": "decode",
    "decode_log_probs": "decode",
    "sequence_log_probs": "decode",
    "DSAMixer": "dsa",
    "KDAMixer": "kda",
    "GenoLM": "lm",
    "apply_lora": "lora",
    "load_adapter": "lora",
    "merge_lora": "lora",
    "save_adapter": "lora",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)  # see the module docstring

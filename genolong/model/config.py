"""ModelConfig: the GLM-5.3-Flash architecture family, read from and written to a transformers config.json.

The fields and their defaults are those of transformers' ``Glm5NextTextConfig`` (the released
GLM-5.3-Flash geometry), so a checkpoint's ``config.json`` maps onto a ``ModelConfig`` and back
without loss: keys genolong does not model are kept in :attr:`ModelConfig.extra`, and the
multimodal wrapper of ``Glm5NextForConditionalGeneration`` checkpoints (``text_config`` nested
beside ``vision_config``) in :attr:`ModelConfig.wrapper`.

Layer schedule: ``layer_types[i]`` is ``"linear_attention"`` (KDA) or ``"indexed_attention"``
(DSA: NoPE MLA with a lightning indexer); the pattern string writes them as ``K`` and ``D``
(GLM-5.3-Flash: ``"KKKD" * 11 + "K"``). ``mlp_layer_types[i]`` is ``"dense"`` or ``"sparse"``
(MoE); ``indexer_types[i]`` is ``"full"`` (the layer runs its indexer) or ``"shared"`` (it reuses
the top-k of the previous full DSA layer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.alphabet import PAD, VOCAB_SIZE
from ..errors import InputError
from ..files import replace_file
from ..kernels.backends import available_backends

__all__ = [
    "KEEP_FP32",
    "LINEAR_ATTENTION",
    "INDEXED_ATTENTION",
    "ModelConfig",
    "ParameterCount",
    "PRESETS",
    "layer_types_from_pattern",
    "parameter_count",
]

#: GenoLM parameters that stay fp32 in every run and compute in fp32 under bf16 mixed precision: the
#: tensors transformers keeps in fp32 (:data:`genolong.model.hf.FP32_TENSORS`, here in GenoLM's
#: names: the MoE router, the KDA short convolution, ``dt_bias``, ``A_log``, the mHC ``base`` and
#: ``scale``); the router's ``e_score_correction_bias`` is a buffer and never cast. Read by
#: :func:`genolong.train.module.low_precision_parameters` (never stored in bf16) and by
#: :func:`genolong.parallel.parallelize.apply_fsdp` (their modules are FSDP2 units of their own
#: with an fp32 policy); torch-free here so that the planner can count them too.
KEEP_FP32 = re.compile(r"(^|\.)(mlp\.gate\.weight|conv1d\.weight|dt_bias|A_log|(attn|ffn)_hc\.(base|scale))$")

LINEAR_ATTENTION = "linear_attention"
INDEXED_ATTENTION = "indexed_attention"
_PATTERN_CODES = {"K": LINEAR_ATTENTION, "D": INDEXED_ATTENTION}
_CODE_OF = {v: k for k, v in _PATTERN_CODES.items()}
SUPPORTED_MODEL_TYPES = ("glm5_next_text", "glm5_next")
#: ModelConfig fields that are not transformers config keys.
_GENOLONG_FIELDS = frozenset({"extra", "wrapper", "kernel_backend"})

# Keys that transformers adds to every config.json; they say nothing about the architecture and
# are regenerated on save (or derived: qk_head_dim, head_dim).
_GENERIC_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "model_type",
        "qk_head_dim",
        "head_dim",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
    }
)


def layer_types_from_pattern(pattern: str, num_layers: int | None = None) -> tuple[str, ...]:
    """Layer types from a pattern string of ``K`` (KDA) and ``D`` (DSA) characters.

    Args:
        pattern: e.g. ``"KKKD"``; repeated (and cut) to ``num_layers`` when that is given.
        num_layers: the number of layers; default ``len(pattern)``.

    Returns:
        ``num_layers`` entries, each ``"linear_attention"`` or ``"indexed_attention"``.

    Raises:
        InputError: for a character other than K or D, or an empty pattern.
    """
    pattern = pattern.strip().upper()
    bad = sorted(set(pattern) - set(_PATTERN_CODES))
    if not pattern or bad:
        raise InputError(f"layer pattern {pattern!r}: use only K (KDA) and D (DSA) characters, e.g. 'KKKD'")
    n = len(pattern) if num_layers is None else num_layers
    return tuple(_PATTERN_CODES[pattern[i % len(pattern)]] for i in range(n))


def _default_layer_types(num_layers: int) -> tuple[str, ...]:
    # GLM-5.3-Flash: every fourth layer (3, 7, ...) is DSA.
    return tuple(INDEXED_ATTENTION if i % 4 == 3 else LINEAR_ATTENTION for i in range(num_layers))


def _default_mlp_layer_types(num_layers: int) -> tuple[str, ...]:
    dense = min(3, num_layers)
    return ("dense",) * dense + ("sparse",) * (num_layers - dense)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GLM-5.3-Flash-family model (defaults: the released GLM-5.3-Flash).

    Field names and meanings are transformers' ``Glm5NextTextConfig``'s. Per-layer schedules
    (``layer_types``, ``mlp_layer_types``, ``indexer_types``) default as transformers derives them.
    Build from a checkpoint with :meth:`from_pretrained`, from a dict with :meth:`from_hf_dict`,
    or from a preset with :meth:`from_preset`.
    """

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    indexer_types: tuple[str, ...] | None = None
    #: config.json keys genolong does not model, written back unchanged by :meth:`to_hf_dict`.
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: top-level keys of a multimodal checkpoint config (everything but ``text_config``), or None.
    wrapper: Mapping[str, Any] | None = None
    #: genolong only (never written to config.json): the kernel backend the layers run
    #: (``genolong.kernels.backends``: "torch", "fla", "triton" or "auto").
    kernel_backend: str = "torch"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if n < 1:
            raise InputError(f"num_hidden_layers must be at least 1, got {n}")
        defaults = {
            "layer_types": _default_layer_types(n),
            "mlp_layer_types": _default_mlp_layer_types(n),
            "indexer_types": ("full",) * n,
        }
        for name, default in defaults.items():
            value = getattr(self, name)
            value = (
                default if value is None else tuple("indexed_attention" if v == "full_attention" else v for v in value)
            )
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        n = self.num_hidden_layers
        checks = {
            "layer_types": (LINEAR_ATTENTION, INDEXED_ATTENTION),
            "mlp_layer_types": ("dense", "sparse"),
            "indexer_types": ("full", "shared"),
        }
        for name, allowed in checks.items():
            values = getattr(self, name)
            if len(values) != n:
                raise InputError(f"{name} has {len(values)} entries but num_hidden_layers is {n}; give one per layer")
            bad = sorted(set(values) - set(allowed))
            if bad:
                raise InputError(f"{name} holds {bad}; allowed values are {list(allowed)}")
        if self.kernel_backend not in available_backends():
            raise InputError(
                f"kernel_backend {self.kernel_backend!r} is not available; choose one of {', '.join(available_backends())}"
            )
        if self.num_attention_heads != self.num_key_value_heads:
            raise InputError(
                f"num_attention_heads ({self.num_attention_heads}) must equal num_key_value_heads "
                f"({self.num_key_value_heads}) in the GLM-5.3-Flash MLA layers"
            )
        if self.qk_rope_head_dim != 0:
            raise InputError(
                f"qk_rope_head_dim must be 0 (GLM-5.3-Flash DSA layers are NoPE), got {self.qk_rope_head_dim}"
            )
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise InputError(
                f"index_topk ({self.index_topk}) must be a positive multiple of index_kpool ({self.index_kpool})"
            )
        if self.n_group < 1:
            # checked first: n_routed_experts % 0 below would end in a ZeroDivisionError
            raise InputError(f"n_group must be at least 1 (one expert group is no grouping), got {self.n_group}")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise InputError(
                f"n_routed_experts ({self.n_routed_experts}) must divide into n_group ({self.n_group}) groups "
                f"and topk_group ({self.topk_group}) may not exceed n_group"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise InputError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        # A shared DSA layer reuses the top-k that the layer right before it computed: transformers
        # hands indices only from a full DSA layer to the next layer (KDA layers pass none on).
        for i, (layer_type, indexer_type) in enumerate(zip(self.layer_types, self.indexer_types)):
            if (
                layer_type == INDEXED_ATTENTION
                and indexer_type == "shared"
                and (i == 0 or self.layer_types[i - 1] != INDEXED_ATTENTION or self.indexer_types[i - 1] != "full")
            ):
                raise InputError(
                    f"indexer_types[{i}] is 'shared' but layer {i - 1} is not a DSA layer with a full "
                    "indexer; a shared DSA layer must directly follow a full one"
                )

    # -- derived ---------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query/key head dimension of the MLA layers (nope + rope; rope is 0 here)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def pattern(self) -> str:
        """The layer schedule as a string of K (KDA) and D (DSA), e.g. ``"KKKD...K"``."""
        assert self.layer_types is not None
        return "".join(_CODE_OF[t] for t in self.layer_types)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied; per-layer schedules are re-derived when
        ``num_hidden_layers`` changes and they are not given."""
        if "num_hidden_layers" in changes:
            for name in ("layer_types", "mlp_layer_types", "indexer_types"):
                changes.setdefault(name, None)
        if "pattern" in changes:
            pattern = changes.pop("pattern")
            changes["layer_types"] = layer_types_from_pattern(
                pattern, changes.get("num_hidden_layers", self.num_hidden_layers)
            )
        return dataclasses.replace(self, **changes)

    # -- transformers config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read a transformers config dict (flat ``glm5_next_text`` or nested ``glm5_next``).

        Raises:
            InputError: for another architecture or impossible values.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            architectures = config.get("architectures")
            raise InputError(
                f"unsupported architecture: model_type {model_type!r} ({architectures}); genolong reads "
                f"GLM-5.3-Flash checkpoints (model_type {' or '.join(SUPPORTED_MODEL_TYPES)})"
            )
        wrapper = None
        text: dict[str, Any] = dict(config)
        if model_type == "glm5_next" and isinstance(config.get("text_config"), Mapping):
            wrapper = {k: v for k, v in config.items() if k != "text_config"}
            text = dict(config["text_config"])
        known = {f.name for f in dataclasses.fields(cls)} - _GENOLONG_FIELDS
        legacy = {
            k: text.pop(k)
            for k in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "linear_attn_config")
            if k in text
        }
        values = {k: v for k, v in text.items() if k in known}
        # transformers writes unset generic fields as null (architectures, dtype): absent == None
        extra = {k: v for k, v in text.items() if k not in known and k not in _GENERIC_KEYS and v is not None}
        if values.get("indexer_types") is None:
            values["indexer_types"] = _legacy_indexer_types(
                legacy, values.get("num_hidden_layers", cls.num_hidden_layers)
            )
        if isinstance(legacy.get("linear_attn_config"), Mapping):
            linear = legacy["linear_attn_config"]
            values["linear_head_dim"] = linear.get("head_dim", values.get("linear_head_dim", cls.linear_head_dim))
            values["linear_num_heads"] = linear.get("num_heads", values.get("linear_num_heads", cls.linear_num_heads))
            values["linear_conv_kernel_dim"] = linear.get(
                "short_conv_kernel_size", values.get("linear_conv_kernel_dim", cls.linear_conv_kernel_dim)
            )
            bound = linear.get("gate_lower_bound", values.get("linear_lower_bound", cls.linear_lower_bound))
            values["linear_lower_bound"] = -5.0 if bound is None and linear.get("safe_gate", True) else bound
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = values.get("num_attention_heads", cls.num_attention_heads)
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values, extra=extra, wrapper=wrapper)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict transformers reads (nested again if it came nested)."""
        text: dict[str, Any] = {"model_type": "glm5_next_text"}
        for f in dataclasses.fields(self):
            if f.name in _GENOLONG_FIELDS:
                continue
            value = getattr(self, f.name)
            text[f.name] = list(value) if isinstance(value, tuple) else value
        text.update(self.extra)
        if self.wrapper is None:
            return text
        return {**self.wrapper, "text_config": text}

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ModelConfig:
        """Read ``directory/config.json``.

        Raises:
            InputError: missing or unreadable config.json, or an unsupported architecture.
        """
        path = Path(directory) / "config.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise InputError(f"{path} does not exist; point to a checkpoint directory with a config.json") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path} is not valid JSON ({exc}); fix or replace the file") from None
        if not isinstance(data, dict):
            raise InputError(
                f"{path} is not a model config (a JSON {type(data).__name__}, not an object); fix or replace the file"
            )
        try:
            return cls.from_hf_dict(data)
        except (KeyError, TypeError, AttributeError) as exc:  # a damaged value of the right JSON syntax
            raise InputError(
                f"{path} is not a readable model config ({type(exc).__name__}: {exc}); fix or replace the file"
            ) from None

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``directory/config.json`` (creating the directory); returns its path."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "config.json"
        text = json.dumps(self.to_hf_dict(), indent=2) + "\n"
        replace_file(path, lambda tmp: tmp.write_text(text))
        return path

    # -- presets ---------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see :data:`PRESETS`), with field ``overrides``.

        Raises:
            InputError: for an unknown preset name (the message lists the presets).
        """
        try:
            base = PRESETS[name]
        except KeyError:
            raise InputError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return base.replace(**overrides) if overrides else base


def _legacy_indexer_types(legacy: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Indexer schedule from the older pattern / frequency keys, as transformers derives it."""
    pattern = legacy.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq = max(int(legacy.get("index_topk_freq", 1)), 1)
    offset = int(legacy.get("index_skip_topk_offset", 2))
    return tuple("full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers))


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a model built from a :class:`ModelConfig` (transformers' text model + LM head).

    Attributes:
        total: every parameter.
        active: parameters used per token (routed experts counted ``num_experts_per_tok`` times).
        embedding: the input embedding.
        lm_head: the output projection (0 when tied).
        routed_experts: all routed expert weights.
    """

    total: int
    active: int
    embedding: int
    lm_head: int
    routed_experts: int


def parameter_count(config: ModelConfig) -> ParameterCount:
    """Count parameters analytically, module by module, as transformers lays them out.

    Buffers (``e_score_correction_bias``) are not parameters. Shapes per layer: two RMSNorms, two
    hyper-connections (``fn [(2+m)m, mH]``, ``base [(2+m)m]``, ``scale [3]``), the mixer (KDA:
    q/k/v, depthwise conv over q|k|v, forget gate, beta, output gate, gated norm, output
    projection; DSA: NoPE MLA plus, on ``full`` layers, the indexer with its KPool parameters) and
    the FFN (dense SwiGLU, or MoE: stacked experts, router, shared expert).
    """
    c = config
    h = c.hidden_size
    m = c.hc_mult
    hc = 2 * ((2 + m) * m * m * h + (2 + m) * m + 3)
    total = active = routed = 0
    assert c.layer_types is not None and c.mlp_layer_types is not None and c.indexer_types is not None
    for layer_type, mlp_type, indexer_type in zip(c.layer_types, c.mlp_layer_types, c.indexer_types):
        mixer = 0
        if layer_type == LINEAR_ATTENTION:
            d, heads = c.linear_head_dim, c.linear_num_heads
            qkv = d * heads
            mixer += 3 * h * qkv  # q, k, v
            mixer += 3 * qkv * c.linear_conv_kernel_dim  # depthwise conv over q|k|v
            mixer += h * d + d * qkv + qkv + heads  # forget gate: f_a, f_b, dt_bias, A_log
            mixer += h * heads  # beta
            mixer += h * d + d * qkv  # output gate g_a, g_b
            mixer += d  # gated RMSNorm
            mixer += qkv * h  # o_proj
        else:
            bias = int(c.attention_bias)
            heads = c.num_attention_heads
            mixer += h * c.q_lora_rank + bias * c.q_lora_rank + c.q_lora_rank
            mixer += c.q_lora_rank * heads * c.qk_head_dim
            kv_a = c.kv_lora_rank + c.qk_rope_head_dim
            mixer += h * kv_a + bias * kv_a + c.kv_lora_rank
            mixer += c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
            mixer += heads * c.v_head_dim * h + bias * h
            if indexer_type == "full":
                di, hi = c.index_head_dim, c.index_n_heads
                mixer += c.q_lora_rank * hi * di + h * di + 2 * di + h * hi  # wq_b, wk, k_norm, weights
                mixer += c.index_kpool * di + di * h  # KPool position embedding and gate
        if mlp_type == "dense":
            ffn = ffn_active = 3 * h * c.intermediate_size
        else:
            experts = 3 * c.n_routed_experts * c.moe_intermediate_size * h
            shared = 3 * h * c.moe_intermediate_size * c.n_shared_experts
            router = c.n_routed_experts * h
            routed += experts
            ffn = experts + shared + router
            ffn_active = 3 * c.num_experts_per_tok * c.moe_intermediate_size * h + shared + router
        layer = 2 * h + hc + mixer
        total += layer + ffn
        active += layer + ffn_active
    embedding = c.vocab_size * h
    lm_head = 0 if c.tie_word_embeddings else c.vocab_size * h
    rest = embedding + lm_head + h  # final norm; the hyper head is a parameter-free mean
    return ParameterCount(
        total=total + rest, active=active + rest, embedding=embedding, lm_head=lm_head, routed_experts=routed
    )


def _nucleotide(**fields: Any) -> ModelConfig:
    """A GLM-5.3-Flash-architecture config with genolong's nucleotide vocabulary."""
    return ModelConfig(vocab_size=VOCAB_SIZE, pad_token_id=PAD, bos_token_id=None, eos_token_id=None, **fields)


#: Named configs: ``glm-5.3-flash`` is the released geometry (transformers' defaults); the others
#: keep every architectural feature (KDA + KPool-DSA, dense + MoE FFNs, 4 mHC streams) at
#: nucleotide vocabulary and sizes for tests (tiny), the CPU quickstart (small) and the GPU
#: benchmark (1b); tiny and small also have a shared-indexer DSA layer (layer 3, after layer 2).
PRESETS: dict[str, ModelConfig] = {
    "glm-5.3-flash": ModelConfig(),
    "tiny": _nucleotide(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        v_head_dim=32,
        qk_nope_head_dim=32,
        index_topk=64,
        index_head_dim=16,
        index_n_heads=2,
        index_kpool=8,
        linear_head_dim=16,
        linear_num_heads=4,
        max_position_embeddings=1 << 20,
        layer_types=layer_types_from_pattern("KKDDKKKD"),
        mlp_layer_types=("dense",) + ("sparse",) * 7,
        indexer_types=("full",) * 3 + ("shared",) + ("full",) * 4,
    ),
    "small": _nucleotide(
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=64,
        q_lora_rank=128,
        v_head_dim=64,
        qk_nope_head_dim=64,
        index_topk=512,
        index_head_dim=32,
        index_n_heads=4,
        index_kpool=16,
        linear_head_dim=32,
        linear_num_heads=8,
        max_position_embeddings=1 << 20,
        layer_types=layer_types_from_pattern("KKDDKKKD"),
        mlp_layer_types=("dense",) + ("sparse",) * 7,
        indexer_types=("full",) * 3 + ("shared",) + ("full",) * 4,
    ),
    "1b": _nucleotide(
        hidden_size=1536,
        intermediate_size=4096,
        moe_intermediate_size=512,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=12,
        n_routed_experts=32,
        num_experts_per_tok=4,
        kv_lora_rank=256,
        q_lora_rank=512,
        v_head_dim=128,
        qk_nope_head_dim=128,
        index_topk=2048,
        index_head_dim=64,
        index_n_heads=8,
        index_kpool=16,
        linear_head_dim=128,
        linear_num_heads=12,
        max_position_embeddings=1 << 20,
        layer_types=layer_types_from_pattern("KKKD", 16),
        mlp_layer_types=("dense",) * 2 + ("sparse",) * 14,
    ),
}

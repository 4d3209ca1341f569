"""Which parameters a recipe trains, which it freezes and which adapters it adds, torch-free.

:func:`parameter_shapes` and :func:`linear_shapes` rebuild a GenoLM's ``named_parameters()`` and
its ``nn.Linear`` modules from the :class:`~genolong.model.config.ModelConfig` alone (names,
shapes, in order); :func:`parameter_split` matches a recipe's ``model.freeze`` globs (over
parameter names) or its ``model.lora`` section (targets over module names, ``routed_experts``,
``modules_to_save``) against them, as ``genolong.train.module.freeze_parameters`` and
``genolong.model.lora.apply_lora`` do, and counts trained, frozen and adapter parameters, overall
and per FSDP2 unit (:meth:`ParameterSplit.unit`).

What holds it honest: ``tests/plan/test_plan_frozen.py`` compares the tables with a real GenoLM's
``named_parameters`` / ``named_modules`` on ``tiny``, ``small`` and a reduced ``glm-5.3-flash``
geometry, and the trained counts with the model after ``freeze_parameters``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..model.config import LINEAR_ATTENTION, ModelConfig

__all__ = [
    "ParameterSplit",
    "fp32_unit_parameters",
    "linear_shapes",
    "lora_adapter_shapes",
    "parameter_shapes",
    "parameter_split",
]


def _linear(out: dict[str, tuple[int, ...]], name: str, fan_in: int, fan_out: int, bias: bool = False) -> None:
    out[f"{name}.weight"] = (fan_out, fan_in)
    if bias:
        out[f"{name}.bias"] = (fan_out,)


def _model_tables(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, int]]]:
    """``(parameters, linears)``: parameter name -> shape, in ``named_parameters`` order, and
    ``nn.Linear`` module name -> ``(in_features, out_features)``, in ``named_modules`` order."""
    assert cfg.layer_types is not None and cfg.mlp_layer_types is not None and cfg.indexer_types is not None
    h, m = cfg.hidden_size, cfg.hc_mult
    params: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h)}
    linears: dict[str, tuple[int, int]] = {}

    def lin(name: str, fan_in: int, fan_out: int, bias: bool = False) -> None:
        _linear(params, name, fan_in, fan_out, bias)
        linears[name] = (fan_in, fan_out)

    for i, (kind, mlp, indexer) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types, cfg.indexer_types)):
        p = f"layers.{i}"
        a = f"{p}.self_attn"
        if kind == LINEAR_ATTENTION:
            d, heads = cfg.linear_head_dim, cfg.linear_num_heads
            qkv = d * heads
            for proj in ("q_proj", "k_proj", "v_proj"):
                lin(f"{a}.{proj}", h, qkv)
            params[f"{a}.conv1d.weight"] = (3 * qkv, 1, cfg.linear_conv_kernel_dim)
            params[f"{a}.forget_gate.dt_bias"] = (qkv,)
            params[f"{a}.forget_gate.A_log"] = (heads,)
            lin(f"{a}.forget_gate.f_a_proj", h, d)
            lin(f"{a}.forget_gate.f_b_proj", d, qkv)
            lin(f"{a}.b_proj", h, heads)
            lin(f"{a}.g_a_proj", h, d)
            lin(f"{a}.g_b_proj", d, qkv)
            params[f"{a}.o_norm.weight"] = (d,)
            lin(f"{a}.o_proj", qkv, h)
        else:
            bias = bool(cfg.attention_bias)
            heads = cfg.num_attention_heads
            lin(f"{a}.q_a_proj", h, cfg.q_lora_rank, bias)
            params[f"{a}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            lin(f"{a}.q_b_proj", cfg.q_lora_rank, heads * cfg.qk_head_dim)
            lin(f"{a}.kv_a_proj_with_mqa", h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias)
            params[f"{a}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
            lin(f"{a}.kv_b_proj", cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
            lin(f"{a}.o_proj", heads * cfg.v_head_dim, h, bias)
            if indexer == "full":
                di, hi = cfg.index_head_dim, cfg.index_n_heads
                x = f"{a}.indexer"
                params[f"{x}.index_kpool_compress_ape"] = (cfg.index_kpool, di)
                params[f"{x}.index_kpool_compress_gate"] = (di, h)
                lin(f"{x}.wq_b", cfg.q_lora_rank, hi * di)
                lin(f"{x}.wk", h, di)
                params[f"{x}.k_norm.weight"] = (di,)
                params[f"{x}.k_norm.bias"] = (di,)
                lin(f"{x}.weights_proj", h, hi)
        if mlp == "dense":
            for proj, fi, fo in (
                ("gate_proj", h, cfg.intermediate_size),
                ("up_proj", h, cfg.intermediate_size),
                ("down_proj", cfg.intermediate_size, h),
            ):
                lin(f"{p}.mlp.{proj}", fi, fo)
        else:
            E, inner = cfg.n_routed_experts, cfg.moe_intermediate_size
            params[f"{p}.mlp.experts.gate_up_proj"] = (E, 2 * inner, h)
            params[f"{p}.mlp.experts.down_proj"] = (E, h, inner)
            params[f"{p}.mlp.gate.weight"] = (E, h)  # the Router: a parameter, not an nn.Linear
            shared = inner * cfg.n_shared_experts
            for proj, fi, fo in (("gate_proj", h, shared), ("up_proj", h, shared), ("down_proj", shared, h)):
                lin(f"{p}.mlp.shared_experts.{proj}", fi, fo)
        params[f"{p}.input_layernorm.weight"] = (h,)
        params[f"{p}.post_attention_layernorm.weight"] = (h,)
        for hc in ("attn_hc", "ffn_hc"):
            params[f"{p}.{hc}.fn"] = ((2 + m) * m, m * h)
            params[f"{p}.{hc}.base"] = ((2 + m) * m,)
            params[f"{p}.{hc}.scale"] = (3,)
    params["norm.weight"] = (h,)
    linears["lm_head"] = (h, cfg.vocab_size)
    if not cfg.tie_word_embeddings:  # a tied head shares the embedding's storage: named once
        params["lm_head.weight"] = (cfg.vocab_size, h)
    return params, linears


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A GenoLM's parameters by name, in ``named_parameters()`` order, with their shapes.

    Args:
        config: the architecture.

    Returns:
        ``{name: shape}``, e.g. ``"layers.1.mlp.experts.gate_up_proj": (E, 2I, H)``; the shapes'
        products sum to :func:`~genolong.model.config.parameter_count` ``.total``.
    """
    return _model_tables(config)[0]


def fp32_unit_parameters(config: ModelConfig) -> dict[int, int]:
    """Parameters per layer of the modules that hold a :data:`~genolong.model.config.KEEP_FP32`
    parameter (the router, the KDA ``conv1d`` and ``forget_gate``, the mHC ``attn_hc`` and
    ``ffn_hc``, each with all of its parameters): in a bf16-mixed FSDP2 run they are fp32 units
    of their own (:func:`genolong.parallel.parallelize.fp32_modules`), gathered at 4 B per
    parameter instead of 2. ``{layer: parameters}``; layers without any are left out."""
    import math
    import re

    from ..model.config import KEEP_FP32

    shapes = parameter_shapes(config)
    owners = {name.rsplit(".", 1)[0] + "." for name in shapes if KEEP_FP32.search(name)}
    out: dict[int, int] = {}
    for name, shape in shapes.items():
        match = re.match(r"layers\.(\d+)\.", name)
        if match and any(name.startswith(owner) for owner in owners):
            layer = int(match.group(1))
            out[layer] = out.get(layer, 0) + math.prod(shape)
    return out


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """A GenoLM's ``nn.Linear`` modules by name, in ``named_modules()`` order.

    Args:
        config: the architecture.

    Returns:
        ``{module name: (in_features, out_features)}`` (the LM head included; the MoE router and
        the fused routed experts are not ``nn.Linear``).
    """
    return _model_tables(config)[1]


def lora_adapter_shapes(config: ModelConfig, lora: Any) -> dict[str, tuple[int, ...]]:
    """The adapter parameters ``model.lora`` adds, by the name they take under the base module.

    Every ``nn.Linear`` whose module name matches a glob of ``lora.targets`` gets ``lora_A [r, in]``
    and ``lora_B [out, r]``; with ``lora.routed_experts`` every MoE layer's fused experts get per
    expert ``lora_A_gate_up [E, r, H]``, ``lora_B_gate_up [E, 2I, r]``, ``lora_A_down [E, r, I]``,
    ``lora_B_down [E, H, r]``: ``r (in + out)`` per adapted matrix.

    Args:
        config: the architecture.
        lora: a :class:`~genolong.config.schema.LoraSection` (``rank``, ``targets``,
            ``routed_experts``).

    Returns:
        ``{name: shape}`` (e.g. ``"layers.0.self_attn.q_proj.lora_A.weight": (r, in)``).

    Raises:
        InputError: a target glob that matches no linear layer.
    """
    linears = linear_shapes(config)
    r = int(lora.rank)
    for pattern in lora.targets:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
            raise InputError(
                f"model.lora.targets: {pattern!r} matches no linear layer (names look like "
                f"{next(iter(linears))!r}); fix the glob"
            )
    out: dict[str, tuple[int, ...]] = {}
    for name, (fan_in, fan_out) in linears.items():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in lora.targets):
            out[f"{name}.lora_A.weight"] = (r, fan_in)
            out[f"{name}.lora_B.weight"] = (fan_out, r)
    if lora.routed_experts:
        assert config.mlp_layer_types is not None
        E, inner, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        for i, kind in enumerate(config.mlp_layer_types):
            if kind == "sparse":
                e = f"layers.{i}.mlp.experts"
                out[f"{e}.lora_A_gate_up"] = (E, r, h)
                out[f"{e}.lora_B_gate_up"] = (E, 2 * inner, r)
                out[f"{e}.lora_A_down"] = (E, r, inner)
                out[f"{e}.lora_B_down"] = (E, h, r)
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _unit_of(name: str) -> tuple[str, int | None]:
    """The FSDP2 unit a parameter belongs to (:func:`~genolong.plan.fsdp_unit_groups`' kinds)."""
    if name.startswith("embed_tokens."):
        return "embedding", None
    if name.startswith("layers."):
        layer = int(name.split(".", 2)[1])
        return ("experts" if ".mlp.experts." in name else "block"), layer
    return "root", None


@dataclass(frozen=True)
class ParameterSplit:
    """Trained, frozen and adapter parameters of a recipe's model (see :func:`parameter_split`).

    Attributes:
        total: every parameter the run holds (base + adapters).
        trained: parameters with a gradient (unfrozen base parameters, adapters, modules_to_save).
        frozen: base parameters without one (stored at the compute dtype, no master, no optimizer state).
        adapters: LoRA adapter parameters (part of ``trained``); 0 without ``model.lora``.
        lora: the run uses LoRA.
        units: per FSDP2 unit key (``("embedding", None)``, ``("block", i)``, ``("experts", i)``
            for layer ``i``'s routed experts, ``("root", None)``) the ``(total, trained)`` counts.
        trained_names: the trained parameters' names (adapters under their base module's name).
        adapted: the LoRA-adapted linear modules as ``(module name, in_features, rank)``, the
            routed experts as ``(layers.i.mlp.experts, -1, rank)``.
        lora_dropout: the adapters' input dropout (0: none, no mask saved).
    """

    total: int
    trained: int
    frozen: int
    adapters: int
    lora: bool
    units: dict[tuple[str, int | None], tuple[int, int]] = field(default_factory=dict)
    trained_names: tuple[str, ...] = ()
    adapted: tuple[tuple[str, int, int], ...] = ()
    lora_dropout: float = 0.0

    @property
    def any_frozen(self) -> bool:
        """Whether anything is frozen (or adapted): the plan then counts the split."""
        return self.frozen > 0 or self.lora

    def unit(self, kind: str, layer: int | None, ep: int = 1) -> tuple[int, int]:
        """``(total, trained)`` parameters of one FSDP2 unit as a rank gathers it.

        Args:
            kind: ``embedding``, ``block``, ``experts`` or ``root``.
            layer: the block's layer (None for embedding and root).
            ep: expert-parallel size: with ``ep > 1`` a ``block`` excludes its routed experts and
                an ``experts`` unit holds ``E / ep`` of them; with ``ep = 1`` a ``block`` includes them.

        Returns:
            ``(total, trained)`` parameters.
        """
        total, trained = self.units.get((kind, layer), (0, 0))
        if kind == "experts":
            return total // ep, trained // ep
        if kind == "block" and ep == 1:
            et, etr = self.units.get(("experts", layer), (0, 0))
            return total + et, trained + etr
        return total, trained


def parameter_split(config: ModelConfig, freeze: Sequence[str] = (), lora: Any = None) -> ParameterSplit:
    """Trained vs frozen parameters (and LoRA adapters) of a run of ``config``.

    ``freeze``: ``fnmatch`` globs over parameter names (``model.freeze``; every name they match is
    frozen). ``lora`` (``model.lora``): every base parameter is frozen, the adapters
    (:func:`lora_adapter_shapes`) and the parameters of modules matched by ``modules_to_save``
    train.

    Args:
        config: the architecture.
        freeze: parameter-name globs (default none).
        lora: a :class:`~genolong.config.schema.LoraSection` or None (default).

    Returns:
        A :class:`ParameterSplit`.

    Raises:
        InputError: a freeze glob that matches no parameter, a LoRA target that matches no linear
            layer, a ``modules_to_save`` glob that matches no module with parameters.
    """
    shapes = parameter_shapes(config)
    names = list(shapes)
    trained_flags: dict[str, bool] = {}
    adapter_shapes: dict[str, tuple[int, ...]] = {}
    if lora is not None:
        adapter_shapes = lora_adapter_shapes(config, lora)
        modules = {n.rsplit(".", 1)[0] for n in names}
        saved = tuple(lora.modules_to_save)
        for pattern in saved:
            if not any(fnmatch.fnmatchcase(mod, pattern) for mod in modules):
                raise InputError(
                    f"model.lora.modules_to_save: {pattern!r} matches no module with parameters "
                    f"(names look like {'layers.0.input_layernorm'!r}); fix the glob"
                )

        def kept(name: str) -> bool:
            # a parameter trains in full when a module above it (its own or an ancestor) is matched
            parts = name.split(".")
            return any(fnmatch.fnmatchcase(".".join(parts[:k]), p) for k in range(1, len(parts)) for p in saved)

        trained_flags = {n: kept(n) for n in names}
    else:
        for pattern in freeze:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise InputError(
                    f"model.freeze: {pattern!r} matches no parameter (names look like {names[1]!r}); fix the glob"
                )
        trained_flags = {n: not any(fnmatch.fnmatchcase(n, p) for p in freeze) for n in names}
    units: dict[tuple[str, int | None], list[int]] = {}
    total = trained = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        u = units.setdefault(_unit_of(name), [0, 0])
        u[0] += n
        total += n
        if trained_flags[name]:
            u[1] += n
            trained += n
    adapters = 0
    for name, shape in adapter_shapes.items():
        n = _numel(shape)
        u = units.setdefault(_unit_of(name), [0, 0])
        u[0] += n
        u[1] += n
        adapters += n
    return ParameterSplit(
        total=total + adapters,
        trained=trained + adapters,
        frozen=total - trained,
        adapters=adapters,
        lora=lora is not None,
        units={k: (v[0], v[1]) for k, v in units.items()},
        trained_names=tuple(n for n, t in trained_flags.items() if t) + tuple(adapter_shapes),
        adapted=tuple(
            (n.rsplit(".", 2)[0], adapter_shapes[n][1], adapter_shapes[n][0])
            for n in adapter_shapes
            if n.endswith(".lora_A.weight")
        )
        + tuple(
            (n.rsplit(".", 1)[0], -1, adapter_shapes[n][1]) for n in adapter_shapes if n.endswith(".lora_A_gate_up")
        ),
        lora_dropout=float(lora.dropout) if lora is not None else 0.0,
    )

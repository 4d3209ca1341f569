"""Saved activations of one training step on one rank, storage by storage, per layer type.

An inventory of what autograd keeps for backward in genolong's own layers (the torch kernels in
``genolong.kernels``), written from the code of each layer: :func:`layer_saved_tensors` (the KDA
and DSA mixers, the dense and MoE feed-forwards, the hyper-connections and norms, under
``none``, ``selective`` and ``full`` recompute), ``memory.recompute: chunked``'s terms
(:func:`chunked_recompute_terms`: one place for its formulas), what stays on the device and what
goes to the host under offload (:func:`activation_estimate`), and the DSA indexer / top-k /
gather buffers a DSA layer holds besides (:func:`dsa_buffer_bytes`). The kernel backend
(:mod:`genolong.plan.backends`) decides which save sets count: fla-core's ``chunk_kda``, read
from fla's source (see :func:`_kda`), and genolong's Triton DSA kernels.

What holds it honest: ``tests/plan/test_plan_activations.py`` holds the formulas to within 10% of
:class:`~genolong.memory.meter.ActivationMeter` on the ``tiny`` and ``small`` presets over lengths,
recompute modes, offload and CP (the Triton DSA kernels metered under ``TRITON_INTERPRET=1``,
EP 2 per layer and rank at its measured expert load on gloo), the growth of chunked recompute's
rebuilt region with ``recompute_chunk_tokens`` to the measured backward peak
(:class:`~genolong.memory.LiveBytes`) within 10%, and the fla save set to the installed fla-core's
``save_for_backward``.

Over 800 lines: one inventory per layer kind and the estimate that sums them, kept in one module
so that each save set sits beside the others it is tested with (the pinned host pool's rounding,
:func:`_pinned_pieces`, included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import KDA_CHUNK
from ..errors import InputError
from ..model.config import INDEXED_ATTENTION, LINEAR_ATTENTION, ModelConfig
from ..parallel.recompute import DEFAULT_SELECTIVE, MODULE_KINDS, RECOMPUTE_MODES
from .backends import DSA_KERNELS, KDA_KERNELS
from .constants import _F32, _I64, DSA_QUERY_BLOCK, INDEXER_TILE, KDA_SUB_BLOCK

__all__ = [
    "PLAN_RECOMPUTE_MODES",
    "ActivationEstimate",
    "ChunkedTerms",
    "SavedTensor",
    "TrainedParts",
    "activation_estimate",
    "chunked_recompute_terms",
    "dsa_buffer_bytes",
    "layer_saved_tensors",
    "outside_saved_tensors",
]

_KIND_ALIASES = {"attn": ("kda", "dsa"), "ffn": ("moe", "mlp")}


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd keeps for backward (counted once, as the meter counts storages).

    Attributes:
        kind: the part of the layer it belongs to: ``kda``, ``dsa``, ``indexer_kl``, ``moe``,
            ``mlp``, ``mhc`` (hyper-connections and stream merges), ``norm``, ``block_input``
            (full recompute) or ``outside`` (embedding, final norm, loss).
        name: what it is (for the breakdown).
        bytes_per_token: bytes per token of the rank's sequence slice.
        views: how many storage-sized host copies the offloader makes of it (it copies each
            distinct view autograd saves: e.g. the mHC streams are saved as a flat, a 4-D and a
            batched-matmul view, three copies).
        piece_tokens: the tensor is saved in pieces of this many tokens (per KDA chunk, per
            expert, per query block); the offload threshold applies to a piece. None: whole.
        const_bytes: bytes that do not grow with the tokens.
        weight_only: of ``bytes_per_token``, the bytes autograd keeps only for the gradient of
            the part's own weights (a linear's input, a norm's normalised value, an embedding's
            ids): not saved when those weights are frozen (see :func:`_frozen`).
    """

    kind: str
    name: str
    bytes_per_token: float
    views: float = 1.0
    piece_tokens: float | None = None
    const_bytes: float = 0.0
    weight_only: float = 0.0

    def nbytes(self, tokens: int) -> float:
        """Device bytes of the storage for ``tokens`` tokens."""
        return self.bytes_per_token * tokens + self.const_bytes

    def piece_bytes(self, tokens: int) -> float:
        """Bytes of one saved piece (what the offload threshold compares)."""
        if self.piece_tokens is None:
            return self.nbytes(tokens)
        return self.bytes_per_token * min(self.piece_tokens, tokens)


#: Recompute modes the planner counts: :data:`genolong.parallel.recompute.RECOMPUTE_MODES` and
#: ``chunked`` (``memory.recompute: chunked``; see :func:`chunked_recompute_terms`).
PLAN_RECOMPUTE_MODES: tuple[str, ...] = tuple(dict.fromkeys((*RECOMPUTE_MODES, "chunked")))
#: Modes that keep only each block's input (and, for chunked, small carried extras) in forward.
_BLOCK_RECOMPUTE = ("full", "chunked")


def _resolve_kinds(recompute: str, modules: Sequence[str]) -> frozenset[str]:
    if recompute not in PLAN_RECOMPUTE_MODES:
        raise InputError(f"recompute {recompute!r} is unknown; choose one of {', '.join(PLAN_RECOMPUTE_MODES)}")
    if isinstance(modules, str):
        modules = (modules,)
    for kind in modules:
        if kind not in MODULE_KINDS:
            raise InputError(f"recompute module kind {kind!r} is unknown; choose from {', '.join(MODULE_KINDS)}")
    if recompute != "selective":
        return frozenset()
    kinds: set[str] = set()
    for kind in tuple(modules) or DEFAULT_SELECTIVE:
        kinds.update(_KIND_ALIASES.get(kind, (kind,)))
    return frozenset(kinds)


#: The parts of a block in forward order, by their module names under ``layers.i``.
BLOCK_PARTS: tuple[str, ...] = ("attn_hc", "input_layernorm", "self_attn", "ffn_hc", "post_attention_layernorm", "mlp")


@dataclass(frozen=True)
class TrainedParts:
    """Which parts of the model have trained parameters (see :meth:`from_names`); the saved
    activations follow: autograd keeps a linear's (norm's, embedding's) weight-gradient input only
    when that weight trains, and a part whose input needs no gradient and whose parameters are
    all frozen keeps nothing.

    Attributes:
        embedding: ``embed_tokens`` trains.
        layers: per layer, the trained parts among :data:`BLOCK_PARTS`.
        norm: the final norm trains.
        lm_head: the LM head trains.
        adapters: per layer and part, the LoRA-adapted linears as ``(in_features, rank)``
            (``in_features`` -1: the routed experts' batched adapters).
        lora_dropout: the adapters' input dropout.
    """

    embedding: bool
    layers: tuple[frozenset[str], ...]
    norm: bool
    lm_head: bool
    adapters: tuple[dict[str, tuple[tuple[int, int], ...]], ...] = ()
    lora_dropout: float = 0.0

    @classmethod
    def from_names(
        cls,
        config: ModelConfig,
        trained_names: Sequence[str],
        adapted: Sequence[tuple[str, int, int]] = (),
        lora_dropout: float = 0.0,
    ) -> TrainedParts:
        """From the trained parameters' names (``ParameterSplit.trained_names``; LoRA adapters under
        their base module's name) and the adapted linears (``ParameterSplit.adapted``).

        Args:
            config: the architecture.
            trained_names: GenoLM parameter names with a gradient.
            adapted: ``(module name, in_features, rank)`` of each LoRA-adapted linear (default none).
            lora_dropout: the adapters' dropout (default 0).
        """
        adapters: list[dict[str, list[tuple[int, int]]]] = [{} for _ in range(config.num_hidden_layers)]
        for module, fan_in, rank in adapted:
            if module.startswith("layers."):
                _, i, part = module.split(".", 3)[:3]
                adapters[int(i)].setdefault(part, []).append((fan_in, rank))
        layers: list[set[str]] = [set() for _ in range(config.num_hidden_layers)]
        for name in trained_names:
            if name.startswith("layers."):
                _, i, part = name.split(".", 3)[:3]
                layers[int(i)].add(part)
        return cls(
            embedding=any(n.startswith("embed_tokens.") for n in trained_names),
            layers=tuple(frozenset(x) for x in layers),
            norm=any(n.startswith("norm.") for n in trained_names),
            lm_head=any(n.startswith("lm_head.") for n in trained_names),
            adapters=tuple({k: tuple(v) for k, v in x.items()} for x in adapters),
            lora_dropout=lora_dropout,
        )

    def adapter_items(self, config: ModelConfig, layer: int, part: str, a: int, kind: str) -> list[SavedTensor]:
        """What the LoRA adapters of ``part`` keep besides the base part's saved set: per adapter the
        rank-``r`` intermediate ``lora_A(x)`` (``lora_B``'s weight-gradient input); with dropout the
        dropped input and its mask (``in x (a + 1)``). The input ``x`` itself is the base linear's
        input, which the part (trained: it holds adapters) already counts. Routed experts: per
        (token, slot) ``2 r`` (gate_up's and down's intermediates)."""
        if not self.adapters:
            return []
        total = 0.0
        for fan_in, rank in self.adapters[layer].get(part, ()):
            if fan_in < 0:
                total += config.num_experts_per_tok * 2 * rank * a
                continue
            total += rank * a + (fan_in * (a + 1) if self.lora_dropout > 0 else 0)
        return [SavedTensor(kind, "LoRA adapters: rank-r intermediates (+ dropout)", total)] if total else []

    def flags(self, layer: int) -> dict[str, tuple[bool, bool]]:
        """Per part of block ``layer``: ``(trained, input needs a gradient)``."""
        grad = self.embedding or any(self.layers[:layer])
        out: dict[str, tuple[bool, bool]] = {}
        for part in BLOCK_PARTS:
            trained = part in self.layers[layer]
            out[part] = (trained, grad)
            grad = grad or trained
        return out

    def any_below(self, layer: int) -> bool:
        """Whether anything up to and including block ``layer`` trains (its output needs a gradient)."""
        return self.embedding or any(self.layers[: layer + 1])


def _frozen_items(items: list[SavedTensor], flags: tuple[bool, bool]) -> list[SavedTensor]:
    """``items`` of one part whose ``(trained, input needs a gradient)`` are ``flags``: all of
    them when it trains; without the weight-gradient inputs when only its input needs a gradient;
    nothing when neither (autograd records no node)."""
    trained, grad_in = flags
    if trained:
        return items
    if not grad_in:
        return []
    out = []
    for t in items:
        if t.bytes_per_token - t.weight_only > 0 or t.const_bytes:
            out.append(dataclasses.replace(t, bytes_per_token=t.bytes_per_token - t.weight_only, weight_only=0.0))
    return out


def _norm(kind: str, name: str, width: int, a: int) -> list[SavedTensor]:
    """RMSNorm over ``width``: the fp32 input (``x.float()``: the input itself in fp32, a copy
    otherwise), the ``[T, 1]`` rsqrt and the normalised value cast back to the compute dtype."""
    return [
        SavedTensor(kind, f"{name} input (fp32)", width * _F32),
        SavedTensor(kind, f"{name} rsqrt", _F32),
        SavedTensor(kind, f"{name} normalised", width * a, weight_only=width * a),  # read by the weight's gradient
    ]


def _kda_intra_floats(K: int, C: int, c: int) -> float:
    """fp32 numbers per token per head the torch chunked KDA keeps inside ``_intra_chunk``.

    Sub-blocks of ``c`` tokens: decay factors (row, col: 2K), the stacked k|q (2K) and their
    product (2K), the decayed keys (K), the beta-weighted lower triangle (``c``); the block
    inverse inside a sub-block keeps, at level h = 1: the ones (1); at h = 2, 4, ..: the
    off-diagonal quadrant, the inverse so far and a product (2h; 3.5h at the last level, h = c/2). Levels ``h = c ..
    C/2`` across sub-blocks keep decays (K/2 + K/2), stacked k|q and product (2K), decayed keys
    (K/2), the off-diagonal block (h), its beta-weighted half (h/2), the inverse (h) and a
    product (h/2): ``3.5K + 3h``.
    """
    floats = 7.0 * K + c + 1.0
    h = 2
    while h < c:
        # the last sub-block level also keeps the inverse of the level below in a 2h-wide
        # buffer and a full-size quadrant copy: 3.5h instead of 2h
        floats += 3.5 * h if 2 * h == c else 2.0 * h
        h *= 2
    h = c
    while h < C:
        floats += 3.5 * K + 3.0 * h
        h *= 2
    return floats


def _kda(cfg: ModelConfig, a: int, recomputed: bool, kernel: str = "torch", cp_path: bool = False) -> list[SavedTensor]:
    """The KDA mixer (``genolong.model.kda.KDAMixer`` with ``genolong.kernels.kda.chunk_kda``).

    Recomputed: only its input ``x [T, H]``. Otherwise (per token; ``q = heads * d``):
    the input (H, shared by the six projections); the short conv's padded input (3q fp32, saved
    as 4 shifted slices: 4 offload copies), its pre-activation (3q fp32) and q|k|v after SiLU in
    fp32 (3q); the L2 norms' roots (2 x heads) and the normalised keys (q fp32, saved through 3
    views); the gate's low-rank input (d), raw logits and sigmoid (2q fp32); beta (heads fp32);
    the chunk kernel's in-chunk matrices (:func:`_kda_intra_floats` per head), then per head the
    decays (computed twice) and their products with q, k, beta, two views of the decayed keys
    (10K), beta*v and u (2V), the two
    ``[C, C]`` chunk matrices (2C) and per chunk the transition ``[K, K]``, two states ``[K, V]``
    and the final decay (``(K^2 + 2KV + K) / C``); the output (q fp32), its norm's rsqrt
    (heads), normalised value before and after the weight (2q fp32), gate sigmoid (q fp32), the
    gated product in the compute dtype (q) and the gate's low-rank input (d).

    ``kernel="fla"``: fla-core 0.6's ``ChunkKDAFunction`` (``fla/ops/kda/chunk.py:121-145``,
    ``save_for_backward``) keeps q, k, v, the chunk-local cumulative log decay ``g_cumsum``, the
    input gate ``g``, ``beta`` (raw and activated), ``Aqk`` and ``Akk`` and the initial state;
    ``chunk_kda_fwd`` drops w, u, qg, kg, v_new and h before returning
    (``fla/ops/kda/chunk_fwd.py:135-141``: ``disable_recompute=False``, backward recomputes them)
    and, with the gate in the kernel, ``g_cumsum`` too; ``Aqk``, ``Akk`` are ``[B, T, H, C]`` in
    k's dtype (``fla/ops/kda/chunk_intra.py:863-865``), float32 here (the layer passes fp32 q, k,
    v). The layer's own normalised-k views (the torch kernel's) are fla's saved k. Two paths:

    - ``cp_path=False`` (one process: ``chunk_kda_gated``, gate and beta in the kernel,
      ``kernels/kda/fla_backend.py::make_fla_chunk_kda_gated``): no torch gate or beta tensors;
      fla keeps q, k (2K), v (V), the raw gate as an fp32 copy (K), beta logits and sigmoid (2),
      ``Aqk``, ``Akk`` (2C) per head, fp32.
    - ``cp_path=True`` (context parallelism: ``kernels/kda/cp.py::cp_chunk_kda`` over ``chunk_kda``,
      gate and beta from torch): the torch gate and beta stay; ``cp_chunk_kda`` widens the values
      to ``[v | 0]`` (V + K columns) so fla keeps q, k, the widened v, ``g_cumsum`` and ``g``
      (2K + (V + K) + 2K) and ``Aqk``, ``Akk`` (2C), and the fold's einsum keeps the widened
      output ``[o0 | P]`` (V + K) per head, fp32 (beta is the torch sigmoid's storage). (The torch
      kernel's inventory is the one-process one: the meter tests run a CP slice on one process.)
    """
    H = cfg.hidden_size
    if recomputed:
        return [SavedTensor("kda", "mixer input (recomputed)", H * a)]
    d, heads = cfg.linear_head_dim, cfg.linear_num_heads
    q = d * heads
    K = V = d
    C = KDA_CHUNK
    mixer = [
        SavedTensor("kda", "mixer input", H * a, weight_only=H * a),  # the projections' weight gradients
        SavedTensor("kda", "conv padded input", 3 * q * _F32, views=4.0),
        SavedTensor("kda", "conv pre-activation", 3 * q * _F32),
        SavedTensor("kda", "q|k|v", 3 * q * _F32),
        SavedTensor("kda", "l2 norm roots", 2 * heads * _F32),
    ]
    if kernel != "fla":
        mixer.append(SavedTensor("kda", "normalised k", q * _F32, views=3.0))
    mixer.append(SavedTensor("kda", "gate low-rank", d * a, weight_only=d * a))  # f_b_proj's input
    if kernel != "fla" or cp_path:
        mixer += [
            SavedTensor("kda", "gate logits + sigmoid", 2 * q * _F32),
            SavedTensor("kda", "beta", heads * _F32, views=4.0 if kernel != "fla" else 1.0),
        ]
    if kernel == "fla":
        if cp_path:
            chunk = [
                SavedTensor(
                    "kda",
                    "fla chunk_kda under CP: q, k, [v | 0], g_cumsum, g, Aqk, Akk; [o0 | P]",
                    heads * (5 * K + V + 2 * C + (V + K)) * _F32,
                )
            ]
        else:
            chunk = [
                SavedTensor(
                    "kda",
                    "fla chunk_kda (gate in kernel): q, k, v, g raw, beta raw + sigmoid, Aqk, Akk",
                    heads * (3 * K + V + 2 * C + 2) * _F32,
                )
            ]
    else:
        intra = _kda_intra_floats(K, C, KDA_SUB_BLOCK)
        chunk = [
            # the decay factors of the sub-blocks and of levels c..C/2 are saved by exp (as they
            # are) and by the product (unsqueezed): two offload copies, 2K more per head
            SavedTensor("kda", "chunk: in-chunk matrices", heads * intra * _F32, views=1.0 + 2.0 * K / intra),
            SavedTensor("kda", "chunk: decays, u, w, q_eff", heads * (10 * K + 2 * V + 2 * C) * _F32),
            SavedTensor(
                "kda", "chunk: transitions + states", heads * (K * K + 2 * K * V + K) / C * _F32, piece_tokens=C
            ),
        ]
    # of the output's: the normalised value before the norm weight, o_proj's and g_b_proj's inputs
    return (
        mixer
        + chunk
        + [
            SavedTensor(
                "kda",
                "output + gated norm",
                (4 * q + heads) * _F32 + q * a + d * a,
                weight_only=q * _F32 + q * a + d * a,
            )
        ]
    )


def _index_slots(cfg: ModelConfig) -> int:
    return cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail and cfg.index_kpool > 1 else 0)


def _dsa(
    cfg: ModelConfig,
    layer: int,
    a: int,
    recomputed: bool,
    prev_recomputed: bool,
    indexer_kl: bool,
    kernel: str = "torch",
) -> list[SavedTensor]:
    """The DSA mixer (``genolong.model.dsa.DSAMixer``, absorbed MLA over the kv latent).

    Recomputed: its input (H) and, on a ``shared`` layer, the top-k indices it receives
    (``index_topk + index_kpool - 1`` int64 per token). Otherwise: the input (H); the q and kv
    low-rank norms (:func:`_norm` at q_lora_rank and kv_lora_rank) and the normalised q
    residual; the per-head queries (heads x qk_head_dim); the latent (kv_lora_rank, the one
    key/value head); the absorbed queries and the attention output in the latent (2 x heads x
    kv_lora_rank), the log-sum-exp (heads fp32), the output before o_proj (heads x v_head_dim);
    the indices (full layers; a shared layer reuses the previous layer's storage). With the
    indexer KL (the trainer turns it on): index queries (HI x DI), the index key LayerNorm
    (input, output, mean/rstd), the KPool softmax, the pooled keys (DI / P), head weights (HI
    fp32) and, per selected pool, pool id, validity and target log-probability (13 B).

    ``kernel="triton"`` (genolong's Triton DSA kernels): the sparse attention saves what the
    reference does (``kernels/dsa/triton_attention.py:666``: q, k, v, indices, o, lse); KPool
    keys save their inputs instead of the softmax (``kernels/dsa/triton_kpool.py:220``: the
    normalised keys, already counted, the gate logits ``[T, DI]`` and the pool embedding); the
    indexer KL saves its inputs and the ``[T, KP]`` fp32 target with the int64 pool ids, no
    validity mask (``triton_kpool.py:599``); the top-k keeps nothing for backward.
    """
    H = cfg.hidden_size
    assert cfg.indexer_types is not None
    shared = cfg.indexer_types[layer] == "shared"
    slots = _index_slots(cfg)
    if recomputed:
        out = [SavedTensor("dsa", "mixer input (recomputed)", H * a)]
        if shared:
            out.append(SavedTensor("dsa", "received top-k indices", slots * _I64))
        return out
    heads = cfg.num_attention_heads
    out = [SavedTensor("dsa", "mixer input", H * a, weight_only=H * a)]  # q_a, kv_a, indexer projections' input
    out += _norm("dsa", "q_a norm", cfg.q_lora_rank, a)
    out += [SavedTensor("dsa", "q residual", cfg.q_lora_rank * a, weight_only=cfg.q_lora_rank * a)]  # q_b_proj's input
    out += _norm("dsa", "kv_a norm", cfg.kv_lora_rank, a)
    out += [
        SavedTensor("dsa", "queries", heads * cfg.qk_head_dim * a),
        SavedTensor("dsa", "kv latent", cfg.kv_lora_rank * a),
        SavedTensor("dsa", "absorbed queries + latent output", 2 * heads * cfg.kv_lora_rank * a),
        SavedTensor("dsa", "log-sum-exp", heads * _F32),
        SavedTensor("dsa", "attention output", heads * cfg.v_head_dim * a, weight_only=heads * cfg.v_head_dim * a),
    ]
    if not shared:
        out.append(SavedTensor("dsa", "top-k indices", slots * _I64))
    elif prev_recomputed:
        out.append(SavedTensor("dsa", "received top-k indices", slots * _I64))
    if indexer_kl and not shared:
        hi, di, pool = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        pools = cfg.index_topk // pool
        blk = float(DSA_QUERY_BLOCK)
        out += [
            SavedTensor("indexer_kl", "index queries", hi * di * a, piece_tokens=blk),
            SavedTensor("indexer_kl", "index key norm (input, output, mean/rstd)", 2 * di * a + 2 * _F32),
            SavedTensor("indexer_kl", "kpool gate logits" if kernel == "triton" else "kpool softmax", di * a),
            SavedTensor("indexer_kl", "pooled keys", di * a / pool),
            SavedTensor("indexer_kl", "head weights", hi * _F32, piece_tokens=blk),
        ]
        if kernel == "triton":
            out.append(SavedTensor("indexer_kl", "pool ids, target (Triton KL)", pools * (_I64 + _F32)))
        else:
            out.append(
                SavedTensor("indexer_kl", "pool ids, validity, target", pools * (_I64 + 1 + _F32), piece_tokens=blk)
            )
    return out


def _swiglu(kind: str, name: str, inner: int, a: int) -> list[SavedTensor]:
    """A clamped SwiGLU's six ``[T, inner]`` tensors: gate and up projections, clamped gate, SiLU
    output, clamped up, and the product that ``down_proj`` reads."""
    # the product is down_proj's input, kept for its weight gradient only
    return [SavedTensor(kind, f"{name} gate/up/clamps/silu/product", 6 * inner * a, weight_only=inner * a)]


def _ffn(
    cfg: ModelConfig,
    layer: int,
    a: int,
    recomputed: bool,
    tokens: int,
    chunk: int | None,
    expert_load: float | None = None,
) -> list[SavedTensor]:
    """The feed-forward: dense SwiGLU (input H + :func:`_swiglu`) or MoE.

    MoE (``genolong.model.moe.MoE``), not recomputed, per token: the input (H in the compute
    dtype, plus its fp32 copy for the router in bf16); router sigmoid scores
    (E fp32), top-k indices (k int64), chosen weights and their sum (k + 1 fp32), the expert
    sort order and token map (2k int64); per (token, slot): the gathered input (H), gate|up (2I),
    clamped gate, SiLU, clamped up, product (4I), the expert output (H), its weight (fp32) and
    the weighted output that ``index_add_`` keeps as its source (H);
    the shared expert (:func:`_swiglu`). Recomputed: the input only.

    ``expert_load``: None without expert parallelism (a rank runs its own tokens' slots); under
    EP the per-(token, slot) expert tensors live on the rank that holds the expert, which holds
    ``expert_load`` times the mean rows (the busiest rank: the imbalance), and the rows it
    received by the dispatch all-to-all are kept too (H per row, before they are ordered by
    expert; measured under EP 2 with the meter, ``tests/plan/test_plan_activations.py``).
    """
    assert cfg.mlp_layer_types is not None
    H = cfg.hidden_size
    if cfg.mlp_layer_types[layer] == "dense":
        if recomputed:
            return [SavedTensor("mlp", "input (recomputed)", H * a)]
        return [SavedTensor("mlp", "input", H * a, weight_only=H * a)] + _swiglu(
            "mlp", "dense", cfg.intermediate_size, a
        )
    if recomputed:
        return [SavedTensor("moe", "input (recomputed)", H * a)]
    E, k, inner = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    c = min(chunk or tokens, tokens)
    per_expert = max(c / E, 1.0)  # tokens whose slots land in one expert's piece, on average
    load = 1.0 if expert_load is None else expert_load
    received = [] if expert_load is None else [SavedTensor("moe", "EP received rows", load * k * H * a, piece_tokens=c)]
    return [
        # the router reads it per chunk ([c, H] views), the shared expert whole: two offload
        # copies when chunked (one view when not); in bf16 the router reads an fp32 copy
        SavedTensor("moe", "input", H * a, views=2.0 if a == _F32 and c < tokens else 1.0, weight_only=H * a),
        *([SavedTensor("moe", "input fp32 (router)", H * _F32, weight_only=H * _F32)] if a != _F32 else []),
        SavedTensor("moe", "router scores", E * _F32),
        SavedTensor("moe", "top-k indices, order, token map", 3 * k * _I64),
        SavedTensor("moe", "routing weights", (k + 1) * _F32),
        # of which the gathered input (gate_up's) and the product (down_proj's) serve the weight gradients only
        SavedTensor(
            "moe",
            "routed experts",
            load * k * ((3 * H + 6 * inner) * a + _F32),
            piece_tokens=per_expert,
            weight_only=load * k * (H + inner) * a,
        ),
        *received,
        *_swiglu("moe", "shared expert", inner * cfg.n_shared_experts, a),
    ]


def _mhc(cfg: ModelConfig, name: str, a: int, recomputed: bool) -> list[SavedTensor]:
    """One hyper-connection (``genolong.model.mhc.HyperConnection``) and the stream merge after
    its block.

    The streams it reads (``m x H``; saved 4-D by the weights' checkpoint and the collapse, and
    by the merge's batched matmul: two offload copies). The weight computation (normalisation,
    logits, sigmoids, softmax, Sinkhorn) is rebuilt in backward
    (``HyperConnection.recompute_weights``, the default), so unless the whole hyper-connection is
    recomputed only ``pre`` (m fp32, read by the collapse) stays. The merge keeps post (m), the
    block output (H) and the transposed mixing matrix (m^2).
    """
    H, m = cfg.hidden_size, cfg.hc_mult
    out: list[SavedTensor] = [SavedTensor("mhc", f"{name} streams", m * H * a, views=2.0)]
    if not recomputed:
        out.append(SavedTensor("mhc", f"{name} pre", m * _F32))
    out.append(SavedTensor("mhc", f"{name} merge", (m + m * m + H) * a))
    return out


def _half(
    cfg: ModelConfig,
    layer: int,
    half: str,
    a: int,
    kinds: frozenset[str],
    *,
    indexer_kl: bool,
    tokens: int,
    moe_chunk_tokens: int | None,
    kda_kernel: str,
    dsa_kernel: str,
    cp_path: bool,
    expert_load: float | None = None,
    trained: TrainedParts | None = None,
) -> list[SavedTensor]:
    """The saved tensors of one half of block ``layer``: ``attention`` (``attn_hc ->
    input_layernorm -> self_attn -> merge``) or ``ffn`` (``ffn_hc -> post_attention_layernorm ->
    mlp -> merge``), under ``selective`` recompute of ``kinds`` (empty: nothing recomputed);
    with ``trained`` (None: everything trains) without what frozen parts do not keep
    (:func:`_frozen_items`)."""
    assert cfg.layer_types is not None and cfg.mlp_layer_types is not None
    hc = "hc" in kinds
    if half == "attention":
        names = ("attn_hc", "input_layernorm", "self_attn")
        hcs = _mhc(cfg, "attn_hc", a, hc)
        norm = _norm("norm", "input_layernorm", cfg.hidden_size, a)
        if cfg.layer_types[layer] == LINEAR_ATTENTION:
            body = _kda(cfg, a, "kda" in kinds, kda_kernel, cp_path)
        else:
            body = _dsa(cfg, layer, a, "dsa" in kinds, "dsa" in kinds, indexer_kl, dsa_kernel)
    else:
        names = ("ffn_hc", "post_attention_layernorm", "mlp")
        hcs = _mhc(cfg, "ffn_hc", a, hc)
        norm = _norm("norm", "post_attention_layernorm", cfg.hidden_size, a)
        ffn_kind = "mlp" if cfg.mlp_layer_types[layer] == "dense" else "moe"
        body = _ffn(cfg, layer, a, ffn_kind in kinds, tokens, moe_chunk_tokens, expert_load)
    if trained is None:
        return hcs + norm + body
    flags = trained.flags(layer)
    merge = [t for t in hcs if t.name.endswith(" merge")]
    reads = [t for t in hcs if not t.name.endswith(" merge")]
    out = (
        _frozen_items(reads, flags[names[0]])
        + _frozen_items(norm, flags[names[1]])
        + _frozen_items(body, flags[names[2]])
    )
    if body:
        out += trained.adapter_items(cfg, layer, names[2], a, body[0].kind)
    hc_trained, hc_grad = flags[names[0]]
    if hc_trained or hc_grad:
        out += merge
    elif any(flags[n][0] for n in names[1:]):
        # a frozen hyper-connection on streams without a gradient: the merge keeps only post (m),
        # what the block output's gradient reads
        out += [dataclasses.replace(t, bytes_per_token=cfg.hc_mult * a) for t in merge]
    return out


@dataclass(frozen=True)
class ChunkedTerms:
    """What ``memory.recompute: chunked`` keeps and rebuilds for one layer (see
    :func:`chunked_recompute_terms`).

    Attributes:
        saved: the storages kept from forward to backward: the block input, as under ``full``.
        rebuilt_bytes: the largest region rebuilt at a time in this layer's backward (one
            feed-forward chunk with the mid-block streams it reads, or one attention segment).
        rebuilt_region: which that is (for the breakdown).
        layer_bytes: what the layer's backward holds besides, from its block-level recomputation
            to its end: the attention half's carried states (KDA) or keys (DSA).
    """

    saved: list[SavedTensor]
    rebuilt_bytes: float
    rebuilt_region: str
    layer_bytes: float


def chunked_recompute_terms(
    config: ModelConfig,
    layer: int,
    tokens: int,
    chunk_tokens: int,
    *,
    cp: int = 1,
    dtype_bytes: int = 4,
    indexer_kl: bool = False,
    moe_chunk_tokens: int | None = None,
    kda_kernel: str = "torch",
    dsa_kernel: str = "torch",
    expert_load: float | None = None,
    trained: TrainedParts | None = None,
) -> ChunkedTerms:
    """The formulas for ``memory.recompute: chunked`` on layer ``layer`` (one place to adjust).

    From the code (:class:`genolong.parallel.recompute.ChunkedBlockForward`,
    :mod:`genolong.parallel.chunked_kda`, :mod:`genolong.parallel.chunked_dsa`); ``T`` tokens of
    the slice, segments of ``c = min(chunk_tokens, T)``, ``n = ceil(T / c)`` of them, compute
    dtype ``a`` bytes:

    - saved from forward to backward: the block input ``streams [T, m, H]`` only (one
      block-level checkpoint; on a shared DSA layer also the received top-k indices), as ``full``;
      ``tests/parallel/test_recompute_chunked.py`` meters it per layer.
    - held while the layer's backward runs (``layer_bytes``): its block-level recomputation runs
      the attention half again, whose segment checkpoints keep, for a KDA layer, per segment
      boundary the short-conv tail (``kernel - 1`` rows of q|k|v, ``a`` bytes) and the fp32 state
      ``[heads, dk, dv]``: ``n - 1`` of each in one process; under CP ``n`` of each, the pass-1
      state maps ``[heads, dk, dv + dk]`` fp32 of ``n - 1`` segments and the fold's gathered ``cp``
      maps; for a DSA layer the kv latent ``[T, kv_lora_rank]`` and (full-indexer layers) the
      pooled index keys ``[T / pool, index_head_dim]``, under CP those of every position up to the
      rank's slice (the last rank: ``cp * T``).
    - rebuilt at a time (``rebuilt_bytes``): the larger of one feed-forward chunk (the plain
      half's saved set for ``c`` tokens) together with the mid-block streams ``[T, m, H]`` it
      reads (the attention half's output, rebuilt whole in step 1 and freed once every chunk is
      done), and one attention segment (the plain half's saved set for ``c`` tokens; a DSA query
      segment also relayouts and differentiates the keys it reads: ``3 x`` the latent of the
      positions up to the slice's end); either with the gradients of its output and input streams
      (``2 x [c, m, H]``). ``tests/plan/test_plan_activations.py`` holds the growth of the measured backward peak
      with ``chunk_tokens`` to this within 10% (tiny, small).

    Args:
        config: the architecture.
        layer: layer index.
        tokens: tokens of the rank's slice (``batch * T / cp``).
        chunk_tokens: ``memory.recompute_chunk_tokens``.
        cp: context-parallel size (state maps, keys of earlier ranks).
        dtype_bytes, indexer_kl, moe_chunk_tokens, kda_kernel, dsa_kernel,
            expert_load, trained: as :func:`layer_saved_tensors`.

    Returns:
        :class:`ChunkedTerms` (bytes).
    """
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    a = dtype_bytes
    H, m = cfg.hidden_size, cfg.hc_mult
    c = min(chunk_tokens, tokens)
    segments = -(-tokens // c)
    saved = [SavedTensor("block_input", "streams", m * H * a)]
    is_dsa = cfg.layer_types[layer] == INDEXED_ATTENTION
    full_indexer = is_dsa and cfg.indexer_types[layer] == "full"
    if is_dsa and not full_indexer:
        saved.append(SavedTensor("block_input", "received top-k indices", _index_slots(cfg) * _I64))
    if trained is not None and not trained.any_below(layer):  # nothing in or below the block trains
        return ChunkedTerms(saved=[], rebuilt_bytes=0.0, rebuilt_region="nothing (frozen)", layer_bytes=0.0)
    plain = dict(
        indexer_kl=indexer_kl,
        tokens=c,
        moe_chunk_tokens=moe_chunk_tokens,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        cp_path=cp > 1,
        expert_load=expert_load,
        trained=trained,
    )
    # a segment's (or chunk's) backward also holds the gradients of its output and of its input
    # streams, [c, m, H] each
    grads = 2 * c * m * H * a
    attn = sum(t.nbytes(c) for t in _half(cfg, layer, "attention", a, frozenset(), **plain)) + grads
    if is_dsa:
        end = cp * tokens if cp > 1 else tokens  # positions whose keys the (last) rank reads
        carried = end * (cfg.kv_lora_rank + (cfg.index_head_dim / cfg.index_kpool if full_indexer else 0)) * a
        attn += 3 * end * cfg.kv_lora_rank * a
    else:
        heads, d = cfg.linear_num_heads, cfg.linear_head_dim
        boundary = heads * d * d * _F32 + (cfg.linear_conv_kernel_dim - 1) * 3 * heads * d * a
        carried = (segments - 1) * boundary
        if cp > 1:
            state_map = heads * d * (d + d) * _F32
            carried = segments * boundary + (segments - 1 + cp) * state_map
    ffn = sum(t.nbytes(c) for t in _half(cfg, layer, "ffn", a, frozenset(), **plain)) + grads + tokens * m * H * a
    region = ("DSA" if is_dsa else "KDA") + " attention segment" if attn >= ffn else "feed-forward chunk + mid streams"
    return ChunkedTerms(saved=saved, rebuilt_bytes=max(attn, ffn), rebuilt_region=region, layer_bytes=carried)


def layer_saved_tensors(
    config: ModelConfig,
    layer: int,
    recompute: str = "none",
    recompute_modules: Sequence[str] = (),
    *,
    dtype_bytes: int = 4,
    indexer_kl: bool = False,
    tokens: int = 4096,
    moe_chunk_tokens: int | None = None,
    kda_kernel: str = "torch",
    dsa_kernel: str = "torch",
    cp: int = 1,
    recompute_chunk_tokens: int = 16384,
    expert_load: float | None = None,
    trained: TrainedParts | None = None,
) -> list[SavedTensor]:
    """What layer ``layer`` keeps for backward, storage by storage.

    Args:
        config: the architecture.
        layer: layer index.
        recompute: "none", "selective", "full" (as :func:`genolong.parallel.apply_recompute`) or
            "chunked" (:func:`chunked_recompute_terms`).
        recompute_modules: kinds for "selective" (default: ``DEFAULT_SELECTIVE``).
        dtype_bytes: bytes of the compute dtype (4: fp32, 2: bf16); parts the layers compute in
            fp32 stay 4.
        indexer_kl: the DSA indexer KL is computed (the trainer does; a bare model does not).
        tokens: tokens of the slice (sets the piece sizes of per-expert tensors, and the
            segments of ``chunked``).
        moe_chunk_tokens: MoE dispatch chunk (piece sizes only).
        kda_kernel: ``torch`` (default) or ``fla`` (see :data:`~genolong.plan.KDA_KERNELS`).
        dsa_kernel: ``torch`` (default) or ``triton`` (see :data:`~genolong.plan.DSA_KERNELS`).
        cp: context-parallel size (default 1): the KDA layer takes its CP path (gate and beta in
            torch) and ``chunked`` keeps transitions.
        recompute_chunk_tokens: ``chunked``'s segment (default 16384).
        expert_load: None without expert parallelism (default); under EP the routed-expert rows
            this rank holds over the mean (the imbalance on the busiest rank; see ``_ffn``).
        trained: which parts train (:class:`TrainedParts`, from ``model.freeze`` / ``model.lora``);
            None (default): every parameter trains.

    Returns:
        The :class:`SavedTensor` list; under "full" only the block inputs (``streams [T, m, H]``
        and, on a shared DSA layer, the received indices); under "chunked" those and the
        carried extras.
    """
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    kinds = _resolve_kinds(recompute, recompute_modules)
    a = dtype_bytes
    if trained is not None and recompute in _BLOCK_RECOMPUTE and not trained.any_below(layer):
        return []  # the checkpointed block records nothing: no input needs a gradient, no weight trains
    if recompute == "full":
        out = [SavedTensor("block_input", "streams", cfg.hc_mult * cfg.hidden_size * a)]
        if cfg.layer_types[layer] == INDEXED_ATTENTION and cfg.indexer_types[layer] == "shared":
            out.append(SavedTensor("block_input", "received top-k indices", _index_slots(cfg) * _I64))
        return out
    if recompute == "chunked":
        return chunked_recompute_terms(
            cfg,
            layer,
            tokens,
            recompute_chunk_tokens,
            cp=cp,
            dtype_bytes=a,
            indexer_kl=indexer_kl,
            moe_chunk_tokens=moe_chunk_tokens,
            kda_kernel=kda_kernel,
            dsa_kernel=dsa_kernel,
            expert_load=expert_load,
            trained=trained,
        ).saved
    common = dict(
        indexer_kl=indexer_kl,
        tokens=tokens,
        moe_chunk_tokens=moe_chunk_tokens,
        kda_kernel=kda_kernel,
        dsa_kernel=dsa_kernel,
        cp_path=cp > 1,
        expert_load=expert_load,
        trained=trained,
    )
    return (
        _half(cfg, layer, "attention", a, kinds, **common)  # type: ignore[arg-type]
        + _half(cfg, layer, "ffn", a, kinds, **common)
    )  # type: ignore[arg-type]


def outside_saved_tensors(
    config: ModelConfig, dtype_bytes: int = 4, trained: TrainedParts | None = None
) -> list[SavedTensor]:
    """What the embedding, the final norm and the chunked cross-entropy keep (per token): the
    input ids (int64), the final RMSNorm (:func:`_norm`), the hidden state the loss reads (H),
    the targets (int64), token weights and log-sum-exp (fp32); with ``trained``
    (:class:`TrainedParts`; None: everything trains) without the ids of a frozen embedding and the
    normalised value of a frozen final norm."""
    H = config.hidden_size
    ids = [SavedTensor("outside", "input ids", _I64, weight_only=_I64)]  # the embedding's weight gradient
    norm = _norm("outside", "final norm", H, dtype_bytes)
    loss = [SavedTensor("outside", "loss: hidden, targets, weights, lse", H * dtype_bytes + _I64 + 2 * _F32)]
    if trained is None:
        return ids + norm + loss
    below = trained.any_below(config.num_hidden_layers - 1)
    return (
        _frozen_items(ids, (trained.embedding, False))
        + _frozen_items(norm, (trained.norm, below))
        + _frozen_items(loss, (trained.lm_head, below or trained.norm))
    )


@dataclass
class ActivationEstimate:
    """Predicted saved activations of one training step on one rank (see :func:`activation_estimate`).

    Attributes:
        tokens: tokens of the rank's slice.
        layer_resident: per layer, bytes kept on the device.
        layer_offloaded: per layer, bytes in the host pool (the offloader's copies).
        outside_bytes: embedding, final norm and loss (always on the device).
        peak_resident_bytes: device peak of saved activations (forward end, or backward with the
            offloader's two-layer prefetch window).
        peak_offloaded_bytes: host pool peak (end of forward): the offloaded bytes.
        pinned_pool_bytes: the pinned host memory those take on CUDA: each host buffer (a piece,
            a view) rounded up to a power of two by torch's caching host allocator
            (:func:`genolong.parallel.offload.pinned_block_bytes`; equal to the offloaded bytes
            when every buffer is a power of two, as at 1M tokens).
        peak_total_bytes: peak of device + host saved bytes.
        by_kind: saved bytes (device + host, storages) by part: kda, dsa, moe, mhc, ...
        rebuilt_bytes: the largest recomputed region's activations, rebuilt during its backward
            (not seen by the meter; 0 without recompute).
        plain_by_kind: saved bytes by part without any recompute (what recompute rebuilds).
    """

    tokens: int
    layer_resident: list[int]
    layer_offloaded: list[int]
    outside_bytes: int
    peak_resident_bytes: int
    peak_offloaded_bytes: int
    peak_total_bytes: int
    by_kind: dict[str, int]
    rebuilt_bytes: int
    plain_by_kind: dict[str, int] = field(default_factory=dict)
    pinned_pool_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """All saved storages at the end of forward (device and host), counting each storage once."""
        return sum(self.by_kind.values())


def activation_estimate(
    config: ModelConfig,
    tokens: int,
    *,
    recompute: str = "none",
    recompute_modules: Sequence[str] = (),
    offload: bool = False,
    offload_min_bytes: int = 1 << 20,
    dtype_bytes: int = 4,
    indexer_kl: bool = False,
    moe_chunk_tokens: int | None = None,
    batch: int = 1,
    kda_kernel: str = "torch",
    dsa_kernel: str = "torch",
    cp: int = 1,
    recompute_chunk_tokens: int = 16384,
    expert_load: float | None = None,
    trained: TrainedParts | None = None,
) -> ActivationEstimate:
    """Saved-activation bytes of one forward + backward on ``batch x tokens`` tokens of one rank.

    What :class:`~genolong.memory.meter.ActivationMeter` measures around ``model.loss(...)
    .backward()`` of a GenoLM prepared by :func:`genolong.parallel.parallelize` with the same
    settings. Under context parallelism pass the slice, ``context / cp``.

    Args:
        config: the architecture.
        tokens: tokens per sequence slice on this rank (> 0).
        recompute, recompute_modules: as :func:`genolong.parallel.parallelize`.
        offload: CPU activation offload; ``offload_min_bytes``: its threshold (default 1 MiB).
        dtype_bytes: 4 (fp32) or 2 (bf16 compute).
        indexer_kl: count the DSA indexer KL's saved tensors (the trainer computes it).
        moe_chunk_tokens: MoE dispatch chunk (only changes per-expert piece sizes).
        batch: sequences per step on this rank (default 1).
        kda_kernel: ``torch`` (default; genolong's kernels, validated) or ``fla`` (from its source).
        dsa_kernel: ``torch`` (default) or ``triton`` (measured on CPU in the interpreter).
        cp: context-parallel size (default 1; the KDA layer's CP path, chunked's transitions and
            whole-sequence keys); ``tokens`` is still the slice.
        recompute_chunk_tokens: tokens per rebuilt piece under ``chunked`` (default 16384).
        expert_load: None without expert parallelism (default); under EP the routed-expert rows
            on this rank over the mean (the imbalance on the busiest rank).
        trained: which parts train (:class:`TrainedParts`: ``model.freeze``, ``model.lora``);
            None (default): every parameter trains.

    Raises:
        InputError: non-positive tokens or batch, an unknown recompute mode or kind, a bad dtype
            or KDA kernel.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise InputError(f"tokens must be a positive integer, got {tokens!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch must be a positive integer, got {batch!r}")
    if dtype_bytes not in (2, 4):
        raise InputError(f"dtype_bytes must be 4 (fp32) or 2 (bf16), got {dtype_bytes!r}")
    if kda_kernel not in KDA_KERNELS:
        raise InputError(f"kda_kernel {kda_kernel!r} is unknown; choose one of {', '.join(KDA_KERNELS)}")
    if dsa_kernel not in DSA_KERNELS:
        raise InputError(f"dsa_kernel {dsa_kernel!r} is unknown; choose one of {', '.join(DSA_KERNELS)}")
    n = tokens * batch
    kernels = dict(kda_kernel=kda_kernel, dsa_kernel=dsa_kernel, cp=cp, expert_load=expert_load, trained=trained)
    L = config.num_hidden_layers
    resident: list[int] = []
    offloaded: list[int] = []
    by_kind: dict[str, int] = {}
    plain_by_kind: dict[str, int] = {}
    rebuilt = 0
    pinned = 0.0
    for i in range(L):
        items = layer_saved_tensors(
            config,
            i,
            recompute,
            recompute_modules,
            dtype_bytes=dtype_bytes,
            indexer_kl=indexer_kl,
            tokens=n,
            moe_chunk_tokens=moe_chunk_tokens,
            recompute_chunk_tokens=recompute_chunk_tokens,
            **kernels,
        )  # type: ignore[arg-type]
        res = off = 0.0
        for t in items:
            size = t.nbytes(n)
            by_kind[t.kind] = by_kind.get(t.kind, 0) + int(round(size))
            if offload and t.piece_bytes(n) >= offload_min_bytes:
                off += size * t.views
                pinned += t.views * _pinned_pieces(t, n)
            else:
                res += size
        resident.append(int(round(res)))
        offloaded.append(int(round(off)))
        plain = layer_saved_tensors(
            config,
            i,
            "none",
            dtype_bytes=dtype_bytes,
            indexer_kl=indexer_kl,
            tokens=n,
            moe_chunk_tokens=moe_chunk_tokens,
            **kernels,
        )  # type: ignore[arg-type]
        for t in plain:
            plain_by_kind[t.kind] = plain_by_kind.get(t.kind, 0) + int(round(t.nbytes(n)))
        if recompute != "none":
            if recompute == "full":
                region = sum(t.nbytes(n) for t in plain)
            elif recompute == "chunked":
                terms = chunked_recompute_terms(
                    config,
                    i,
                    n,
                    recompute_chunk_tokens,
                    dtype_bytes=dtype_bytes,
                    indexer_kl=indexer_kl,
                    moe_chunk_tokens=moe_chunk_tokens,
                    **kernels,
                )  # type: ignore[arg-type]
                region = terms.rebuilt_bytes + terms.layer_bytes
            else:
                kinds = _resolve_kinds(recompute, recompute_modules)
                region = max(
                    [
                        sum(t.nbytes(n) for t in plain if t.kind == k or (k == "dsa" and t.kind == "indexer_kl"))
                        for k in kinds
                        if k != "hc"
                    ]
                    + [0]
                )
                if "hc" in kinds:
                    region = max(region, sum(t.nbytes(n) for t in plain if t.kind == "mhc") / 2)
            rebuilt = max(rebuilt, int(round(region)))
    outside = int(round(sum(t.nbytes(n) for t in outside_saved_tensors(config, dtype_bytes, trained))))
    by_kind["outside"] = plain_by_kind["outside"] = outside
    fwd_resident = outside + sum(resident)
    fwd_total = fwd_resident + sum(offloaded)
    peak_resident, peak_total = fwd_resident, fwd_total
    if offload:
        # backward of layer i: layers > i released; the offloader holds layer i's tensors and
        # prefetches layer i - 1's back on the device
        for i in range(L - 1, -1, -1):
            window = offloaded[i] + (offloaded[i - 1] if i > 0 else 0)
            res = sum(resident[: i + 1]) + window
            peak_resident = max(peak_resident, res)
            peak_total = max(peak_total, res + sum(offloaded[: i + 1]))
    return ActivationEstimate(
        tokens=n,
        layer_resident=resident,
        layer_offloaded=offloaded,
        outside_bytes=outside,
        peak_resident_bytes=peak_resident,
        peak_offloaded_bytes=sum(offloaded),
        peak_total_bytes=peak_total,
        by_kind=by_kind,
        rebuilt_bytes=rebuilt,
        plain_by_kind=plain_by_kind,
        pinned_pool_bytes=int(round(pinned)),
    )


def _pinned_pieces(t: SavedTensor, tokens: int) -> int:
    """Pinned host bytes of one view of ``t``: each saved piece's host buffer rounded up to a
    power of two (torch's caching host allocator)."""

    def block(nbytes: float) -> int:
        n = int(round(nbytes))
        return 0 if n <= 0 else 1 << (n - 1).bit_length()

    if t.piece_tokens is None or t.piece_tokens >= tokens:
        return block(t.nbytes(tokens))
    piece = int(t.piece_tokens)
    full, rest = divmod(tokens, piece)
    return full * block(t.bytes_per_token * piece) + block(t.bytes_per_token * rest) + block(t.const_bytes)


def dsa_buffer_bytes(
    config: ModelConfig, sequence_tokens: int, cp: int, dtype_bytes: int, *, gradients: bool = True
) -> int:
    """Bytes of the DSA indexer / top-k / gather buffers one DSA layer holds besides its saved tensors.

    The KPool top-k's tile (``INDEXER_TILE^2`` scores for ``index_n_heads + 3`` fp32 planes and the
    running top-k of ``2 x INDEXER_TILE`` rows of pool ids, int64), the sparse attention's gather of
    one query block (``DSA_QUERY_BLOCK x slots`` rows of ``2 kv_lora_rank + 2 heads`` fp32) and,
    under context parallelism (``cp > 1``), the all-gathered kv latent and pooled index keys of the
    whole sequence (``sequence_tokens x (kv_lora_rank + index_head_dim / index_kpool)`` in the
    compute dtype), twice with ``gradients`` (training: their gradients too), once without
    (a forward-only evaluation). 0 for a model without DSA layers.

    Args:
        config: the architecture.
        sequence_tokens: tokens of the whole sequence(s) a CP group holds (``batch x context``).
        cp: context-parallel size.
        dtype_bytes: the compute dtype's bytes.
        gradients: count the gathered keys' gradients (default True: a training step).
    """
    cfg = config
    assert cfg.layer_types is not None
    if INDEXED_ATTENTION not in cfg.layer_types:
        return 0
    slots = _index_slots(cfg)
    tile = (
        INDEXER_TILE * INDEXER_TILE * (cfg.index_n_heads + 3) * 4
        + 2 * INDEXER_TILE * (cfg.index_topk // cfg.index_kpool) * 8
    )
    gather = DSA_QUERY_BLOCK * slots * (2 * cfg.kv_lora_rank + 2 * cfg.num_attention_heads) * 4
    allgather = 0.0
    if cp > 1:
        allgather = (
            (2 if gradients else 1)
            * sequence_tokens
            * (cfg.kv_lora_rank + cfg.index_head_dim / cfg.index_kpool)
            * dtype_bytes
        )
    return int(tile + gather + allgather)

"""The memory planner behind ``genolong plan``: will a recipe fit, per GPU and per node, before it runs?

Everything is predicted from formulas over the :class:`~genolong.model.config.ModelConfig`
dimensions and the recipe's settings; nothing is measured or looked up. The activation formulas
are an inventory of what autograd keeps for backward in genolong's own layers (the torch kernels
in ``genolong.kernels``), storage by storage, written from the code of each layer; the tests
(``tests/test_plan.py``) hold them to within 10% of :class:`~genolong.memory.meter.ActivationMeter`
on the ``tiny`` and ``small`` presets over lengths, recompute modes, offload and CP.

Kernel backends (:func:`backend_kernels`): the model's ``kernel_backend`` decides which save sets
count. ``auto`` on a GPU recipe is the ``triton`` backend: fla-core's ``chunk_kda`` for KDA (its
``save_for_backward`` read from fla's source, see :func:`_kda`; fla cannot run on CPU) and
genolong's Triton DSA kernels (metered on CPU in Triton's interpreter by the tests).

Expert parallelism (``parallel.ep``): each MoE layer's routed experts are split over ``ep`` ranks
of the ``dp_shard x cp`` ranks (``E / ep`` per rank) and are their own FSDP unit over the
``dp_shard x cp / ep`` ranks left (:func:`fsdp_unit_groups`); the busiest rank holds the
imbalance (default 4x) times the mean expert rows; the all-to-alls are counted by
:func:`ep_comm_bytes`. ``memory.recompute: chunked``: :func:`chunked_recompute_terms` (one place
for its formulas).

Per GPU (one process), device memory is the sum of:

- **parameters, gradients, optimizer state** under FSDP2 sharding. The shard group is
  ``dp_shard * cp`` ranks (as the recipes say: with context parallelism, parameters are sharded
  over all ranks of a replica); ``dp_replicate`` replicas each hold a full sharded copy.
  ``32-true``: fp32 parameters (4 B), gradients (4 B), AdamW moments (8 B) per parameter.
  ``bf16-mixed``: fp32 master parameters, fp32 gradients (FSDP reduce dtype) and fp32 moments,
  the same 16 B per parameter, plus the bf16 compute copies below.
- **FSDP working copies**: the unsharded parameters of the block being computed and of the one
  prefetched (2 x the largest FSDP unit, in the compute dtype) and the unsharded gradient of one
  unit before its reduce-scatter (fp32). None without sharding in fp32.
- **saved activations** that stay on the device (see :func:`activation_estimate`), for
  ``tokens_per_rank = batch_size * context / cp`` tokens.
- **transients** while backward runs: the activations a recomputed region rebuilds (the largest
  one), the activation gradients in flight (3 x the residual streams of a layer), and the
  largest of: one MoE dispatch chunk, the DSA indexer/top-k and sparse-attention buffers (with
  the CP all-gather of the latent and pooled keys), the cross-entropy chunk.
- **workspace**: :data:`WORKSPACE_BYTES` (CUDA context, cuBLAS and NCCL buffers) plus
  :data:`FRAGMENTATION` of everything else (allocator rounding and fragmentation).

Pinned host memory per GPU is the offloaded activation pool at its peak (end of forward);
per node it is that times the GPUs of a node.

Communication per rank per training step (:func:`comm_estimate`, ``Plan.comm``): the
context-parallel collectives of the token mixers, summed over the layers from the exact per-call
formulas (KDA: :func:`genolong.kernels.kda.cp.cp_kda_comm_bytes` and ``conv_halo_comm_bytes``,
which count the payload a rank hands to the collective; DSA:
:func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes`, which counts the bytes a rank receives), the
forward collectives again when recompute reruns a mixer, and FSDP2's parameter all-gathers and
gradient reduce-scatter over the shard group (bytes received). Every row also gives the bytes a rank
sends with ring algorithms, one unit for all rows. ``benchmarks/cp_step.py`` holds the CP rows to the
bytes counted through ``torch.distributed``.

Evaluation (``genolong plan RECIPE --evaluate --context N``, :func:`eval_plan`,
:func:`format_eval_plan`): a forward-only pass on the recipe's mesh. Per GPU: the weights in the
scoring dtype sharded over ``dp_shard x cp`` (EP: ``E / ep`` experts per rank, as in training),
two unsharded FSDP units in flight, the largest half-block's forward working set on the rank's
``context / cp`` tokens (:func:`forward_working_set`: the same per-tensor inventory as the training
plan, an upper bound for a forward without grad, plus fla-core's forward temporaries, the DSA
buffers with the all-gathered keys under CP, one MoE dispatch chunk) or the LM-head phase
(:func:`eval_outside_tensors`), and with ``--segment-tokens`` one segment's working set plus the
stream caches (:func:`stream_cache_tensors`); host memory for loading each rank's slices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import KDA_CHUNK, Recipe, kernel_multiple, parse_recipe
from ..errors import InputError
from ..kernels.comm_bytes import conv_halo_payload, cp_dsa_comm_bytes, kda_state_payload
from ..model.config import INDEXED_ATTENTION, LINEAR_ATTENTION, ModelConfig, parameter_count
from ..units import format_bytes, format_count
from .recompute import DEFAULT_SELECTIVE, MODULE_KINDS, RECOMPUTE_MODES

__all__ = [
    "BACKEND_KERNELS",
    "COMM_CONVENTIONS",
    "COMM_PARTS",
    "DSA_KERNELS",
    "EVAL_CHUNK_ROWS",
    "EvalPlan",
    "FRAGMENTATION",
    "GIB",
    "KDA_KERNELS",
    "PAYLOAD",
    "PLAN_RECOMPUTE_MODES",
    "RECEIVED",
    "SENT",
    "TRANSIENTS",
    "WORKSPACE_BYTES",
    "ActivationEstimate",
    "CPU_PROCESS_BYTES",
    "ChunkedTerms",
    "CommEstimate",
    "CommRow",
    "FSDPUnit",
    "Plan",
    "SavedTensor",
    "WorkingTensor",
    "activation_estimate",
    "backend_kernels",
    "chunked_recompute_terms",
    "comm_estimate",
    "dsa_buffer_bytes",
    "eval_outside_tensors",
    "eval_plan",
    "ep_comm_bytes",
    "format_eval_plan",
    "format_plan",
    "forward_working_set",
    "fsdp_unit_groups",
    "fsdp_units",
    "layer_saved_tensors",
    "outside_saved_tensors",
    "plan",
    "recipe_moe_imbalance",
    "routed_expert_parameters",
    "stream_cache_tensors",
]

GIB = 1 << 30
#: Fixed device workspace: CUDA context, cuBLAS workspaces, NCCL buffers (about 2 GiB on H100/B200).
WORKSPACE_BYTES = 2 * GIB
#: Allocator rounding and fragmentation, as a fraction of everything else on the device.
FRAGMENTATION = 0.05
#: Sub-block size of the torch chunked KDA (``genolong.kernels.kda.chunk._SUB_BLOCK``): the
#: in-chunk matrices come from one matmul per sub-block, then a block-inverse hierarchy.
KDA_SUB_BLOCK = 16
#: Queries per block of the DSA sparse attention (``DSAMixer.query_block``) and of the indexer KL.
DSA_QUERY_BLOCK = 64
#: Query and pool tile of the KPool indexer top-k (``kernels.dsa.kpool_topk`` defaults).
INDEXER_TILE = 256

_F32 = 4
_I64 = 8
_KIND_ALIASES = {"attn": ("kda", "dsa"), "ffn": ("moe", "mlp")}


# -- saved-tensor inventory ------------------------------------------------------------------------


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
    """

    kind: str
    name: str
    bytes_per_token: float
    views: float = 1.0
    piece_tokens: float | None = None
    const_bytes: float = 0.0

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


def _norm(kind: str, name: str, width: int, a: int) -> list[SavedTensor]:
    """RMSNorm over ``width``: the fp32 input (``x.float()``: the input itself in fp32, a copy
    otherwise), the ``[T, 1]`` rsqrt and the normalised value cast back to the compute dtype."""
    return [
        SavedTensor(kind, f"{name} input (fp32)", width * _F32),
        SavedTensor(kind, f"{name} rsqrt", _F32),
        SavedTensor(kind, f"{name} normalised", width * a),
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


#: KDA chunk kernels the planner knows: ``torch`` (genolong's, validated against the meter) and
#: ``fla`` (fla-core's Triton ``chunk_kda``, read from its source: not runnable on CPU, so not
#: validated here; see :func:`_kda`).
KDA_KERNELS = ("torch", "fla")
#: DSA kernels the planner knows: ``torch`` (the reference ops) and ``triton`` (genolong's Triton
#: DSA kernels, ``genolong.kernels.dsa.triton_*``: measured on CPU under ``TRITON_INTERPRET=1``).
DSA_KERNELS = ("torch", "triton")
#: ``ModelConfig.kernel_backend`` -> (KDA chunk kernel, DSA kernels) the planner counts, for a GPU
#: run (``genolong.kernels.backends``): ``triton`` takes KDA from fla-core when it imports (the
#: planner assumes it does on a GPU machine) and ``auto`` resolves to ``triton`` on CUDA
#: (``resolve_auto``), to ``torch`` on a CPU-only run (``parallel.accelerator: cpu``).
BACKEND_KERNELS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "torch"),
    "fla": ("fla", "torch"),
    "triton": ("fla", "triton"),
    "auto": ("fla", "triton"),
}


def backend_kernels(backend: str, accelerator: str = "gpu") -> tuple[str, str]:
    """The (KDA chunk kernel, DSA kernel) pair a ``kernel_backend`` runs on ``accelerator``.

    ``auto`` on ``cpu`` is ``torch`` (no CUDA: ``genolong.kernels.backends.resolve_auto``); on
    ``gpu``, ``cuda`` or ``auto`` it is the ``triton`` backend (fla-core's ``chunk_kda`` and the
    Triton DSA kernels), assuming the GPU machine has Triton and fla-core >= 0.5.2.

    Raises:
        InputError: an unknown backend name.
    """
    if backend not in BACKEND_KERNELS:
        raise InputError(f"kernel_backend {backend!r} is unknown to the planner; choose one of {', '.join(BACKEND_KERNELS)}")
    if backend == "auto" and accelerator == "cpu":
        return "torch", "torch"
    return BACKEND_KERNELS[backend]


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
        SavedTensor("kda", "mixer input", H * a),
        SavedTensor("kda", "conv padded input", 3 * q * _F32, views=4.0),
        SavedTensor("kda", "conv pre-activation", 3 * q * _F32),
        SavedTensor("kda", "q|k|v", 3 * q * _F32),
        SavedTensor("kda", "l2 norm roots", 2 * heads * _F32),
    ]
    if kernel != "fla":
        mixer.append(SavedTensor("kda", "normalised k", q * _F32, views=3.0))
    mixer.append(SavedTensor("kda", "gate low-rank", d * a))
    if kernel != "fla" or cp_path:
        mixer += [SavedTensor("kda", "gate logits + sigmoid", 2 * q * _F32),
                  SavedTensor("kda", "beta", heads * _F32, views=4.0 if kernel != "fla" else 1.0)]
    if kernel == "fla":
        if cp_path:
            chunk = [SavedTensor("kda", "fla chunk_kda under CP: q, k, [v | 0], g_cumsum, g, Aqk, Akk; [o0 | P]",
                                 heads * (5 * K + V + 2 * C + (V + K)) * _F32)]
        else:
            chunk = [SavedTensor("kda", "fla chunk_kda (gate in kernel): q, k, v, g raw, beta raw + sigmoid, Aqk, Akk",
                                 heads * (3 * K + V + 2 * C + 2) * _F32)]
    else:
        intra = _kda_intra_floats(K, C, KDA_SUB_BLOCK)
        chunk = [
            # the decay factors of the sub-blocks and of levels c..C/2 are saved by exp (as they
            # are) and by the product (unsqueezed): two offload copies, 2K more per head
            SavedTensor("kda", "chunk: in-chunk matrices", heads * intra * _F32, views=1.0 + 2.0 * K / intra),
            SavedTensor("kda", "chunk: decays, u, w, q_eff", heads * (10 * K + 2 * V + 2 * C) * _F32),
            SavedTensor("kda", "chunk: transitions + states", heads * (K * K + 2 * K * V + K) / C * _F32, piece_tokens=C),
        ]
    return mixer + chunk + [SavedTensor("kda", "output + gated norm", (4 * q + heads) * _F32 + q * a + d * a)]


def _index_slots(cfg: ModelConfig) -> int:
    return cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail and cfg.index_kpool > 1 else 0)


def _dsa(cfg: ModelConfig, layer: int, a: int, recomputed: bool, prev_recomputed: bool,
         indexer_kl: bool, kernel: str = "torch") -> list[SavedTensor]:
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
    out = [SavedTensor("dsa", "mixer input", H * a)]
    out += _norm("dsa", "q_a norm", cfg.q_lora_rank, a)
    out += [SavedTensor("dsa", "q residual", cfg.q_lora_rank * a)]
    out += _norm("dsa", "kv_a norm", cfg.kv_lora_rank, a)
    out += [
        SavedTensor("dsa", "queries", heads * cfg.qk_head_dim * a),
        SavedTensor("dsa", "kv latent", cfg.kv_lora_rank * a),
        SavedTensor("dsa", "absorbed queries + latent output", 2 * heads * cfg.kv_lora_rank * a),
        SavedTensor("dsa", "log-sum-exp", heads * _F32),
        SavedTensor("dsa", "attention output", heads * cfg.v_head_dim * a),
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
            out.append(SavedTensor("indexer_kl", "pool ids, validity, target", pools * (_I64 + 1 + _F32), piece_tokens=blk))
    return out


def _swiglu(kind: str, name: str, inner: int, a: int) -> list[SavedTensor]:
    """A clamped SwiGLU's six ``[T, inner]`` tensors: gate and up projections, clamped gate, SiLU
    output, clamped up, and the product that ``down_proj`` reads."""
    return [SavedTensor(kind, f"{name} gate/up/clamps/silu/product", 6 * inner * a)]


def _ffn(cfg: ModelConfig, layer: int, a: int, recomputed: bool, tokens: int, chunk: int | None,
         expert_load: float | None = None) -> list[SavedTensor]:
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
    expert; measured under EP 2 with the meter, ``tests/test_plan.py``).
    """
    assert cfg.mlp_layer_types is not None
    H = cfg.hidden_size
    if cfg.mlp_layer_types[layer] == "dense":
        if recomputed:
            return [SavedTensor("mlp", "input (recomputed)", H * a)]
        return [SavedTensor("mlp", "input", H * a)] + _swiglu("mlp", "dense", cfg.intermediate_size, a)
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
        SavedTensor("moe", "input", H * a, views=2.0 if a == _F32 and c < tokens else 1.0),
        *([SavedTensor("moe", "input fp32 (router)", H * _F32)] if a != _F32 else []),
        SavedTensor("moe", "router scores", E * _F32),
        SavedTensor("moe", "top-k indices, order, token map", 3 * k * _I64),
        SavedTensor("moe", "routing weights", (k + 1) * _F32),
        SavedTensor("moe", "routed experts", load * k * ((3 * H + 6 * inner) * a + _F32), piece_tokens=per_expert),
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


def _half(cfg: ModelConfig, layer: int, half: str, a: int, kinds: frozenset[str], *, indexer_kl: bool,
          tokens: int, moe_chunk_tokens: int | None, kda_kernel: str, dsa_kernel: str, cp_path: bool,
          expert_load: float | None = None) -> list[SavedTensor]:
    """The saved tensors of one half of block ``layer``: ``attention`` (``attn_hc ->
    input_layernorm -> self_attn -> merge``) or ``ffn`` (``ffn_hc -> post_attention_layernorm ->
    mlp -> merge``), under ``selective`` recompute of ``kinds`` (empty: nothing recomputed)."""
    assert cfg.layer_types is not None and cfg.mlp_layer_types is not None
    hc = "hc" in kinds
    if half == "attention":
        out = _mhc(cfg, "attn_hc", a, hc)
        out += _norm("norm", "input_layernorm", cfg.hidden_size, a)
        if cfg.layer_types[layer] == LINEAR_ATTENTION:
            out += _kda(cfg, a, "kda" in kinds, kda_kernel, cp_path)
        else:
            out += _dsa(cfg, layer, a, "dsa" in kinds, "dsa" in kinds, indexer_kl, dsa_kernel)
        return out
    out = _mhc(cfg, "ffn_hc", a, hc)
    out += _norm("norm", "post_attention_layernorm", cfg.hidden_size, a)
    ffn_kind = "mlp" if cfg.mlp_layer_types[layer] == "dense" else "moe"
    out += _ffn(cfg, layer, a, ffn_kind in kinds, tokens, moe_chunk_tokens, expert_load)
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


def chunked_recompute_terms(config: ModelConfig, layer: int, tokens: int, chunk_tokens: int, *, cp: int = 1,
                            dtype_bytes: int = 4, indexer_kl: bool = False, moe_chunk_tokens: int | None = None,
                            kda_kernel: str = "torch", dsa_kernel: str = "torch",
                            expert_load: float | None = None) -> ChunkedTerms:
    """The formulas for ``memory.recompute: chunked`` on layer ``layer`` (one place to adjust).

    From the code (:class:`genolong.parallel.recompute.ChunkedBlockForward`,
    :mod:`genolong.parallel.chunked_kda`, :mod:`genolong.parallel.chunked_dsa`); ``T`` tokens of
    the slice, segments of ``c = min(chunk_tokens, T)``, ``n = ceil(T / c)`` of them, compute
    dtype ``a`` bytes:

    - saved from forward to backward: the block input ``streams [T, m, H]`` only (one
      block-level checkpoint; on a shared DSA layer also the received top-k indices), as ``full``;
      ``tests/test_recompute_chunked.py`` meters it per layer.
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
      (``2 x [c, m, H]``). ``tests/test_plan.py`` holds the growth of the measured backward peak
      with ``chunk_tokens`` to this within 10% (tiny, small).

    Args:
        config: the architecture.
        layer: layer index.
        tokens: tokens of the rank's slice (``batch * T / cp``).
        chunk_tokens: ``memory.recompute_chunk_tokens``.
        cp: context-parallel size (state maps, keys of earlier ranks).
        dtype_bytes, indexer_kl, moe_chunk_tokens, kda_kernel, dsa_kernel,
            expert_load: as :func:`layer_saved_tensors`.

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
    plain = dict(indexer_kl=indexer_kl, tokens=c, moe_chunk_tokens=moe_chunk_tokens, kda_kernel=kda_kernel,
                 dsa_kernel=dsa_kernel, cp_path=cp > 1, expert_load=expert_load)
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


def layer_saved_tensors(config: ModelConfig, layer: int, recompute: str = "none",
                        recompute_modules: Sequence[str] = (), *, dtype_bytes: int = 4,
                        indexer_kl: bool = False, tokens: int = 4096,
                        moe_chunk_tokens: int | None = None, kda_kernel: str = "torch",
                        dsa_kernel: str = "torch", cp: int = 1, recompute_chunk_tokens: int = 16384,
                        expert_load: float | None = None) -> list[SavedTensor]:
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
        kda_kernel: ``torch`` (default) or ``fla`` (see :data:`KDA_KERNELS`).
        dsa_kernel: ``torch`` (default) or ``triton`` (see :data:`DSA_KERNELS`).
        cp: context-parallel size (default 1): the KDA layer takes its CP path (gate and beta in
            torch) and ``chunked`` keeps transitions.
        recompute_chunk_tokens: ``chunked``'s segment (default 16384).
        expert_load: None without expert parallelism (default); under EP the routed-expert rows
            this rank holds over the mean (the imbalance on the busiest rank; see ``_ffn``).

    Returns:
        The :class:`SavedTensor` list; under "full" only the block inputs (``streams [T, m, H]``
        and, on a shared DSA layer, the received indices); under "chunked" those and the
        carried extras.
    """
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    kinds = _resolve_kinds(recompute, recompute_modules)
    a = dtype_bytes
    if recompute == "full":
        out = [SavedTensor("block_input", "streams", cfg.hc_mult * cfg.hidden_size * a)]
        if cfg.layer_types[layer] == INDEXED_ATTENTION and cfg.indexer_types[layer] == "shared":
            out.append(SavedTensor("block_input", "received top-k indices", _index_slots(cfg) * _I64))
        return out
    if recompute == "chunked":
        return chunked_recompute_terms(cfg, layer, tokens, recompute_chunk_tokens, cp=cp, dtype_bytes=a,
                                       indexer_kl=indexer_kl, moe_chunk_tokens=moe_chunk_tokens,
                                       kda_kernel=kda_kernel, dsa_kernel=dsa_kernel,
                                       expert_load=expert_load).saved
    common = dict(indexer_kl=indexer_kl, tokens=tokens, moe_chunk_tokens=moe_chunk_tokens, kda_kernel=kda_kernel,
                  dsa_kernel=dsa_kernel, cp_path=cp > 1,
                  expert_load=expert_load)
    return (_half(cfg, layer, "attention", a, kinds, **common)  # type: ignore[arg-type]
            + _half(cfg, layer, "ffn", a, kinds, **common))  # type: ignore[arg-type]


def outside_saved_tensors(config: ModelConfig, dtype_bytes: int = 4) -> list[SavedTensor]:
    """What the embedding, the final norm and the chunked cross-entropy keep (per token): the
    input ids (int64), the final RMSNorm (:func:`_norm`), the hidden state the loss reads (H),
    the targets (int64), token weights and log-sum-exp (fp32)."""
    H = config.hidden_size
    return [
        SavedTensor("outside", "input ids", _I64),
        *_norm("outside", "final norm", H, dtype_bytes),
        SavedTensor("outside", "loss: hidden, targets, weights, lse", H * dtype_bytes + _I64 + 2 * _F32),
    ]


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
        peak_offloaded_bytes: host pool peak (end of forward): the pinned host memory.
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

    @property
    def saved_bytes(self) -> int:
        """All saved storages at the end of forward (device and host), counting each storage once."""
        return sum(self.by_kind.values())


def activation_estimate(config: ModelConfig, tokens: int, *, recompute: str = "none",
                        recompute_modules: Sequence[str] = (), offload: bool = False,
                        offload_min_bytes: int = 1 << 20, dtype_bytes: int = 4, indexer_kl: bool = False,
                        moe_chunk_tokens: int | None = None, batch: int = 1,
                        kda_kernel: str = "torch", dsa_kernel: str = "torch", cp: int = 1,
                        recompute_chunk_tokens: int = 16384,
                        expert_load: float | None = None) -> ActivationEstimate:
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
    kernels = dict(kda_kernel=kda_kernel, dsa_kernel=dsa_kernel, cp=cp,
                   expert_load=expert_load)
    L = config.num_hidden_layers
    resident: list[int] = []
    offloaded: list[int] = []
    by_kind: dict[str, int] = {}
    plain_by_kind: dict[str, int] = {}
    rebuilt = 0
    for i in range(L):
        items = layer_saved_tensors(config, i, recompute, recompute_modules, dtype_bytes=dtype_bytes,
                                    indexer_kl=indexer_kl, tokens=n, moe_chunk_tokens=moe_chunk_tokens,
                                    recompute_chunk_tokens=recompute_chunk_tokens, **kernels)  # type: ignore[arg-type]
        res = off = 0.0
        for t in items:
            size = t.nbytes(n)
            by_kind[t.kind] = by_kind.get(t.kind, 0) + int(round(size))
            if offload and t.piece_bytes(n) >= offload_min_bytes:
                off += size * t.views
            else:
                res += size
        resident.append(int(round(res)))
        offloaded.append(int(round(off)))
        plain = layer_saved_tensors(config, i, "none", dtype_bytes=dtype_bytes, indexer_kl=indexer_kl,
                                    tokens=n, moe_chunk_tokens=moe_chunk_tokens, **kernels)  # type: ignore[arg-type]
        for t in plain:
            plain_by_kind[t.kind] = plain_by_kind.get(t.kind, 0) + int(round(t.nbytes(n)))
        if recompute != "none":
            if recompute == "full":
                region = sum(t.nbytes(n) for t in plain)
            elif recompute == "chunked":
                terms = chunked_recompute_terms(config, i, n, recompute_chunk_tokens, dtype_bytes=dtype_bytes,
                                                indexer_kl=indexer_kl, moe_chunk_tokens=moe_chunk_tokens,
                                                **kernels)  # type: ignore[arg-type]
                region = terms.rebuilt_bytes + terms.layer_bytes
            else:
                kinds = _resolve_kinds(recompute, recompute_modules)
                region = max([sum(t.nbytes(n) for t in plain if t.kind == k or (k == "dsa" and t.kind == "indexer_kl"))
                              for k in kinds if k != "hc"] + [0])
                if "hc" in kinds:
                    region = max(region, sum(t.nbytes(n) for t in plain if t.kind == "mhc") / 2)
            rebuilt = max(rebuilt, int(round(region)))
    outside = int(round(sum(t.nbytes(n) for t in outside_saved_tensors(config, dtype_bytes))))
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
        tokens=n, layer_resident=resident, layer_offloaded=offloaded, outside_bytes=outside,
        peak_resident_bytes=peak_resident, peak_offloaded_bytes=sum(offloaded), peak_total_bytes=peak_total,
        by_kind=by_kind, rebuilt_bytes=rebuilt, plain_by_kind=plain_by_kind,
    )


# -- communication per training step -----------------------------------------------------------

#: Counting conventions of a :class:`CommRow`. ``payload``: the bytes this rank hands to the
#: collective (for an all-gather its own piece, for an all-reduce the whole buffer), as
#: :func:`genolong.kernels.kda.cp.cp_kda_comm_bytes` and ``conv_halo_comm_bytes`` count.
#: ``received``: the bytes this rank receives from the other ranks, as
#: :func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes` counts (and FSDP here).
PAYLOAD = "payload"
RECEIVED = "received"
#: ``sent``: the bytes this rank sends to the other ranks (point-to-point payload of an
#: all-to-all; rows for the rank itself do not travel), as :func:`ep_comm_bytes` counts.
SENT = "sent"
COMM_CONVENTIONS = (PAYLOAD, RECEIVED, SENT)
#: The parts of :class:`CommEstimate`, in table order.
COMM_PARTS = ("kda", "dsa", "ep", "fsdp")
#: Device line items that do not coexist (the plan counts the largest).
TRANSIENTS = ("MoE dispatch chunk", "MoE all-to-all buffers (busiest rank)", "DSA indexer / top-k / gather buffers",
              "cross-entropy chunk")


@dataclass(frozen=True)
class CommRow:
    """One line of a rank's communication in one training step (forward + backward of
    ``batch_size`` sequences): one kind of collective summed over the layers or FSDP units it runs in.

    Attributes:
        part: ``kda`` and ``dsa`` (the context-parallel collectives of the token mixers, over the
            ``cp`` group), ``ep`` (the MoE all-to-alls over the ``ep`` group) or ``fsdp``
            (parameter all-gathers and gradient reductions, over the ``dp_shard x cp`` shard
            group, the experts units over ``dp_shard x cp / ep``, and across ``dp_replicate``
            replicas).
        name: what travels.
        layers: the layers (or FSDP units) the row sums over.
        convention: :data:`PAYLOAD`, :data:`RECEIVED` or :data:`SENT` (see there); ``forward``, ``recompute``
            and ``backward`` count in it, so that they equal the per-call formulas summed.
        forward: bytes of the forward collectives.
        recompute: bytes of the forward collectives that recomputation runs again in backward
            (the CP collectives sit inside the recomputed mixers; 0 without recompute).
        backward: bytes of the backward collectives.
        wire: bytes this rank sends with ring algorithms (all-gather of a piece ``p``:
            ``(W - 1) p``; all-reduce of a buffer ``N``: ``2 (W - 1) / W * N``; reduce-scatter:
            ``(W - 1) / W * N``, which equals the bytes received): one unit for every row.
    """

    part: str
    name: str
    layers: int
    convention: str
    forward: int
    recompute: int
    backward: int
    wire: int

    @property
    def total(self) -> int:
        """``forward + recompute + backward`` in the row's convention."""
        return self.forward + self.recompute + self.backward


@dataclass
class CommEstimate:
    """Bytes through the collectives of one rank in one training step (see :func:`comm_estimate`).

    Attributes:
        cp, shard_group, dp_replicate: the group sizes the rows assume.
        tokens_per_rank: ``batch * T_local`` tokens of the rank's slices.
        rows: the :class:`CommRow` lines, KDA, then DSA, then EP, then FSDP.
        ep: the expert-parallel size the EP rows assume.
    """

    cp: int
    shard_group: int
    dp_replicate: int
    tokens_per_rank: int
    rows: list[CommRow]
    ep: int = 1

    def part_total(self, part: str) -> int:
        """Per-step bytes of ``part`` (``kda``, ``dsa``, ``ep`` or ``fsdp``) in its rows' convention (one per part)."""
        return sum(r.total for r in self.rows if r.part == part)

    def part_wire(self, part: str) -> int:
        """Per-step ring-algorithm bytes sent for ``part``."""
        return sum(r.wire for r in self.rows if r.part == part)


def _ring_allgather(piece: int, world: int) -> int:
    return (world - 1) * piece


def _ring_allreduce(buffer: int, world: int) -> int:
    return 2 * (world - 1) * buffer // world


def dsa_buffer_bytes(config: ModelConfig, sequence_tokens: int, cp: int, dtype_bytes: int, *,
                     gradients: bool = True) -> int:
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
    tile = INDEXER_TILE * INDEXER_TILE * (cfg.index_n_heads + 3) * 4 + 2 * INDEXER_TILE * (cfg.index_topk // cfg.index_kpool) * 8
    gather = DSA_QUERY_BLOCK * slots * (2 * cfg.kv_lora_rank + 2 * cfg.num_attention_heads) * 4
    allgather = 0.0
    if cp > 1:
        allgather = (2 if gradients else 1) * sequence_tokens * (cfg.kv_lora_rank + cfg.index_head_dim / cfg.index_kpool) * dtype_bytes
    return int(tile + gather + allgather)


def fsdp_units(config: ModelConfig) -> list[int]:
    """Parameters of each FSDP2 unit as :func:`genolong.parallel.apply_fsdp` builds them: one per
    block (in layer order), then the root (embedding, final norm, LM head); they sum to
    :func:`~genolong.model.config.parameter_count` ``.total``."""
    cfg = config
    assert cfg.layer_types is not None and cfg.mlp_layer_types is not None and cfg.indexer_types is not None
    pc = parameter_count(cfg)
    root = pc.embedding + pc.lm_head + cfg.hidden_size
    blocks: list[int] = []
    previous = root
    # a block's count is the difference of two prefixes of the layer schedule (a prefix is a
    # valid config: a shared-indexer layer always follows the full layer it reads)
    for i in range(1, cfg.num_hidden_layers + 1):
        prefix = cfg.replace(num_hidden_layers=i, layer_types=cfg.layer_types[:i],
                             mlp_layer_types=cfg.mlp_layer_types[:i], indexer_types=cfg.indexer_types[:i])
        count = parameter_count(prefix).total
        blocks.append(count - previous)
        previous = count
    return blocks + [root]


def routed_expert_parameters(config: ModelConfig) -> int:
    """Parameters of one MoE layer's routed experts: ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, ``3 E I H`` (``genolong.model.moe.Experts``)."""
    return 3 * config.n_routed_experts * config.moe_intermediate_size * config.hidden_size


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP2 unit as a rank sees it.

    Attributes:
        kind: ``embedding`` (the token embedding), ``block`` (a block; under EP without its
            routed experts), ``experts`` (one MoE layer's ``E / ep`` routed experts of this rank's
            EP group) or ``root`` (final norm and LM head).
        layer: the block's layer index (None for the root).
        params: parameters the unit gathers (its unsharded size on this rank).
        group: ranks it is sharded over (``dp_shard * cp``, or ``dp_shard * cp / ep`` for experts).
    """

    kind: str
    layer: int | None
    params: int
    group: int


def fsdp_unit_groups(config: ModelConfig, shard_group: int = 1, ep: int = 1) -> list[FSDPUnit]:
    """The FSDP2 units in order (the embedding, each block, then under EP its experts unit, then
    the root: final norm and LM head), as :func:`genolong.parallel.apply_fsdp` builds them.

    With expert parallelism (``ep > 1``) each MoE block's routed experts are a separate unit:
    ``E / ep`` experts (``3 E I H / ep`` parameters) sharded over the ``shard_group / ep`` ranks
    left after EP, the rest of the block over all ``shard_group`` ranks. ``ep = 1``: the units of
    :func:`fsdp_units`, each over ``shard_group``.
    """
    cfg = config
    assert cfg.mlp_layer_types is not None
    units = fsdp_units(cfg)
    expert = routed_expert_parameters(cfg)
    embedding = parameter_count(cfg).embedding
    out: list[FSDPUnit] = [FSDPUnit("embedding", None, embedding, shard_group)]
    for i, n in enumerate(units[:-1]):
        if ep > 1 and cfg.mlp_layer_types[i] == "sparse":
            out.append(FSDPUnit("block", i, n - expert, shard_group))
            out.append(FSDPUnit("experts", i, expert // ep, max(shard_group // ep, 1)))
        else:
            out.append(FSDPUnit("block", i, n, shard_group))
    out.append(FSDPUnit("root", None, units[-1] - embedding, shard_group))
    return out


def ep_comm_bytes(config: ModelConfig, tokens: int, ep: int, chunk_tokens: int | None, dtype_bytes: int) -> dict[str, int]:
    """Bytes one rank SENDS through expert parallelism's all-to-alls in one forward and one
    backward, summed over the model's MoE layers (recompute not included: a recomputed MoE runs
    its forward exchanges again, the count exchange included).

    At exactly balanced routing (each rank sends ``c k / ep`` (token, slot) rows to every EP
    rank, itself included; its own rows do not travel), per MoE layer per chunk of ``c`` tokens
    (``chunk_tokens``, the last chunk the remainder; None: the whole slice), top-k ``k``, hidden
    ``H``, ``a = dtype_bytes``, ``E`` routed experts:

    - forward: dispatch ``(ep - 1) c k H a / ep`` (integer division) and combine the same;
    - backward: dispatch and combine reversed, the same two again;
    - splits: before each dispatch, the rows per expert of the receiving rank, ``E / ep`` int64 to
      each of the ``ep - 1`` other ranks (the combine and the backward reuse them).

    :class:`genolong.parallel.expert.AllToAllCounter` measures the same three numbers
    (``forward``, ``backward``, ``splits``); ``benchmarks/ep_step.py`` and
    ``tests/test_expert_parallel.py`` hold them equal to the byte.

    Args:
        config: the architecture (``num_experts_per_tok``, ``hidden_size``, ``n_routed_experts``,
            the MoE layers).
        tokens: tokens of the rank's slice (``batch * T / cp``).
        ep: expert-parallel size (1: nothing travels).
        chunk_tokens: ``memory.moe_chunk_tokens`` or None.
        dtype_bytes: the activation dtype's bytes (2: bf16, 4: fp32).

    Returns:
        ``{"forward": int, "backward": int, "splits": int}``.
    """
    for name, value in (("tokens", tokens), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    assert config.mlp_layer_types is not None
    layers = sum(t == "sparse" for t in config.mlp_layer_types)
    if ep == 1 or layers == 0:
        return {"forward": 0, "backward": 0, "splits": 0}
    c = min(chunk_tokens or tokens, tokens)
    sizes = [c] * (tokens // c) + ([tokens % c] if tokens % c else [])
    row = config.num_experts_per_tok * config.hidden_size * dtype_bytes
    data = sum((ep - 1) * n * row // ep for n in sizes)
    splits = len(sizes) * (ep - 1) * (config.n_routed_experts // ep) * _I64
    return {"forward": layers * 2 * data, "backward": layers * 2 * data, "splits": layers * splits}


def comm_estimate(config: ModelConfig, tokens: int, cp: int, *, batch: int = 1, dtype_bytes: int = 4,
                  recompute: str = "none", recompute_modules: Sequence[str] = (), shard_group: int = 1,
                  dp_replicate: int = 1, ep: int = 1, moe_chunk_tokens: int | None = None) -> CommEstimate:
    """Bytes one rank moves through the collectives in one training step (forward + backward).

    Context parallelism (per layer call, the exact per-call formulas, summed over the layers):

    - KDA layer (:data:`PAYLOAD` convention): :func:`genolong.kernels.kda.cp.cp_kda_comm_bytes`
      (state all-gather forward, all-reduce backward; fp32 states) and
      :func:`~genolong.kernels.kda.cp.conv_halo_comm_bytes` (the short conv's ``kernel - 1`` rows
      of q|k|v, ``3 * heads * head_dim`` channels in the compute dtype, plus the 8-byte length).
    - DSA layer (:data:`RECEIVED` convention): :func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes`,
      the kv latent and, on ``full``-indexer layers only, the pooled index keys (all-gather
      forward, reduce-scatter backward), in the compute dtype. The indexer KL's 8-byte count
      all-reduce per full layer is not counted.
    - Recompute (``full``, or ``selective`` with the mixer's kind) runs a mixer's forward
      collectives again in backward.

    FSDP2 (:data:`RECEIVED` convention; ``S = shard_group`` ranks, per unit of ``n`` parameters
    a shard of ``ceil(n / S)``; the per-parameter padding of FSDP2 is ignored):
    parameter all-gather in forward, ``(S - 1) ceil(n / S) dtype_bytes`` per unit; again in
    backward for the units resharded after forward (every block but the last; the root is not);
    the fp32 gradient reduce-scatter ``(S - 1) ceil(n / S) 4``; with ``dp_replicate = R > 1`` a
    ring all-reduce of the fp32 gradient shard across replicas, ``2 (R - 1) / R ceil(n / S) 4``.

    Args:
        config: the architecture.
        tokens: ``T_local``, tokens of one sequence slice on this rank (``context / cp``).
        cp: the context-parallel group size (1: no CP rows are non-zero).
        batch: sequences per step on this rank (default 1).
        dtype_bytes: bytes of the compute dtype (4: fp32, 2: bf16; FSDP's parameter dtype).
        recompute, recompute_modules: as :func:`activation_estimate`.
        shard_group: FSDP ranks sharing one sharded copy (``dp_shard * cp``; 1: no FSDP).
        dp_replicate: replicas (HSDP; default 1).
        ep: expert-parallel size (default 1). With ``ep > 1``: an EP row (:data:`SENT`,
            :func:`ep_comm_bytes`; recompute of the MoE repeats its forward pair) and the expert
            units' FSDP rows over ``shard_group / ep`` ranks (:func:`fsdp_unit_groups`).
        moe_chunk_tokens: ``memory.moe_chunk_tokens`` (one all-to-all pair per chunk).

    Returns:
        A :class:`CommEstimate` (bytes per rank per step, integers).

    Raises:
        InputError: non-positive sizes, a bad dtype or recompute setting.
    """
    for name, value in (("tokens", tokens), ("cp", cp), ("batch", batch), ("shard_group", shard_group),
                        ("dp_replicate", dp_replicate), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if dtype_bytes not in (2, 4):
        raise InputError(f"dtype_bytes must be 4 (fp32) or 2 (bf16), got {dtype_bytes!r}")
    kinds = _resolve_kinds(recompute, recompute_modules)
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    n_kda = sum(t == LINEAR_ATTENTION for t in cfg.layer_types)
    n_full = sum(t == INDEXED_ATTENTION and i == "full" for t, i in zip(cfg.layer_types, cfg.indexer_types))
    n_shared = sum(t == INDEXED_ATTENTION and i == "shared" for t, i in zip(cfg.layer_types, cfg.indexer_types))
    redo_kda = recompute in _BLOCK_RECOMPUTE or "kda" in kinds
    redo_dsa = recompute in _BLOCK_RECOMPUTE or "dsa" in kinds
    redo_moe = recompute in _BLOCK_RECOMPUTE or "moe" in kinds
    compute = dtype_bytes  # element bytes of the compute dtype: fp32 4, bf16 2
    rows: list[CommRow] = []

    def payload_row(name: str, layers: int, call: dict[str, int], redo: bool) -> CommRow:
        # forward calls are all-gathers of the rank's piece, backward calls all-reduces of W pieces
        fwd, bwd = layers * call["forward"], layers * call["backward"]
        rec = fwd if redo else 0
        wire = _ring_allgather(fwd + rec, cp) + _ring_allreduce(bwd, cp)
        return CommRow("kda", name, layers, PAYLOAD, fwd, rec, bwd, wire)

    heads, d = cfg.linear_num_heads, cfg.linear_head_dim
    # the counts of cp_kda_comm_bytes / conv_halo_comm_bytes, from their torch-free arithmetic
    state = kda_state_payload(batch, heads, d, d, cp, 4)  # the mixer runs KDA on fp32 q, k, v
    halo = conv_halo_payload(batch, 3 * heads * d, cfg.linear_conv_kernel_dim, cp, compute)
    rows.append(payload_row("KDA state all-gather fwd / all-reduce bwd (cp_kda_comm_bytes)", n_kda, state, redo_kda))
    rows.append(payload_row("KDA short-conv halo (conv_halo_comm_bytes)", n_kda, halo, redo_kda))
    for name, layers, full in (("DSA latent + pooled index keys, full-indexer layers", n_full, True),
                               ("DSA latent, shared-indexer layers", n_shared, False)):
        call = cp_dsa_comm_bytes(cfg, batch, tokens, cp, full_indexer=full, dtype_bytes=dtype_bytes)
        fwd, bwd = layers * call["forward"], layers * call["backward"]
        rec = fwd if redo_dsa else 0
        # received bytes of an all-gather / reduce-scatter are what a ring sends
        rows.append(CommRow("dsa", name + " (cp_dsa_comm_bytes)", layers, RECEIVED, fwd, rec, bwd, fwd + rec + bwd))

    if ep > 1:
        if shard_group % ep:
            raise InputError(f"parallel.ep = {ep} does not divide the shard group dp_shard x cp = {shard_group}")
        call = ep_comm_bytes(cfg, batch * tokens, ep, moe_chunk_tokens, dtype_bytes)
        n_moe = sum(t == "sparse" for t in (cfg.mlp_layer_types or ()))
        forward = call["forward"] + call["splits"]
        rec = forward if redo_moe else 0
        rows.append(CommRow("ep", "EP dispatch + combine all-to-all, split sizes (ep_comm_bytes)", n_moe, SENT,
                            forward, rec, call["backward"], forward + rec + call["backward"]))

    S, R = shard_group, dp_replicate
    all_units = fsdp_unit_groups(cfg, S, ep)
    last_block = cfg.num_hidden_layers - 1
    p_dtype = "bf16" if dtype_bytes == 2 else "fp32"
    for kind, label in (("dense", ""), ("experts", "experts ")):
        units = [u for u in all_units if (u.kind == "experts") == (kind == "experts")]
        if not units:
            continue
        G = units[0].group
        shards = [math.ceil(u.params / u.group) for u in units]
        # every unit but the last block's (and its experts) is resharded after forward; the root is not
        resharded = [sh for u, sh in zip(units, shards) if u.kind != "root" and u.layer != last_block]
        gather_fwd = sum((u.group - 1) * sh * dtype_bytes for u, sh in zip(units, shards))
        gather_bwd = sum((G - 1) * sh * dtype_bytes for sh in resharded)
        reduce = sum((u.group - 1) * sh * _F32 for u, sh in zip(units, shards))
        over = f", over {G}" if kind == "experts" else ""
        rows.append(CommRow("fsdp", f"FSDP {label}parameter all-gather fwd ({p_dtype}{over})", len(units), RECEIVED,
                            gather_fwd, 0, 0, gather_fwd))
        rows.append(CommRow("fsdp", f"FSDP {label}parameter all-gather bwd, resharded units ({p_dtype}{over})",
                            len(resharded), RECEIVED, 0, 0, gather_bwd, gather_bwd))
        rows.append(CommRow("fsdp", f"FSDP {label}gradient reduce-scatter (fp32{over})", len(units), RECEIVED, 0, 0,
                            reduce, reduce))
        if R > 1:
            replicas = sum(_ring_allreduce(sh * _F32, R) for sh in shards)
            rows.append(CommRow("fsdp", f"HSDP {label}gradient all-reduce across replicas (fp32, ring)", len(units),
                                RECEIVED, 0, 0, replicas, replicas))
    return CommEstimate(cp=cp, shard_group=S, dp_replicate=R, tokens_per_rank=batch * tokens, rows=rows, ep=ep)


# -- the plan --------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Per-GPU memory plan of a recipe on a cluster (see :func:`plan`; :func:`format_plan` prints it).

    Attributes:
        recipe: the recipe's name.
        model: a one-line description of the architecture.
        gpus, gpus_per_node, nodes: the cluster.
        cp, dp_shard, dp_replicate: the mesh; ``shard_group = cp * dp_shard`` ranks share one
            sharded copy of parameters, gradients and optimizer state.
        tokens_per_rank: ``batch_size * context / cp``.
        precision, recompute, recompute_modules, offload, moe_chunk_tokens, ce_chunk_tokens:
            the recipe's settings the plan used.
        parameters: total parameters of the model.
        device: bytes per GPU by line item (parameters, gradients, optimizer, fsdp working
            copies, saved activations, rebuilt activations, activation gradients, MoE dispatch,
            DSA buffers, cross-entropy chunk, workspace), in print order.
        transient_peak: which of the mutually exclusive transients (MoE dispatch, DSA buffers,
            cross-entropy chunk) the total counts (the largest).
        activations_by_kind: saved activation bytes (device + host) by part of the model, under
            the recipe's recompute.
        plain_by_kind: the same without recompute (what recomputation rebuilds, layer by layer).
        device_total: the predicted peak per GPU; gpu_mem: the budget (bytes).
        host_per_gpu, host_per_node: pinned host memory for offloaded activations; host_mem:
            the per-node budget (bytes) or None (not checked).
        fits_device, fits_host, fits: the verdict.
        comm: bytes through the collectives per rank per training step (:func:`comm_estimate`):
            KDA and DSA context-parallel rows and FSDP rows, each in its stated convention.
        suggestion: the cheapest change that fits, as ``--set`` overrides (and ``--gpus N`` when
            it needs more GPUs); empty when the plan fits or nothing tried fits.
        suggestion_total: the predicted per-GPU total after the suggestion (None if none).
        assumptions: the assumptions the numbers rest on, most important first.
        ep: expert-parallel size; experts_per_rank: routed experts of each MoE layer a rank
            holds (``n_routed_experts / ep``); expert_shard_group: ranks an experts unit is
            FSDP-sharded over (``shard_group / ep``).
        kernel_backend, kda_kernel, dsa_kernel: the model's backend and the kernels it counts.
        recompute_chunk_tokens: ``chunked``'s piece (None for the other modes).
        rebuilt_region: which region the rebuilt line is (chunked: the half).
    """

    recipe: str
    model: str
    gpus: int
    gpus_per_node: int
    nodes: int
    cp: int
    dp_shard: int
    dp_replicate: int
    shard_group: int
    tokens_per_rank: int
    precision: str
    recompute: str
    recompute_modules: tuple[str, ...]
    offload: bool
    moe_chunk_tokens: int | None
    ce_chunk_tokens: int
    parameters: int
    device: dict[str, int]
    transient_peak: str
    activations_by_kind: dict[str, int]
    plain_by_kind: dict[str, int]
    device_total: int
    gpu_mem: int
    host_per_gpu: int
    host_per_node: int
    host_mem: int | None
    fits_device: bool
    fits_host: bool
    fits: bool
    comm: CommEstimate
    suggestion: list[str] = field(default_factory=list)
    suggestion_total: int | None = None
    assumptions: list[str] = field(default_factory=list)
    ep: int = 1
    experts_per_rank: int = 0
    expert_shard_group: int = 1
    kernel_backend: str = "torch"
    kda_kernel: str = "torch"
    dsa_kernel: str = "torch"
    recompute_chunk_tokens: int | None = None
    rebuilt_region: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field (bytes as integers) for ``genolong plan --json``."""
        out = dataclasses.asdict(self)
        out["recompute_modules"] = list(self.recompute_modules)
        out["comm"]["totals"] = {part: self.comm.part_total(part) for part in COMM_PARTS}
        out["comm"]["wire_totals"] = {part: self.comm.part_wire(part) for part in COMM_PARTS}
        out["comm"]["conventions"] = {"kda": PAYLOAD, "dsa": RECEIVED, "ep": SENT, "fsdp": RECEIVED}
        return out


def _model_config(recipe: Recipe) -> ModelConfig:
    """The recipe's architecture without needing the checkpoint on disk: its config.json when it
    is there, else the preset (``model.preset`` names the geometry for this purpose)."""
    ckpt = recipe.model.checkpoint
    if ckpt is not None and (ckpt / "config.json").is_file():
        return recipe.model_config()
    if recipe.model.preset is None:
        raise InputError(f"model.checkpoint {str(ckpt)!r} has no config.json and model.preset is not set; "
                         "set model.preset to the checkpoint's geometry (e.g. glm-5.3-flash) to plan before downloading it")
    return ModelConfig.from_preset(recipe.model.preset, **dict(recipe.model.overrides))


def _largest_unit(cfg: ModelConfig, ep: int = 1) -> int:
    """Parameters of the largest FSDP unit a rank gathers (:func:`fsdp_unit_groups`): the
    embedding, a block (under EP without its routed experts), one MoE layer's ``E / ep`` experts,
    or the root (LM head and final norm)."""
    return max(u.params for u in fsdp_unit_groups(cfg, 1, ep))


def _check_positive(name: str, value: Any, kind: type = float, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}")


def _describe(cfg: ModelConfig, count: int) -> str:
    moe = sum(1 for t in (cfg.mlp_layer_types or ()) if t == "sparse")
    return (f"{format_count(count)} params, {cfg.num_hidden_layers} layers ({cfg.pattern.count('K')} KDA + "
            f"{cfg.pattern.count('D')} DSA, {moe} MoE x {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}), "
            f"hidden {cfg.hidden_size}, mHC x {cfg.hc_mult}")


def _mesh_sizes(par: Any, cfg: ModelConfig, gpus: int) -> tuple[int, int, int, int, int, int]:
    """``(cp, dp_replicate, ep, dp_shard, dp_shard x cp, MoE layers)`` of the recipe's ``parallel``
    section on ``gpus`` processes (``dp_shard`` is what is left of them), checked.

    Raises:
        InputError: ``gpus`` not divisible by ``cp x dp_replicate``, or ``ep`` not dividing
            ``dp_shard x cp`` or the model's routed experts.
    """
    cp, rep, ep = par.cp, par.dp_replicate, par.ep
    if gpus % (cp * rep):
        raise InputError(f"--gpus {gpus} is not divisible by parallel.cp x parallel.dp_replicate = {cp * rep}; "
                         f"use a multiple of {cp * rep}")
    dp_shard = gpus // (cp * rep)
    shard = dp_shard * cp
    if shard % ep:
        raise InputError(f"parallel.ep = {ep} does not divide dp_shard x cp = {dp_shard} x {cp} = {shard} on {gpus} GPUs; "
                         f"choose ep among the divisors of {shard}")
    assert cfg.mlp_layer_types is not None and cfg.layer_types is not None
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    if ep > 1 and (moe_layers == 0 or cfg.n_routed_experts % ep):
        raise InputError(f"parallel.ep = {ep} does not divide the model's n_routed_experts = {cfg.n_routed_experts}; "
                         "choose ep among its divisors")
    return cp, rep, ep, dp_shard, shard, moe_layers


def _plan_once(recipe: Recipe, cfg: ModelConfig, gpus: int, gpu_mem_gib: float, host_mem_gib: float | None,
               gpus_per_node: int, moe_imbalance: float | None, kda_kernel: str, dsa_kernel: str = "torch") -> Plan:
    par, mem = recipe.parallel, recipe.memory
    moe_imbalance, imbalance_source = recipe_moe_imbalance(recipe, moe_imbalance)
    cp, rep, ep, dp_shard, shard, moe_layers = _mesh_sizes(par, cfg, gpus)
    context = recipe.data.context
    if context % cp:
        raise InputError(f"data.context {context} is not divisible by parallel.cp {cp}")
    tokens = recipe.data.batch_size * context // cp
    bf16 = recipe.train.precision == "bf16-mixed"
    a = 2 if bf16 else 4
    H, m = cfg.hidden_size, cfg.hc_mult
    count = parameter_count(cfg).total

    # parameters, gradients, AdamW state: fp32, sharded over the shard group (ceil: uneven shards);
    # under EP an experts unit holds E / ep experts over shard / ep ranks: the same share per rank
    per_rank = math.ceil(count / shard)
    device: dict[str, int] = {
        "parameters (fp32 master, sharded)": 4 * per_rank,
        "gradients (fp32, sharded)": 4 * per_rank,
        "AdamW moments (2 x fp32, sharded)": 8 * per_rank,
    }
    unit = _largest_unit(cfg, ep)
    working = 0
    if shard > 1 or bf16:
        working = 2 * unit * a + (unit * 4 if shard > 1 else 0)
    device["FSDP unsharded params (2 units) + grad (1 unit)"] = working

    # under EP the busiest rank holds moe_imbalance x the mean (token, slot) rows of its experts
    expert_load = moe_imbalance if ep > 1 else None
    act = activation_estimate(cfg, context // cp, recompute=mem.recompute, recompute_modules=mem.recompute_modules,
                              offload=mem.offload, offload_min_bytes=mem.offload_min_bytes, dtype_bytes=a,
                              indexer_kl=True, moe_chunk_tokens=mem.moe_chunk_tokens, batch=recipe.data.batch_size,
                              kda_kernel=kda_kernel, dsa_kernel=dsa_kernel, cp=cp,
                              recompute_chunk_tokens=mem.recompute_chunk_tokens,
                              expert_load=expert_load)
    device["saved activations (resident peak)"] = act.peak_resident_bytes
    rebuilt_region = ""
    if mem.recompute == "chunked":
        regions = [chunked_recompute_terms(cfg, i, tokens, mem.recompute_chunk_tokens, cp=cp, dtype_bytes=a, indexer_kl=True,
                                           moe_chunk_tokens=mem.moe_chunk_tokens, kda_kernel=kda_kernel,
                                           dsa_kernel=dsa_kernel,
                                           expert_load=expert_load)
                   for i in range(cfg.num_hidden_layers)]
        rebuilt_region = max(regions, key=lambda r: r.rebuilt_bytes + r.layer_bytes).rebuilt_region
        device[f"rebuilt activations (chunked: {rebuilt_region}, + the layer's carried states / keys)"] = act.rebuilt_bytes
    else:
        device["rebuilt activations (largest recomputed region)"] = act.rebuilt_bytes
    device["activation gradients in flight (3 x streams)"] = 3 * tokens * m * H * a

    # transients that do not coexist: the largest counts
    moe_bytes = 0
    if moe_layers:
        c = min(mem.moe_chunk_tokens or tokens, tokens)
        k = cfg.num_experts_per_tok
        # the busiest rank's rows: in (H), out (H) and the expert's intermediate (3I), at the imbalance
        moe_bytes = int(moe_imbalance * c * k * (2 * H + 3 * cfg.moe_intermediate_size) * a)
        if ep > 1:  # and the rank's own (token, slot) rows: the dispatch send and the combine receive buffers
            moe_bytes += 2 * c * k * H * a
    # the whole sequence's latent and pooled index keys under CP, and their gradients
    dsa_bytes = dsa_buffer_bytes(cfg, recipe.data.batch_size * context, cp, a, gradients=True)
    ce = min(mem.ce_chunk_tokens, tokens)
    ce_bytes = ce * cfg.vocab_size * (2 * 4 + a)
    moe_name = "MoE all-to-all buffers (busiest rank)" if ep > 1 else "MoE dispatch chunk"
    transients = {moe_name: moe_bytes, "DSA indexer / top-k / gather buffers": dsa_bytes,
                  "cross-entropy chunk": ce_bytes}
    peak_name = max(transients, key=lambda k: transients[k])
    for name, value in transients.items():
        device[name] = value
    subtotal = sum(v for k, v in device.items() if k not in transients) + transients[peak_name]
    device["workspace (context, NCCL, fragmentation)"] = int(WORKSPACE_BYTES + FRAGMENTATION * subtotal)
    total = subtotal + device["workspace (context, NCCL, fragmentation)"]

    gpu_mem = int(gpu_mem_gib * GIB)
    per_node = min(gpus_per_node, gpus)
    host_gpu = act.peak_offloaded_bytes
    host_node = host_gpu * per_node
    host_mem = None if host_mem_gib is None else int(host_mem_gib * GIB)
    fits_device = total <= gpu_mem
    fits_host = host_mem is None or host_node <= host_mem
    backend = cfg.kernel_backend
    if kda_kernel == "torch":
        kda_note = "(genolong's torch kernels: validated against ActivationMeter within 10% on tiny/small, fp32)"
    else:
        kda_note = ("(fla-core's ChunkKDAFunction save set, read from fla/ops/kda/chunk.py save_for_backward: "
                    "q, k, v, g_cumsum, g, beta, Aqk, Akk fp32; not runnable on CPU, so not metered)")
    dsa_note = ("DSA kernels 'triton' (genolong's Triton kernels: metered on CPU under TRITON_INTERPRET=1)"
                if dsa_kernel == "triton" else "DSA kernels 'torch'")
    recompute_note = (f"recompute {mem.recompute}" + (f" ({', '.join(mem.recompute_modules or DEFAULT_SELECTIVE)})"
                      if mem.recompute == 'selective' else "")
                      + ": the largest recomputed region is rebuilt whole during its backward (MoE chunks do not bound it)")
    if mem.recompute == "chunked":
        recompute_note = (f"recompute chunked ({mem.recompute_chunk_tokens:,} tokens): saved per layer the block input "
                          "streams only (as full; metered); during one layer's backward its carried extras (KDA: conv tail "
                          "and fp32 state per segment boundary, + state maps under CP; DSA: kv latent and pooled keys up to "
                          "the slice's end) and one feed-forward chunk with the mid-block streams [T, m, H], or one "
                          "attention segment, at a time (chunked_recompute_terms; the backward-peak slopes in T and in the "
                          "chunk are held to measurement on tiny/small)")
    assumptions = [
        f"saved activations from formulas over the config, {tokens:,} tokens per rank, kernel_backend {backend!r}: "
        f"KDA chunk kernel {kda_kernel!r} " + kda_note + f"; {dsa_note}"
        + ("; 'auto' counted as on a CUDA machine with Triton and fla-core >= 0.5.2 (resolve_auto -> 'triton')"
           if backend == "auto" and kda_kernel != "torch" else "")
        + "; bf16 sizes assume bf16 compute with the layers' fp32 parts kept fp32",
        f"parameters, gradients and AdamW state fp32 (16 B/param) sharded over cp x dp_shard = {shard} ranks (FSDP2); "
        f"2 unsharded units in {'bf16' if bf16 else 'fp32'} + 1 unsharded fp32 gradient in flight (the largest unit: "
        f"{format_count(unit)} params)",
        recompute_note,
        "offload: every saved tensor of at least offload_min_bytes goes to pinned host memory, one host copy per "
        "distinct view autograd saves; two layers are back on the device in backward (prefetch)" if mem.offload
        else "offload off: all saved activations stay on the device",
        f"MoE dispatch buffer for the busiest GPU at {moe_imbalance:g} x the mean load ({imbalance_source})"
        + (f"; expert parallelism ep {ep}: {cfg.n_routed_experts // ep} experts per rank, each MoE layer's experts an "
           f"FSDP unit over {shard // ep} ranks; the busiest rank's expert activations at {moe_imbalance:g} x, plus its own "
           "dispatch-send and combine-receive rows" if ep > 1 else ""),
        "DSA under CP all-gathers the whole sequence's kv latent and pooled index keys (and their gradients)",
        f"workspace {format_bytes(WORKSPACE_BYTES)} + {FRAGMENTATION:.0%} fragmentation; the largest of MoE dispatch, "
        "DSA buffers and the cross-entropy chunk counts (they do not overlap)",
        "indexer KL on (the trainer computes it); batch_size sequences per rank"
        + "; mHC mixing weights (normalisation, Sinkhorn) rebuilt in backward, only pre kept (HyperConnection.recompute_weights)",
        "communication per rank per training step (one forward + backward, accumulate_grad_batches = 1): KDA rows "
        "count the payload each rank hands to the collective (cp_kda_comm_bytes, conv_halo_comm_bytes), DSA and FSDP "
        "rows the bytes each rank receives (cp_dsa_comm_bytes; FSDP per unit (S-1) x ceil(n/S)), EP rows the bytes each "
        "rank sends at balanced routing (ep_comm_bytes); the wire column converts every row to bytes sent with ring "
        "algorithms; recompute repeats the mixers' (and the MoE's) forward collectives",
    ]
    comm = comm_estimate(cfg, context // cp, cp, batch=recipe.data.batch_size, dtype_bytes=a, recompute=mem.recompute,
                         recompute_modules=mem.recompute_modules, shard_group=shard, dp_replicate=rep, ep=ep,
                         moe_chunk_tokens=mem.moe_chunk_tokens)
    return Plan(
        recipe=recipe.name, model=_describe(cfg, count), gpus=gpus, gpus_per_node=gpus_per_node,
        nodes=math.ceil(gpus / gpus_per_node), cp=cp, dp_shard=dp_shard, dp_replicate=rep, shard_group=shard,
        tokens_per_rank=tokens, precision=recipe.train.precision, recompute=mem.recompute,
        recompute_modules=tuple(mem.recompute_modules), offload=mem.offload, moe_chunk_tokens=mem.moe_chunk_tokens,
        ce_chunk_tokens=mem.ce_chunk_tokens, parameters=count, device=device, transient_peak=peak_name,
        activations_by_kind=act.by_kind, plain_by_kind=act.plain_by_kind, device_total=int(total), gpu_mem=gpu_mem, host_per_gpu=host_gpu,
        host_per_node=host_node, host_mem=host_mem, fits_device=fits_device, fits_host=fits_host,
        fits=fits_device and fits_host, comm=comm, assumptions=assumptions, ep=ep,
        experts_per_rank=cfg.n_routed_experts // ep if moe_layers else 0, expert_shard_group=shard // ep,
        kernel_backend=backend, kda_kernel=kda_kernel, dsa_kernel=dsa_kernel,
        recompute_chunk_tokens=mem.recompute_chunk_tokens if mem.recompute == "chunked" else None,
        rebuilt_region=rebuilt_region,
    )


def _candidates(recipe: Recipe, cfg: ModelConfig, gpus: int) -> list[tuple[list[str], int]]:
    """Changes to try, cheapest first: (``--set`` overrides, gpus)."""
    mem, par = recipe.memory, recipe.parallel
    out: list[tuple[list[str], int]] = []
    if mem.recompute == "none":
        out.append((["memory.recompute=selective", "memory.recompute_modules=[attn,hc]"], gpus))
    if mem.recompute != "full":
        if mem.recompute == "selective":
            kinds = _resolve_kinds("selective", mem.recompute_modules)
            if not {"moe", "mlp"} <= kinds:
                mods = sorted(set(mem.recompute_modules or DEFAULT_SELECTIVE) | {"ffn"})
                out.append(([f"memory.recompute_modules=[{','.join(mods)}]"], gpus))
    # (a selective recipe's module list must go with it: the key applies to selective only)
    clear = ["memory.recompute_modules=[]"] if mem.recompute_modules else []
    if mem.recompute not in _BLOCK_RECOMPUTE:
        out.append((["memory.recompute=full", *clear], gpus))
    if mem.recompute != "chunked":  # the same work as full, the rebuilt region bounded by the chunk
        out.append((["memory.recompute=chunked", *clear], gpus))
    if not mem.offload:
        out.append((["memory.offload=true"], gpus))
    tokens = recipe.data.batch_size * recipe.data.context // par.cp
    assert cfg.mlp_layer_types is not None
    if "sparse" in cfg.mlp_layer_types and gpus % (par.cp * par.dp_replicate) == 0:
        # expert parallelism: E / ep experts per rank, the experts unit sharded over the rest
        fold = gpus // par.dp_replicate
        for ep in range(par.ep + 1, min(fold, cfg.n_routed_experts) + 1):
            if fold % ep == 0 and cfg.n_routed_experts % ep == 0:
                out.append(([f"parallel.ep={ep}"], gpus))
    if "sparse" in cfg.mlp_layer_types:
        chunk = min(mem.moe_chunk_tokens or tokens, tokens)
        if chunk > 1024:
            out.append(([f"memory.moe_chunk_tokens={chunk // 4}"], gpus))
    if mem.ce_chunk_tokens > 512:
        out.append(([f"memory.ce_chunk_tokens={mem.ce_chunk_tokens // 4}"], gpus))
    cp = par.cp
    for factor in (2, 4, 8):
        new = cp * factor
        if recipe.data.context % kernel_multiple(cfg, new) == 0 and gpus % (new * par.dp_replicate) == 0:
            out.append(([f"parallel.cp={new}", "parallel.dp_shard=-1"], gpus))
    for factor in (2, 4):  # more GPUs: a larger FSDP group shards parameters and optimizer state thinner
        out.append((["parallel.dp_shard=-1"], gpus * factor))
    return out


def recipe_moe_imbalance(recipe: Recipe, override: float | None = None) -> tuple[float, str]:
    """The busiest expert's (and EP rank's) load over the mean that the plan sizes the MoE
    dispatch for, and where it comes from: ``override`` (``--moe-imbalance``) when given, else
    the recipe's ``memory.moe_imbalance`` (default 4.0, the reference's figure), capped by
    ``memory.moe_capacity_factor`` when that is set (the capacity drops the rows over it)."""
    if override is not None:
        return float(override), "--moe-imbalance"
    mem = recipe.memory
    if mem.moe_capacity_factor is not None and mem.moe_capacity_factor < mem.moe_imbalance:
        return float(mem.moe_capacity_factor), "memory.moe_capacity_factor: rows over it are dropped"
    source = "memory.moe_imbalance" + (", the reference's figure" if mem.moe_imbalance == 4.0 else "")
    return float(mem.moe_imbalance), source


def _with_gpus(overrides: list[str], gpus: int, gpus_per_node: int) -> list[str]:
    devices = min(gpus, gpus_per_node)
    return [*overrides, f"parallel.devices={devices}", f"parallel.num_nodes={math.ceil(gpus / devices)}"]


def plan(recipe: Recipe, gpus: int | None = None, gpu_mem_gib: float = 80.0, host_mem_gib: float | None = None,
         gpus_per_node: int = 8, moe_imbalance: float | None = None, *, kda_kernel: str | None = None,
         dsa_kernel: str | None = None) -> Plan:
    """Plan a recipe's memory per GPU and per node; suggest the cheapest change when it does not fit.

    Args:
        recipe: a loaded :class:`~genolong.config.Recipe` (its architecture comes from the
            checkpoint's config.json when present, else from ``model.preset``).
        gpus: GPUs in all (default: the recipe's ``devices x num_nodes``); ``dp_shard`` becomes
            ``gpus / (cp * dp_replicate)``.
        gpu_mem_gib: device memory per GPU in GiB (default 80).
        host_mem_gib: host RAM per node in GiB for the pinned offload pool, or None (not checked).
        gpus_per_node: GPUs per node (default 8).
        moe_imbalance: busiest-GPU MoE load over the mean (default None: the recipe's, see
            :func:`recipe_moe_imbalance`).
        kda_kernel: KDA chunk kernel whose saved tensors count: ``torch`` or ``fla`` (default
            None: what the model's ``kernel_backend`` runs on the recipe's accelerator,
            :func:`backend_kernels`; ``auto`` on a GPU recipe is fla's ``chunk_kda``).
        dsa_kernel: ``torch`` or ``triton`` (default None: from the backend, as ``kda_kernel``).

    Returns:
        A :class:`Plan`. When it does not fit, ``suggestion`` holds the first change of a
        cost-ordered list (selective recompute, more modules, full recompute, chunked recompute,
        offload, expert parallelism, smaller MoE chunks, smaller cross-entropy chunks, larger CP,
        more GPUs) that fits on its own, trying the changes that keep the mesh and the GPUs first,
        alone, then the shortest prefix of them together; then a larger CP or more GPUs alone;
        else the shortest prefix of the whole list applied together that fits.

    Raises:
        InputError: a non-positive or non-integer size, gpus not divisible by the mesh, a
            recipe whose architecture cannot be resolved.
    """
    if not isinstance(recipe, Recipe):
        raise InputError(f"plan needs a Recipe (genolong.config.load_recipe), got {type(recipe).__name__}")
    _check_positive("--gpus", gpus, int, allow_none=True)
    _check_positive("--gpu-mem", gpu_mem_gib)
    _check_positive("--host-mem", host_mem_gib, allow_none=True)
    _check_positive("--gpus-per-node", gpus_per_node, int)
    _check_positive("moe_imbalance", moe_imbalance, allow_none=True)
    if moe_imbalance is not None and moe_imbalance < 1:
        raise InputError(f"moe_imbalance is the busiest GPU's load over the mean and must be >= 1, got {moe_imbalance}")
    cfg = _model_config(recipe)
    default_kda, default_dsa = backend_kernels(cfg.kernel_backend, recipe.parallel.accelerator)
    kernel = default_kda if kda_kernel is None else kda_kernel
    dsa = default_dsa if dsa_kernel is None else dsa_kernel
    if kernel not in KDA_KERNELS:
        raise InputError(f"kda_kernel {kernel!r} is unknown; choose one of {', '.join(KDA_KERNELS)}")
    if dsa not in DSA_KERNELS:
        raise InputError(f"dsa_kernel {dsa!r} is unknown; choose one of {', '.join(DSA_KERNELS)}")
    world = recipe.parallel.world_size if gpus is None else gpus
    base = _plan_once(recipe, cfg, world, gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance, kernel, dsa)
    if base.fits:
        return base
    data = recipe.to_dict()

    def attempt(overrides: list[str], n: int) -> Plan | None:
        try:
            changed = parse_recipe(data, _with_gpus(overrides, n, gpus_per_node))
            return _plan_once(changed, cfg, n, gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance, kernel, dsa)
        except InputError:
            return None

    candidates = _candidates(recipe, cfg, world)
    # the settings that keep the mesh and the GPUs (recompute, offload, EP, chunks) are cheaper than
    # a larger CP or more GPUs: try each of them, then them together, before the mesh changes
    cheap = [c for c in candidates if c[1] == world and not any(o.startswith("parallel.cp=") for o in c[0])]
    mesh = [c for c in candidates if c not in cheap]

    def fits(overrides: list[str], n: int) -> bool:
        """Plan with ``overrides`` on ``n`` GPUs; when it fits, record it as the suggestion."""
        result = attempt(overrides, n)
        if result is None or not result.fits:
            return False
        base.suggestion = overrides + ([f"--gpus {n}"] if n != world else [])
        base.suggestion_total = result.device_total
        return True

    def first_single(options: list[tuple[list[str], int]]) -> bool:
        return any(fits(overrides, n) for overrides, n in options)

    def first_prefix(options: list[tuple[list[str], int]]) -> bool:
        merged: dict[str, str] = {}
        n = world
        for overrides, m in options:
            for item in overrides:
                merged[item.split("=", 1)[0]] = item
            n = max(n, m)
            if fits(list(merged.values()), n):
                return True
        return False

    if not (first_single(cheap) or first_prefix(cheap) or first_single(mesh)):
        first_prefix(candidates)
    return base


def _cell(nbytes: float) -> str:
    """A table cell's bytes in the unit that fits (:func:`genolong.units.format_bytes`; ``0`` for nothing)."""
    return format_bytes(nbytes, zero="0")


def format_plan(plan: Plan) -> str:
    """The plan as a text table: cluster and settings, device memory per GPU by line item, the
    saved activations by part, communication per rank per step (KDA / DSA / FSDP), pinned host memory, the verdict, the suggestion and the assumptions."""
    p = plan
    lines = [
        f"plan: {p.recipe} -- {p.model}",
        f"cluster: {p.gpus} GPUs = {p.nodes} nodes x {min(p.gpus_per_node, p.gpus)}; mesh cp {p.cp} x dp_shard {p.dp_shard}"
        f" x dp_replicate {p.dp_replicate} (parameters sharded over {p.shard_group})"
        + (f"; ep {p.ep} ({p.experts_per_rank} experts per rank, experts sharded over {p.expert_shard_group})"
           if p.ep > 1 else "; ep 1"),
        f"per rank: {p.tokens_per_rank:,} tokens; {p.precision}; recompute {p.recompute}"
        + (f" ({', '.join(p.recompute_modules) or 'default'})" if p.recompute == "selective" else "")
        + (f" ({p.recompute_chunk_tokens:,} tokens)" if p.recompute == "chunked" else "")
        + f"; offload {'on' if p.offload else 'off'}; MoE chunk {p.moe_chunk_tokens or 'all'}; CE chunk {p.ce_chunk_tokens}",
        f"kernels: backend {p.kernel_backend!r} -> KDA {p.kda_kernel}, DSA {p.dsa_kernel}",
        "",
        "| device memory per GPU | size |",
        "|---|---:|",
    ]
    for name, value in p.device.items():
        note = ""
        if name in TRANSIENTS:
            note = " (counted: largest transient)" if name == p.transient_peak else " (not counted: overlaps)"
        lines.append(f"| {name}{note} | {_cell(value)} |")
    lines.append(f"| **total (peak)** | **{_cell(p.device_total)}** of {_cell(p.gpu_mem)} |")
    n = p.tokens_per_rank
    lines += ["", "| activations by part, all layers | saved per token | saved | without recompute: per token | all |",
              "|---|---:|---:|---:|---:|"]
    if p.ep > 1:
        lines.insert(len(lines) - 2, "(moe: the busiest EP rank, its routed-expert rows at the imbalance)")
    kinds = sorted(set(p.activations_by_kind) | set(p.plain_by_kind), key=lambda k: -p.plain_by_kind.get(k, 0))
    for kind in kinds:
        saved, plain = p.activations_by_kind.get(kind, 0), p.plain_by_kind.get(kind, 0)
        lines.append(f"| {kind} | {_cell(saved / n)} | {_cell(saved)} | {_cell(plain / n)} | {_cell(plain)} |")
    lines += ["", f"| communication per rank per step (cp {p.comm.cp}, " + (f"ep {p.comm.ep}, " if p.comm.ep > 1 else "")
              + f"FSDP over {p.comm.shard_group}"
              + (f" x {p.comm.dp_replicate} replicas" if p.comm.dp_replicate > 1 else "")
              + ") | layers | counts | forward | recompute | backward | step | ring wire |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in p.comm.rows:
        lines.append(f"| {r.name} | {r.layers} | {r.convention} | {_cell(r.forward)} | {_cell(r.recompute)} | "
                     f"{_cell(r.backward)} | {_cell(r.total)} | {_cell(r.wire)} |")
    for part, label in (("kda", "KDA (CP)"), ("dsa", "DSA (CP)"), ("ep", "EP all-to-all"), ("fsdp", "FSDP")):
        if part == "ep" and p.comm.ep == 1:
            continue
        lines.append(f"| **{label} total** | | | | | | **{_cell(p.comm.part_total(part))}** | "
                     f"**{_cell(p.comm.part_wire(part))}** |")
    host_budget = "" if p.host_mem is None else f" (budget {format_bytes(p.host_mem)} per node)"
    lines += [
        "",
        f"pinned host memory for offload: {format_bytes(p.host_per_gpu)} per GPU, {format_bytes(p.host_per_node)} per node{host_budget}",
        f"verdict: {'FITS' if p.fits else 'DOES NOT FIT'} (device {'ok' if p.fits_device else 'over'}, host "
        f"{'ok' if p.fits_host else 'over'})",
    ]
    if not p.fits:
        if p.suggestion:
            lines.append(f"cheapest change that fits: {' '.join('--set ' + s if not s.startswith('--') else s for s in p.suggestion)}"
                         f" -> {format_bytes(p.suggestion_total or 0)} per GPU")
        else:
            lines.append("no change tried fits (recompute, offload, expert parallelism, chunks, up to 8x CP, 4x GPUs): "
                         "use larger GPUs or a shorter context")
    lines += ["", "assumptions:"] + [f"- {a}" for a in p.assumptions]
    return "\n".join(lines)


# -- evaluation: forward only ----------------------------------------------------------------------

#: MoE tensors the dispatch makes per chunk of ``memory.moe_chunk_tokens`` tokens (the router reads
#: each chunk's rows, the experts run them); the input, the shared expert and the routed outputs are
#: whole-slice tensors (``genolong.model.moe.MoE.forward``).
_MOE_PER_CHUNK = frozenset({"input fp32 (router)", "router scores", "top-k indices, order, token map",
                            "routing weights", "routed experts", "EP received rows"})
#: Fixed process memory of a CPU run (``parallel.accelerator: cpu``) besides tensors: Python, torch
#: and genolong imported (measured here: RSS 0.38 GiB after importing torch, numpy, pandas,
#: ``genolong.cli`` and ``genolong.evaluation.score``; rounded up to 0.5 GiB for what a run adds).
CPU_PROCESS_BYTES = GIB // 2
#: Evaluation LM-head rows per chunk (``genolong evaluate``'s ``chunk_size`` default, score_tile).
EVAL_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class WorkingTensor:
    """One tensor (or group of tensors) alive at the peak of a forward-only pass.

    Attributes:
        kind: the part it belongs to (``kda``, ``dsa``, ``moe``, ``mlp``, ``mhc``, ``norm``,
            ``outside``, ``stream cache``).
        name: what it is.
        nbytes: bytes.
    """

    kind: str
    name: str
    nbytes: int


def _fla_forward_temporaries(cfg: ModelConfig, cp_path: bool) -> float:
    """fp32 bytes per token fla-core's ``chunk_kda_fwd`` allocates besides its save set and frees
    before it returns (``fla/ops/kda/chunk_fwd.py``: ``disable_recompute=False`` drops w, u, qg, kg,
    v_new and h; qg is not made): per head ``w``, ``kg`` (K each), ``u``, ``v_new`` (V each), the
    chunk states ``h [NT, K, V]`` (``K V / C`` per token), the in-chunk diagonal blocks ``Akkd``
    (16, ``chunk_intra.py``) and, with the gate in the kernel (one process), the chunk-local
    cumulative gate ``g_cumsum`` (K; under CP it is in the save set). Under CP the values are the
    widened ``[v | 0]`` (``V + K`` columns)."""
    heads, K = cfg.linear_num_heads, cfg.linear_head_dim
    V = K + K if cp_path else K
    floats = 2 * K + 2 * V + K * V / KDA_CHUNK + 16 + (0 if cp_path else K)
    return heads * floats * _F32


def forward_working_set(config: ModelConfig, layer: int, half: str, tokens: int, *, dtype_bytes: int = 4,
                        kda_kernel: str = "torch", dsa_kernel: str = "torch", cp: int = 1,
                        moe_chunk_tokens: int | None = None, expert_load: float | None = None,
                        sequence_tokens: int | None = None) -> list[WorkingTensor]:
    """What one half of block ``layer`` holds at the peak of a forward-only pass (``torch.no_grad``).

    Counted from the training inventory (one set of per-tensor formulas): the half's saved
    tensors without recompute (:func:`layer_saved_tensors`, ``indexer_kl=False``: evaluation does
    not compute the indexer KL) are every tensor its forward makes that a backward would read, and
    a forward without grad holds them at most all at once (it frees some before the half ends: an
    upper bound; ``tests/test_plan.py`` measures it on ``tiny`` and ``small``). Added: the
    half's output streams ``[T, m, H]`` (made while the input streams live); on a KDA half with
    fla-core's kernel its forward temporaries (:func:`_fla_forward_temporaries`); on a DSA half
    :func:`dsa_buffer_bytes` without gradients (under CP the all-gathered latent and pooled keys of
    the whole sequence); the top-k indices a full DSA layer hands to the shared layer after it
    (its feed-forward half and the shared layer's attention half); on a MoE half the per-chunk
    tensors for one dispatch chunk only (:data:`_MOE_PER_CHUNK`) and the routed outputs (the
    chunks' list and its concatenation, ``2 x [T, H]``).

    Args:
        config: the architecture.
        layer: layer index.
        half: ``attention`` or ``ffn``.
        tokens: tokens of the pass (the rank's slice ``context / cp``, or one streamed segment).
        dtype_bytes: the parameter/compute dtype's bytes (4: fp32, 2: bf16).
        kda_kernel, dsa_kernel: as :func:`layer_saved_tensors`.
        cp: context-parallel size (KDA's CP path; DSA's gathered keys).
        moe_chunk_tokens: MoE dispatch chunk (default None: the whole pass at once).
        expert_load: under EP the busiest rank's rows over the mean (default None: no EP).
        sequence_tokens: tokens of the whole sequence the CP group holds (default ``tokens * cp``).

    Returns:
        The :class:`WorkingTensor` list (bytes).
    """
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None and cfg.mlp_layer_types is not None
    if half not in ("attention", "ffn"):
        raise InputError(f"half must be 'attention' or 'ffn', got {half!r}")
    a, H, m = dtype_bytes, cfg.hidden_size, cfg.hc_mult
    items = _half(cfg, layer, half, a, frozenset(), indexer_kl=False, tokens=tokens, moe_chunk_tokens=moe_chunk_tokens,
                  kda_kernel=kda_kernel, dsa_kernel=dsa_kernel, cp_path=cp > 1, expert_load=expert_load)
    chunk = min(moe_chunk_tokens or tokens, tokens)
    out = [WorkingTensor(t.kind, t.name, int(round(t.nbytes(chunk if t.kind == "moe" and t.name in _MOE_PER_CHUNK
                                                              else tokens)))) for t in items]
    out.append(WorkingTensor("mhc", f"{half} half's output streams [T, m, H]", tokens * m * H * a))
    is_dsa = cfg.layer_types[layer] == INDEXED_ATTENTION
    shared = is_dsa and cfg.indexer_types[layer] == "shared"
    hands_on = is_dsa and not shared and cfg.indexer_types[min(layer + 1, cfg.num_hidden_layers - 1)] == "shared"
    slots = _index_slots(cfg)
    if half == "attention":
        if not is_dsa and kda_kernel == "fla":
            out.append(WorkingTensor("kda", "fla chunk_kda forward temporaries (w, u, kg, v_new, h, ...)",
                                     int(round(tokens * _fla_forward_temporaries(cfg, cp > 1)))))
        if is_dsa:
            seq = tokens * cp if sequence_tokens is None else sequence_tokens
            name = "DSA indexer / top-k / gather buffers" + (" + all-gathered latent and pooled keys" if cp > 1 else "")
            out.append(WorkingTensor("dsa", name, dsa_buffer_bytes(cfg, seq, cp, a, gradients=False)))
        if shared:
            out.append(WorkingTensor("dsa", "received top-k indices", tokens * slots * _I64))
    else:
        if hands_on:
            out.append(WorkingTensor("dsa", "top-k indices handed to the next (shared) layer", tokens * slots * _I64))
        if cfg.mlp_layer_types[layer] == "sparse":
            out.append(WorkingTensor("moe", "routed outputs: per-chunk list + concatenation", 2 * tokens * H * a))
    return out


def stream_cache_tensors(config: ModelConfig, tokens: int, dtype_bytes: int = 4) -> list[WorkingTensor]:
    """What :class:`genolong.model.stream.PrefillStream` carries between segments of a ``tokens``-token
    sequence: per DSA layer the kv latent of every token (``[T, kv_lora_rank]``, model dtype) and,
    on full-indexer layers, the pooled index keys (``[T / P, index_head_dim]``) and at most
    ``P - 1`` pending layer inputs (H); per KDA layer the fp32 state ``[heads, dk, dv]`` and the
    short conv's ``kernel - 1`` rows of q|k|v (fp32)."""
    cfg = config
    assert cfg.layer_types is not None and cfg.indexer_types is not None
    a, P = dtype_bytes, cfg.index_kpool
    dsa = [i for i, t in enumerate(cfg.layer_types) if t == INDEXED_ATTENTION]
    full = [i for i in dsa if cfg.indexer_types[i] == "full"]
    n_kda = len(cfg.layer_types) - len(dsa)
    heads, d = cfg.linear_num_heads, cfg.linear_head_dim
    out = []
    if dsa:
        out.append(WorkingTensor("stream cache", f"DSA kv latent of every token ({len(dsa)} layers)",
                                 len(dsa) * tokens * cfg.kv_lora_rank * a))
        out.append(WorkingTensor("stream cache", f"DSA pooled index keys + pending pool rows ({len(full)} full layers)",
                                 len(full) * (tokens // P * cfg.index_head_dim + (P - 1) * cfg.hidden_size) * a))
    if n_kda:
        out.append(WorkingTensor("stream cache", f"KDA states + conv tails ({n_kda} layers)",
                                 n_kda * (heads * d * d + (cfg.linear_conv_kernel_dim - 1) * 3 * heads * d) * _F32))
    return out


def eval_outside_tensors(config: ModelConfig, tokens: int, pass_tokens: int, dtype_bytes: int = 4,
                         chunk_rows: int = EVAL_CHUNK_ROWS) -> list[WorkingTensor]:
    """The LM-head phase of a forward-only scoring pass over ``pass_tokens`` tokens (the whole
    slice, or the last streamed segment), of a tile slice of ``tokens`` tokens: the streams
    ``[n, m, H]`` the final norm collapses, the final norm and the scored hidden rows
    (:func:`outside_saved_tensors`: ids, norm fp32 input, rsqrt, output, hidden, targets,
    weights), one LM-head chunk (``chunk_rows x vocab`` logits in the dtype, their fp32 copy and
    ``logsumexp``'s exponentials), and the whole slice's ids, model inputs, targets and NLL."""
    cfg, a, n = config, dtype_bytes, pass_tokens
    rows = min(chunk_rows, n)
    out = [WorkingTensor("mhc", "streams [T, m, H] into the final norm", n * cfg.hc_mult * cfg.hidden_size * a)]
    out += [WorkingTensor("outside", t.name, int(round(t.nbytes(n)))) for t in outside_saved_tensors(cfg, a)]
    out.append(WorkingTensor("outside", "LM-head chunk: logits, fp32 copy, logsumexp", rows * cfg.vocab_size * (a + 2 * _F32)))
    out.append(WorkingTensor("outside", "tile ids, model inputs, targets, per-token NLL (whole slice)",
                             tokens * (3 * _I64 + 1 + 2 * _F32)))
    return out


@dataclass
class EvalPlan:
    """Per-GPU memory plan of scoring a recipe's model at a context on a cluster (see
    :func:`eval_plan`; :func:`format_eval_plan` prints it).

    Attributes:
        recipe, model: the recipe's name and a one-line description of the architecture.
        gpus, gpus_per_node, nodes: the cluster; accelerator: the recipe's.
        cp, dp_shard, dp_replicate, shard_group, ep, experts_per_rank, expert_shard_group: the mesh
            (as the training plan's; tiles are dealt to the ``dp_shard x dp_replicate`` groups).
        context: tokens per tile; tokens_per_rank: ``context / cp``; segment_tokens: streamed
            segment (None: one forward per slice).
        dtype: parameter dtype of the scoring (``float32`` or ``bfloat16``); moe_chunk_tokens:
            the MoE dispatch chunk.
        kernel_backend, kda_kernel, dsa_kernel: the backend and the kernels counted.
        parameters: total parameters.
        device: bytes per GPU by line item, in print order.
        working: the largest forward working set's tensors (:class:`WorkingTensor`).
        peak_phase: where the activation peak is (e.g. ``layer 3 attention (DSA)``).
        phase_bytes: activation peak by layer type and half (``KDA attention``, ``MoE ffn``, ...)
            and the LM head.
        device_total, gpu_mem: predicted peak and budget per GPU (bytes).
        host: host bytes per GPU by line item (loading); host_per_gpu, host_per_node, host_mem:
            totals and the per-node budget (None: not checked).
        fits_device, fits_host, fits: the verdict.
        suggestion: the first change tried that fits (``--set`` overrides, or ``--gpus N``);
            suggestion_total: its per-GPU total.
        assumptions: what the numbers rest on.
    """

    recipe: str
    model: str
    gpus: int
    gpus_per_node: int
    nodes: int
    accelerator: str
    cp: int
    dp_shard: int
    dp_replicate: int
    shard_group: int
    ep: int
    experts_per_rank: int
    expert_shard_group: int
    context: int
    tokens_per_rank: int
    segment_tokens: int | None
    dtype: str
    moe_chunk_tokens: int | None
    kernel_backend: str
    kda_kernel: str
    dsa_kernel: str
    parameters: int
    device: dict[str, int]
    working: list[WorkingTensor]
    peak_phase: str
    phase_bytes: dict[str, int]
    device_total: int
    gpu_mem: int
    host: dict[str, int]
    host_per_gpu: int
    host_per_node: int
    host_mem: int | None
    fits_device: bool
    fits_host: bool
    fits: bool
    suggestion: list[str] = field(default_factory=list)
    suggestion_total: int | None = None
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field (bytes as integers) for ``genolong plan --evaluate --json``."""
        return dataclasses.asdict(self)


_EVAL_DTYPES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2}


def _eval_once(recipe: Recipe, cfg: ModelConfig, gpus: int, context: int, gpu_mem_gib: float, host_mem_gib: float | None,
               gpus_per_node: int, moe_imbalance: float | None, kda_kernel: str, dsa_kernel: str, dtype: str,
               segment_tokens: int | None) -> EvalPlan:
    par, mem = recipe.parallel, recipe.memory
    imbalance, imbalance_source = recipe_moe_imbalance(recipe, moe_imbalance)
    cp, rep, ep, dp_shard, shard, moe_layers = _mesh_sizes(par, cfg, gpus)
    unit = kernel_multiple(cfg, cp)
    if context % unit:
        raise InputError(f"--context {context} is not a multiple of {unit} (cp {cp} x the KDA chunk / DSA pool); "
                         f"use e.g. {max(unit, context // unit * unit)}")
    if segment_tokens is not None and shard > 1:
        # PrefillStream calls each block's parts itself, outside FSDP2's per-block gather hooks, and
        # refuses a model with context parallelism installed
        raise InputError(f"--segment-tokens streams a tile through one process holding the whole model; this mesh "
                         f"shards it over cp x dp_shard = {cp} x {dp_shard}: drop --segment-tokens, or set parallel.cp=1 "
                         "and parallel.dp_shard=1 (replicas: parallel.dp_replicate)")
    a = _EVAL_DTYPES[dtype]
    H = cfg.hidden_size
    count = parameter_count(cfg).total
    tokens = context // cp
    streamed = segment_tokens is not None and segment_tokens < tokens
    n = segment_tokens if streamed else tokens
    assert n is not None
    gpu = par.accelerator != "cpu"

    device: dict[str, int] = {f"parameters ({dtype}, sharded over {shard})" if shard > 1 else f"parameters ({dtype})":
                              a * math.ceil(count / shard)}
    largest = _largest_unit(cfg, ep)
    device["FSDP unsharded params (2 units: computing + prefetched)"] = 2 * largest * a if shard > 1 else 0

    expert_load = imbalance if ep > 1 else None
    kw = dict(dtype_bytes=a, kda_kernel=kda_kernel, dsa_kernel=dsa_kernel, cp=cp, moe_chunk_tokens=mem.moe_chunk_tokens,
              expert_load=expert_load, sequence_tokens=context)
    # outside the block being computed: the whole slice's ids, inputs and NLL; streamed, the caches too
    resident = [WorkingTensor("outside", "tile ids, model inputs, targets, per-token NLL (whole slice)",
                              tokens * (3 * _I64 + 1 + 2 * _F32))]
    if streamed:
        resident += stream_cache_tensors(cfg, tokens, a)
    resident_bytes = sum(t.nbytes for t in resident)
    phases: dict[str, int] = {}
    best: tuple[int, str, list[WorkingTensor]] = (-1, "", [])
    for i in range(cfg.num_hidden_layers):
        mixer = "DSA" if cfg.layer_types[i] == INDEXED_ATTENTION else "KDA"
        ffn = "MoE" if cfg.mlp_layer_types[i] == "sparse" else "dense"
        for half, label in (("attention", f"{mixer} attention"), ("ffn", f"{ffn} ffn")):
            items = forward_working_set(cfg, i, half, n, **kw)  # type: ignore[arg-type]
            size = sum(t.nbytes for t in items)
            phases[label] = max(phases.get(label, 0), size)
            if size > best[0]:
                best = (size, f"layer {i} {label}", items)
    head = [t for t in eval_outside_tensors(cfg, tokens, n, a) if not t.name.startswith("tile ids")]
    phases["LM head"] = sum(t.nbytes for t in head)
    if phases["LM head"] > best[0]:
        best = (phases["LM head"], "LM head", head)
    peak, phase, working = best
    device[f"forward working set ({phase}, {n:,} tokens)"] = peak
    device["tile ids, inputs, NLL" + (" + stream caches (DSA latent, pooled keys; KDA states)" if streamed else "")] = resident_bytes
    if ep > 1 and moe_layers:
        # the rank's own (token, slot) rows of one chunk: the dispatch send and combine receive buffers
        c = min(mem.moe_chunk_tokens or n, n)
        device["MoE all-to-all send + receive (own rows, one chunk)"] = 2 * c * cfg.num_experts_per_tok * H * a
    subtotal = sum(device.values())
    fixed = WORKSPACE_BYTES if gpu else CPU_PROCESS_BYTES
    device["workspace (context, NCCL, fragmentation)" if gpu else "process (Python, torch) + fragmentation"] = \
        int(fixed + FRAGMENTATION * subtotal)
    total = sum(device.values())

    # host memory while loading: each rank reads its own slices (never the whole model)
    biggest = max(parameter_count(cfg).embedding, parameter_count(cfg).lm_head)
    host = {"read buffer: the largest checkpoint tensor (embedding / LM head)": biggest * a,
            "staged shard of the weights before the copy to the device": a * math.ceil(count / shard) if gpu else 0}
    host_gpu = sum(host.values())
    per_node = min(gpus_per_node, gpus)
    host_node = host_gpu * per_node
    host_mem = None if host_mem_gib is None else int(host_mem_gib * GIB)
    gpu_mem = int(gpu_mem_gib * GIB)
    fits_device = total <= gpu_mem
    fits_host = host_mem is None or host_node <= host_mem
    assumptions = [
        "forward only (torch.no_grad): no gradients, no optimizer state, nothing saved for backward; "
        "the peak is the largest half-block's working set: its saved tensors as training would keep them "
        "(the planner's per-tensor inventory, an upper bound: without grad the layer frees them as it goes; "
        "measured on tiny/small, CPU, fp32, one-shot and streamed: the no_grad peak is 0.46-0.82x of it, tests/test_plan.py)"
        + ("; fla chunk_kda's forward temporaries (w, u, kg, v_new, chunk states h) added" if kda_kernel == "fla" else ""),
        f"weights in {dtype} sharded over cp x dp_shard = {shard} ranks (FSDP2"
        + (f"; ep {ep}: {cfg.n_routed_experts // ep} experts per rank, each MoE layer's experts a unit over {shard // ep}"
           if ep > 1 else "") + f"); 2 unsharded units in flight (the largest: {format_count(largest)} params)",
        f"kernel_backend {cfg.kernel_backend!r} -> KDA {kda_kernel}, DSA {dsa_kernel}"
        + (" (auto counted as on a CUDA machine with Triton and fla-core)" if cfg.kernel_backend == "auto" and gpu else ""),
        (f"context parallelism: each of the {cp} ranks scores {tokens:,} tokens of the {context:,}-token tile; DSA "
         "all-gathers the whole tile's kv latent and pooled index keys (forward: once, no gradients)") if cp > 1 else
        (f"streamed in segments of {segment_tokens:,} tokens (genolong.model.stream.PrefillStream): one segment's "
         "working set plus the DSA latent / pooled-key caches of the whole tile and the KDA states" if streamed else
         f"one forward over the {tokens:,}-token tile"),
        f"MoE dispatch in chunks of {mem.moe_chunk_tokens or 'all'} tokens (memory.moe_chunk_tokens)"
        + (f"; the busiest EP rank's expert rows at {imbalance:g} x the mean ({imbalance_source})" if ep > 1 else ""),
        f"LM head {EVAL_CHUNK_ROWS} rows per chunk (evaluate's chunk_size); the largest of the phases counts",
        ("loading: each rank reads only its slices (safetensors get_slice / dcp.load into the sharded model); host "
         "per GPU: the largest tensor's read buffer plus the rank's shard staged before the copy") if gpu else
        "CPU run: 'device' is the process's memory; loading streams the safetensors one tensor at a time",
        (f"workspace {format_bytes(WORKSPACE_BYTES)}" if gpu else f"process {format_bytes(CPU_PROCESS_BYTES)}")
        + f" + {FRAGMENTATION:.0%} fragmentation",
    ]
    return EvalPlan(
        recipe=recipe.name, model=_describe(cfg, count), gpus=gpus, gpus_per_node=gpus_per_node,
        nodes=math.ceil(gpus / gpus_per_node), accelerator=par.accelerator, cp=cp, dp_shard=dp_shard, dp_replicate=rep,
        shard_group=shard, ep=ep, experts_per_rank=cfg.n_routed_experts // ep if moe_layers else 0,
        expert_shard_group=shard // ep, context=context, tokens_per_rank=tokens,
        segment_tokens=segment_tokens if streamed else None, dtype=dtype, moe_chunk_tokens=mem.moe_chunk_tokens,
        kernel_backend=cfg.kernel_backend, kda_kernel=kda_kernel, dsa_kernel=dsa_kernel, parameters=count,
        device=device, working=working, peak_phase=phase, phase_bytes=phases, device_total=int(total), gpu_mem=gpu_mem,
        host=host, host_per_gpu=host_gpu, host_per_node=host_node, host_mem=host_mem, fits_device=fits_device,
        fits_host=fits_host, fits=fits_device and fits_host, assumptions=assumptions,
    )


def eval_plan(recipe: Recipe, context: int | None = None, gpus: int | None = None, gpu_mem_gib: float = 80.0,
              host_mem_gib: float | None = None, gpus_per_node: int = 8, moe_imbalance: float | None = None, *,
              dtype: str | None = None, segment_tokens: int | None = None, kda_kernel: str | None = None,
              dsa_kernel: str | None = None) -> EvalPlan:
    """Plan the memory per GPU of scoring a recipe's model on tiles of ``context`` tokens
    (``genolong plan RECIPE --evaluate``): forward only, on the recipe's mesh.

    Args:
        recipe: a loaded :class:`~genolong.config.Recipe`.
        context: tokens per tile (default None: the recipe's eval context, ``eval.context`` or
            ``data.context``); a multiple of ``cp`` x the KDA chunk / DSA pool.
        gpus: GPUs in all (default: the recipe's ``devices x num_nodes``); ``dp_shard`` becomes
            ``gpus / (cp * dp_replicate)``: the data-parallel groups tiles are dealt to.
        gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance: as :func:`plan`.
        dtype: parameter dtype of the scoring, ``float32`` or ``bfloat16`` (default None: bf16
            for a ``bf16-mixed`` recipe, else fp32).
        segment_tokens: stream each tile in segments of this many tokens (``evaluate
            --segment-tokens``; only where each process holds the whole model: ``cp = dp_shard =
            1``); default None: one forward.
        kda_kernel, dsa_kernel: as :func:`plan` (default: from the model's ``kernel_backend`` on
            the recipe's accelerator).

    Returns:
        An :class:`EvalPlan`. When it does not fit, ``suggestion`` holds the first of: expert
        parallelism, smaller MoE chunks, streaming (``--segment-tokens``, unsharded), a larger CP, more
        GPUs that fits alone.

    Raises:
        InputError: a non-positive size, a context not divisible as the mesh needs, gpus not
            divisible by the mesh, ``segment_tokens`` on a sharded mesh, an unknown dtype or kernel.
    """
    if not isinstance(recipe, Recipe):
        raise InputError(f"eval_plan needs a Recipe (genolong.config.load_recipe), got {type(recipe).__name__}")
    _check_positive("--context", context, int, allow_none=True)
    _check_positive("--segment-tokens", segment_tokens, int, allow_none=True)
    _check_positive("--gpus", gpus, int, allow_none=True)
    _check_positive("--gpu-mem", gpu_mem_gib)
    _check_positive("--host-mem", host_mem_gib, allow_none=True)
    _check_positive("--gpus-per-node", gpus_per_node, int)
    _check_positive("moe_imbalance", moe_imbalance, allow_none=True)
    if moe_imbalance is not None and moe_imbalance < 1:
        raise InputError(f"moe_imbalance is the busiest GPU's load over the mean and must be >= 1, got {moe_imbalance}")
    if dtype is None:
        dtype = "bfloat16" if recipe.train.precision == "bf16-mixed" else "float32"
    if dtype not in _EVAL_DTYPES:
        raise InputError(f"--dtype {dtype!r} is unknown; choose one of {', '.join(_EVAL_DTYPES)}")
    dtype = "float32" if _EVAL_DTYPES[dtype] == 4 else "bfloat16"
    cfg = _model_config(recipe)
    default_kda, default_dsa = backend_kernels(cfg.kernel_backend, recipe.parallel.accelerator)
    kda = default_kda if kda_kernel is None else kda_kernel
    dsa = default_dsa if dsa_kernel is None else dsa_kernel
    if kda not in KDA_KERNELS:
        raise InputError(f"kda_kernel {kda!r} is unknown; choose one of {', '.join(KDA_KERNELS)}")
    if dsa not in DSA_KERNELS:
        raise InputError(f"dsa_kernel {dsa!r} is unknown; choose one of {', '.join(DSA_KERNELS)}")
    ctx = recipe.eval_context if context is None else context
    world = recipe.parallel.world_size if gpus is None else gpus
    args = (ctx, gpu_mem_gib, host_mem_gib, gpus_per_node, moe_imbalance, kda, dsa, dtype, segment_tokens)
    base = _eval_once(recipe, cfg, world, *args)
    if base.fits:
        return base
    data = recipe.to_dict()
    par, mem = recipe.parallel, recipe.memory
    # (overrides, gpus, segment tokens), cheapest first: the same GPUs, then more of them
    options: list[tuple[list[str], int, int | None]] = []
    assert cfg.mlp_layer_types is not None
    if "sparse" in cfg.mlp_layer_types:
        fold = world // par.dp_replicate
        options += [([f"parallel.ep={e}"], world, segment_tokens)
                    for e in range(par.ep + 1, min(fold, cfg.n_routed_experts) + 1)
                    if fold % e == 0 and cfg.n_routed_experts % e == 0 and world % (par.cp * par.dp_replicate) == 0]
        chunk = min(mem.moe_chunk_tokens or base.tokens_per_rank, base.tokens_per_rank)
        if chunk > 1024:
            options.append(([f"memory.moe_chunk_tokens={chunk // 4}"], world, segment_tokens))
    if world == par.dp_replicate:  # each process holds the whole model: stream the tile (--segment-tokens)
        current = segment_tokens or ctx
        options += [([], world, s) for s in (65536, 16384, 4096) if s < current]
    if segment_tokens is None:
        options += [([f"parallel.cp={par.cp * f}", "parallel.dp_shard=-1"], world, None) for f in (2, 4, 8)
                    if world % (par.cp * f * par.dp_replicate) == 0]
    options += [(["parallel.dp_shard=-1"], world * f, segment_tokens) for f in (2, 4)]
    for overrides, n, segment in options:
        try:
            changed = parse_recipe(data, _with_gpus(overrides, n, gpus_per_node))
            result = _eval_once(changed, cfg, n, *args[:-1], segment)
        except InputError:
            continue
        if result.fits:
            base.suggestion = (overrides + ([f"--gpus {n}"] if n != world else [])
                               + ([f"--segment-tokens {segment}"] if segment != segment_tokens else []))
            base.suggestion_total = result.device_total
            break
    return base


def format_eval_plan(plan: EvalPlan) -> str:
    """The evaluation plan as text: cluster and settings, device memory per GPU by line item, the
    largest forward working set tensor by tensor, the activation peak by phase, host memory for
    loading, the verdict, the suggestion and the assumptions."""
    p = plan
    lines = [
        f"plan --evaluate: {p.recipe} -- {p.model}",
        f"cluster: {p.gpus} {'GPUs' if p.accelerator != 'cpu' else 'processes (CPU)'} = {p.nodes} nodes x "
        f"{min(p.gpus_per_node, p.gpus)}; mesh cp {p.cp} x dp_shard {p.dp_shard} x dp_replicate {p.dp_replicate} "
        f"(weights sharded over {p.shard_group}; tiles dealt to {p.dp_shard * p.dp_replicate} data-parallel groups)"
        + (f"; ep {p.ep} ({p.experts_per_rank} experts per rank, experts sharded over {p.expert_shard_group})"
           if p.ep > 1 else "; ep 1"),
        f"tile: {p.context:,} tokens; per rank {p.tokens_per_rank:,}"
        + (f", streamed {p.segment_tokens:,} at a time" if p.segment_tokens else "")
        + f"; {p.dtype}; MoE chunk {p.moe_chunk_tokens or 'all'}; forward only",
        f"kernels: backend {p.kernel_backend!r} -> KDA {p.kda_kernel}, DSA {p.dsa_kernel}",
        "",
        f"| {'device memory per GPU' if p.accelerator != 'cpu' else 'memory per process (CPU)'} (evaluation) | size |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {_cell(value)} |" for name, value in p.device.items()]
    lines.append(f"| **total (peak)** | **{_cell(p.device_total)}** of {_cell(p.gpu_mem)} |")
    lines += ["", f"| forward working set: {p.peak_phase} | size |", "|---|---:|"]
    # (a '|' inside a tensor's name, e.g. q|k|v, would split the markdown row)
    lines += [f"| {t.kind}: {t.name.replace('|', '/')} | {_cell(t.nbytes)} |" for t in sorted(p.working, key=lambda t: -t.nbytes)]
    lines += ["", "| activation peak by phase (largest layer of each kind) | size |", "|---|---:|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in sorted(p.phase_bytes.items(), key=lambda kv: -kv[1])]
    budget = "" if p.host_mem is None else f" (budget {format_bytes(p.host_mem)} per node)"
    lines += ["", "| host memory per GPU (loading) | size |", "|---|---:|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in p.host.items()]
    lines += [
        f"| **total** | **{_cell(p.host_per_gpu)}** ({_cell(p.host_per_node)} per node{budget}) |",
        "",
        f"verdict: {'FITS' if p.fits else 'DOES NOT FIT'} (device {'ok' if p.fits_device else 'over'}, host "
        f"{'ok' if p.fits_host else 'over'})",
    ]
    if not p.fits:
        if p.suggestion:
            lines.append(f"first change that fits: {' '.join('--set ' + s if not s.startswith('--') else s for s in p.suggestion)}"
                         f" -> {format_bytes(p.suggestion_total or 0)} per GPU")
        else:
            lines.append("no change tried fits (expert parallelism, MoE chunks, streaming, up to 8x CP, 4x GPUs): use larger GPUs, "
                         "more of them or a shorter context")
    lines += ["", "assumptions:"] + [f"- {a}" for a in p.assumptions]
    return "\n".join(lines)

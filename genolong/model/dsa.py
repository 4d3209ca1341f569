"""The DSA mixer of GLM-5.3-Flash: NoPE MLA attending only to the keys a KPool lightning indexer selects.

Per token (``x [B, T, H]``)::

    q_resid = RMSNorm(q_a_proj(x))                                # [B, T, q_lora_rank]
    q       = q_b_proj(q_resid)            -> [B, T, heads, qk_head_dim]
    k, v    = kv_b_proj(RMSNorm(kv_a_proj_with_mqa(x)))  split into k_nope [.., qk_nope_head_dim], v [.., v_head_dim]
    idx     = indexer(x, q_resid)          -> [B, T, index_topk + index_kpool - 1] token positions (no gradient)
    out     = o_proj(sparse_attention(q, k, v, idx, scale=qk_head_dim ** -0.5))

computed with ``kv_b_proj`` absorbed (``DSAMixer.absorb``, the default): with
``c = RMSNorm(kv_a_proj_with_mqa(x))`` ``[B, T, kv_lora_rank]`` and ``kv_b_proj`` split per head
into ``W_k [H, qk_nope, C]`` and ``W_v [H, v, C]``, ``q . k_s = (W_k^T q) . c_s`` and
``sum_s p_s v_s = W_v (sum_s p_s c_s)``, so sparse attention runs over ``c`` as one key/value head
shared by all heads and gathers ``C`` numbers per selected key instead of ``H * (qk_nope + v)``.

The indexer (transformers' ``Glm5NextTextIndexer``) pools the index keys ``LayerNorm(wk(x))`` of
every complete ``index_kpool``-token pool (softmax over ``gate + ape`` per channel), scores pool
``j`` for query ``t`` as ``sum_h w[t, h] * relu(DI ** -0.5 * q_idx[t, h] . k_pool[j])`` with
``w = weights_proj(x) * HI ** -0.5`` and ``q_idx = wq_b(q_resid)``, keeps the best
``index_topk // index_kpool`` pools whose last token is ``<= t``, expands them to tokens and
appends the query's incomplete tail pool. The ops live in :mod:`genolong.kernels.dsa`; nothing
here builds a ``[T, T]`` tensor.

Selection semantics (as transformers): the query itself is visible only through the selection --
through the tail when ``(t + 1) % P != 0``, otherwise only if its (just completed) pool is among
the selected ones. A "shared" layer (``indexer_types[i] == "shared"``) has no indexer and reuses
the indices of the previous layer, which a full DSA layer returns only when the next layer's
``indexer_types`` entry is "shared" (transformers' ``next_skip_topk``).

Parameter names are transformers' (``Glm5NextTextAttention``), so ``load_state_dict`` of a
transformers module's state dict works with ``strict=True``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from ..kernels.backends import get_backend
from ..kernels.dsa import kpool_pool_ids
from .config import ModelConfig
from .layers import RMSNorm

__all__ = ["DSAIndexer", "DSAMixer"]


class DSAIndexer(nn.Module):
    """The KPool lightning indexer (transformers' ``Glm5NextTextIndexer``), selection only.

    Args:
        config: the model config (``index_*`` fields, ``hidden_size``, ``q_lora_rank``).

    Parameters (checkpoint names): ``wq_b [HI * DI, q_lora_rank]``, ``wk [DI, H]``,
    ``k_norm`` (LayerNorm over DI, eps 1e-6, with bias), ``weights_proj [HI, H]``,
    ``index_kpool_compress_ape [P, DI]`` (init zeros), ``index_kpool_compress_gate [DI, H]``
    (init ones, as transformers' ``_init_weights``).

    Shapes: ``x [B, T, H]``, ``q_resid [B, T, q_lora_rank] -> indices [B, T, index_topk + P - 1]``
    int64 (``[B, T, index_topk]`` without the tail), ``-1`` padded. Runs without autograd.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.index_kpool = config.index_kpool
        self.always_select_tail = config.index_kpool_always_select_tail
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.index_kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(self.head_dim, config.hidden_size))
        self.kernels = get_backend(config.kernel_backend)

    def project(
        self, x: torch.Tensor, q_resid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scoring inputs (differentiable; :meth:`forward` calls it without gradient).

        Returns:
            ``q_idx [B, T, HI, DI]``, ``k_pool [B, T // P, DI]`` (complete pools only) and the
            per-head weights ``w [B, T, HI]`` float32 (``HI ** -0.5`` folded in).
        """
        b, t, _ = x.shape
        q_idx = self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim)
        k_idx = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        k_pool = self.kernels.kpool_keys(k_idx, gate, self.index_kpool_compress_ape)
        w = self.weights_proj(x).float() * (self.n_heads ** -0.5)
        return q_idx, k_pool, w

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            q_idx, k_pool, w = self.project(x, q_resid)
            return self.kernels.kpool_topk(
                q_idx, k_pool, w, self.index_topk, self.index_kpool, tail=self.always_select_tail,
                scale=self.softmax_scale, activation="relu",
            )


class DSAMixer(nn.Module):
    """The DSA token mixer (transformers' ``Glm5NextTextAttention`` without cache or padding).

    Args:
        config: the model config (MLA fields, ``index_*``, ``indexer_types``).
        layer_idx: this layer's index (selects ``indexer_types[layer_idx]`` and decides whether
            the indices are returned for the next layer).
        query_block: queries per chunk of :func:`~genolong.kernels.dsa.sparse_attention`.

    Shapes: ``x [B, T, H]``, ``prev_indices [B, T, K]`` (int32/int64, ``-1`` padded; shared layers
    only) ``-> (out [B, T, H], indices [B, T, index_topk + index_kpool - 1] or None)``.

    Rows with no selected key give a zero attention output (``sparse_attention``); with the
    tail always selected (the default) and no padding every row has at least one key. (With
    ``index_kpool_always_select_tail=False`` rows ``t < P - 1`` select nothing; transformers'
    eager mask then averages ``v`` over all ``T`` positions, future ones included, while its SDPA
    path gives 0 there, as genolong does.)
    """

    def __init__(self, config: ModelConfig, layer_idx: int, query_block: int = 64):
        super().__init__()
        assert config.indexer_types is not None
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = self.qk_head_dim ** -0.5
        self.query_block = query_block
        bias = config.attention_bias
        h = config.hidden_size
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + config.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, h, bias=bias)
        types = config.indexer_types
        self.shared = types[layer_idx] == "shared"
        self.indexer: DSAIndexer | None = None if self.shared else DSAIndexer(config)
        # transformers' next_skip_topk (it looks at indexer_types only, clamped at the last layer)
        self.returns_indices = not self.shared and types[min(layer_idx + 1, len(types) - 1)] == "shared"
        self.kernels = get_backend(config.kernel_backend)
        self.always_select_tail = config.index_kpool_always_select_tail
        #: attend in the kv latent (kv_b_proj absorbed; default) or over expanded per-head keys and
        #: values (the plain form transformers computes; equal up to float rounding)
        self.absorb = True
        #: set by the trainer: compute the indexer KL loss in forwards that record gradients
        self.indexer_kl = False
        #: the last such forward's indexer KL (scalar fp32, differentiable w.r.t. the indexer only)
        self.last_indexer_kl: torch.Tensor | None = None
        #: the context-parallel process group (genolong.parallel.context.apply_context_parallel)
        self.cp_group: Any = None

    def check_prev_indices(self, prev_indices: torch.Tensor | None, b: int, t: int) -> None:
        """A shared layer's ``prev_indices`` must be ``[b, t, K]``: the indices the full DSA layer
        right before it returned (for the same tokens).

        Raises:
            InputError (a ValueError): missing, or of the wrong shape.
        """
        if prev_indices is None:
            raise InputError(
                f"DSA layer {self.layer_idx} is a 'shared' indexer layer and needs prev_indices: the top-k "
                "indices returned by the full DSA layer right before it"
            )
        if prev_indices.dim() != 3 or prev_indices.shape[:2] != (b, t):
            raise InputError(f"prev_indices must be [B, T, K] = [{b}, {t}, K]; got {tuple(prev_indices.shape)}")

    def forward(
        self, x: torch.Tensor, prev_indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mix ``x [B, T, H]``; returns ``(out [B, T, H], indices for the next layer or None)``.

        With ``cp_group`` set (context parallelism) ``x`` is this rank's slice and the layer runs
        through :func:`genolong.parallel.cp_dsa.cp_dsa_forward` (indices in global positions).

        Raises:
            ValueError: a shared layer without ``prev_indices`` (or with the wrong shape).
        """
        if self.cp_group is not None:
            from ..parallel.cp_dsa import cp_dsa_forward

            return cp_dsa_forward(self, x, self.cp_group, prev_indices)
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, t, self.num_heads, self.qk_head_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank])  # qk_rope_head_dim is 0

        if self.indexer is not None:
            indices = self.indexer(x, q_resid)
        else:
            self.check_prev_indices(prev_indices, b, t)
            indices = prev_indices
        if self.absorb:
            # kv_b_proj absorbed (DeepSeek's MLA trick): q . (W_k c) = (W_k^T q) . c, and the
            # output W_v (sum p c); attention runs over the [T, kv_lora_rank] latent as one shared
            # key/value head, so each selected key gathers kv_lora_rank numbers instead of
            # H * (qk_nope + v) (small: 8x fewer; GLM-5.3-Flash: 64x fewer)
            w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            w_k, w_v = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # [H, D, C], [H, DV, C]
            attn_q = torch.einsum("bthd,hdc->bthc", q, w_k)  # [B, T, H, C]
            attn_k = latent.unsqueeze(2)  # [B, T, 1, C]
            o_latent = self.kernels.sparse_attention(attn_q, attn_k, attn_k, indices, scale=self.scaling, query_block=self.query_block)
            o = torch.einsum("bthc,hvc->bthv", o_latent, w_v)
        else:
            kv = self.kv_b_proj(latent).view(b, t, self.num_heads, -1)
            k, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            attn_q, attn_k = q, k.contiguous()
            o = self.kernels.sparse_attention(q, attn_k, v.contiguous(), indices, scale=self.scaling, query_block=self.query_block)
        if self.indexer is not None and self.indexer_kl and torch.is_grad_enabled():
            self.last_indexer_kl = self._indexer_kl(x, q_resid, attn_q, attn_k, indices)
        out = self.o_proj(o.reshape(b, t, self.num_heads * self.v_head_dim))
        return out, (indices if self.returns_indices else None)

    def _indexer_kl(self, x: torch.Tensor, q_resid: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    indices: torch.Tensor) -> torch.Tensor:
        """Sparse-stage indexer KL (DeepSeek-V3.2, over the selected pools; see
        :func:`genolong.kernels.dsa.kpool_indexer_kl_loss`). ``q [B, T, H, D]`` and
        ``k [B, T, HK, D]`` are the main attention's (latent or expanded form: same scores). As
        DeepSeek does, the indexer's inputs are detached: the KL trains the indexer only, the LM
        loss everything else."""
        assert self.indexer is not None
        q_idx, k_pool, w = self.indexer.project(x.detach(), q_resid.detach())
        pool = self.indexer.index_kpool
        pools = kpool_pool_ids(indices, pool, tail=self.always_select_tail)
        return self.kernels.kpool_indexer_kl_loss(
            q, k, q_idx, k_pool, w, pools, pool, attn_scale=self.scaling, idx_scale=self.indexer.softmax_scale,
            tail=self.always_select_tail,
        )

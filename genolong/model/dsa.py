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

Two phases (:meth:`DSAMixer.project_keys`: the kv latent and pooled index keys of a token range,
position-wise; :meth:`DSAMixer.attend`: a range of queries at global positions ``q_offset ..``
over those keys). The plain forward runs them back to back on the whole sequence; context
parallelism (keys all-gathered between the phases) and the query-segmented recompute of
``memory.recompute: chunked`` run the same phases on other ranges, installed from
:mod:`genolong.parallel` (this module knows nothing of parallelism).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from ..kernels.backends import get_backend
from ..kernels.dsa import kpool_pool_ids
from .config import ModelConfig
from .layers import RMSNorm

__all__ = ["DSAAttention", "DSAIndexer", "DSAKeys", "DSAMixer", "indexer_kl_count"]


class DSAKeys(NamedTuple):
    """What the queries of a DSA layer read from the key positions ``0 .. TK - 1``
    (:meth:`DSAMixer.project_keys`; position-wise, so it can be computed in token chunks,
    concatenated along dim 1, or all-gathered over context-parallel ranks).

    Fields: ``latent [B, TK, kv_lora_rank]`` (the MLA kv latent, differentiable) and ``pooled
    [B, TK // index_kpool, index_head_dim]`` (the KPool pooled index keys of the complete pools;
    None on shared layers; differentiable only w.r.t. the indexer when the indexer KL is on).
    """

    latent: torch.Tensor
    pooled: torch.Tensor | None


class DSAAttention(NamedTuple):
    """The result of :meth:`DSAMixer.attend` for a range of queries.

    Fields: ``out [B, n, H]``; ``indices [B, n, K]`` int64 key positions (global, ``-1`` padded:
    the layer's own selection, or ``prev_indices`` on a shared layer); ``kl`` the indexer KL mean
    over this range's counted queries (scalar fp32, see :func:`indexer_kl_count`) or None when it
    was not asked for.
    """

    out: torch.Tensor
    indices: torch.Tensor
    kl: torch.Tensor | None


def indexer_kl_count(indices: torch.Tensor, pool_size: int, tail: bool = True, q_offset: int = 0) -> torch.Tensor:
    """How many queries the indexer KL counts (those with a selected complete pool; the
    denominator of :func:`~genolong.kernels.dsa.kpool_indexer_kl_loss`'s mean).

    Args:
        indices: ``[B, n, K]`` token positions in ``kpool_topk``'s layout, queries at global
            positions ``q_offset .. q_offset + n - 1``.
        pool_size: ``P``; tail: the layout has the tail slots (default True).

    Returns:
        a float64 scalar (exact integer): the KL of several query ranges is
        ``sum_r kl_r * count_r / sum_r count_r``.
    """
    pools = kpool_pool_ids(indices, pool_size, tail=tail)
    with torch.no_grad():
        tq = torch.arange(q_offset, q_offset + indices.shape[1], device=indices.device)
        ok = (pools >= 0) & ((pools + 1) * pool_size - 1 <= tq[None, :, None])
        return ok.any(-1).sum().to(torch.float64)


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
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.index_kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(self.head_dim, config.hidden_size))
        self.kernels = get_backend(config.kernel_backend)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scoring inputs (differentiable; :meth:`forward` calls it without gradient).

        Returns:
            ``q_idx [B, T, HI, DI]``, ``k_pool [B, T // P, DI]`` (complete pools only) and the
            per-head weights ``w [B, T, HI]`` float32 (``HI ** -0.5`` folded in).
        """
        q_idx, w = self.project_queries(x, q_resid)
        return q_idx, self.project_keys(x), w

    def project_queries(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query side of :meth:`project`: ``x [B, T, H]``, ``q_resid [B, T, q_lora_rank] ->
        (q_idx [B, T, HI, DI], w [B, T, HI] float32)`` (position-wise)."""
        b, t, _ = x.shape
        q_idx = self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim)
        w = self.weights_proj(x).float() * (self.n_heads**-0.5)
        return q_idx, w

    def project_keys(self, x: torch.Tensor) -> torch.Tensor:
        """The key side of :meth:`project`: ``x [B, T, H] -> k_pool [B, T // P, DI]``, the pooled
        keys of the complete pools (pool-wise: a token range starting at a multiple of ``P`` gives
        its own pools)."""
        k_idx = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        return self.kernels.kpool_keys(k_idx, gate, self.index_kpool_compress_ape)

    def select(self, q_idx: torch.Tensor, w: torch.Tensor, k_pool: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
        """The KPool top-k of queries at positions ``q_offset .. q_offset + n - 1`` over the pooled
        keys of positions ``0 .. TK - 1`` (no gradient).

        Args:
            q_idx: ``[B, n, HI, DI]``; w: ``[B, n, HI]``; k_pool: ``[B, TK // P, DI]`` with
                ``TK >= q_offset + n``; q_offset: a multiple of ``P`` (default 0).

        Returns:
            ``[B, n, index_topk + P - 1]`` int64 global token positions, in
            :func:`~genolong.kernels.dsa.kpool_topk`'s layout (ties to the lowest pool): the
            backend's ``kpool_topk`` at every offset (a context-parallel slice or a recompute
            segment runs the same kernel as the whole sequence; row ``i`` equals the whole
            sequence's row ``q_offset + i``).

        Raises:
            InputError: ``q_offset`` not a multiple of ``P`` (the keys phase pools whole pools).
        """
        p = self.index_kpool
        if q_offset % p != 0:
            raise InputError(f"the first query position ({q_offset}) must be a multiple of index_kpool ({p})")
        with torch.no_grad():
            q_idx, w, k_pool = q_idx.detach(), w.detach(), k_pool.detach()
            return self.kernels.kpool_topk(
                q_idx,
                k_pool,
                w,
                self.index_topk,
                p,
                tail=self.always_select_tail,
                scale=self.softmax_scale,
                activation="relu",
                q_offset=q_offset,
            )

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, k_pool: torch.Tensor | None = None, q_offset: int = 0
    ) -> torch.Tensor:
        """The selection of queries ``x [B, n, H]``, ``q_resid [B, n, q_lora_rank]`` at positions
        ``q_offset ..`` (no gradient): :meth:`select` over ``k_pool [B, TK // P, DI]`` (default
        None: the queries' own pooled keys, ``q_offset`` 0). Pass ``k_pool`` and ``q_offset`` by
        keyword: forward hooks then see ``(x, q_resid)`` and the selection, whatever the range."""
        with torch.no_grad():
            q_idx, w = self.project_queries(x, q_resid)
            if k_pool is None:
                k_pool = self.project_keys(x)
            return self.select(q_idx, w, k_pool, q_offset)


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
        self.scaling = self.qk_head_dim**-0.5
        self.query_block = query_block
        bias = config.attention_bias
        h = config.hidden_size
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + config.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
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
        #: the context-parallel process group, recorded by genolong.parallel.context.apply_context_parallel
        #: (which also installs the context-parallel forward); the plain forward never reads it
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

        The keys of all positions (:meth:`project_keys`), then the attention of all queries over
        them (:meth:`attend`). Context parallelism
        (:func:`genolong.parallel.context.apply_context_parallel`) and the query-segmented
        recompute (:mod:`genolong.parallel.chunked_dsa`) run the same two phases on other ranges.

        Raises:
            ValueError: a shared layer without ``prev_indices`` (or with the wrong shape).
        """
        kl = self.wants_indexer_kl()
        res = self.attend(x, self.project_keys(x, index_grad=kl), prev_indices, kl=kl)
        if res.kl is not None:
            self.last_indexer_kl = res.kl
        return res.out, (res.indices if self.returns_indices else None)

    def wants_indexer_kl(self) -> bool:
        """Whether a forward now computes the indexer KL: a layer with an indexer, ``indexer_kl``
        set and autograd recording."""
        return self.indexer is not None and self.indexer_kl and torch.is_grad_enabled()

    def project_keys(self, x: torch.Tensor, index_grad: bool = False) -> DSAKeys:
        """The keys phase: what every query reads of positions ``x [B, n, H]`` (position-wise; a
        range starting at a multiple of ``index_kpool`` gives its own complete pools).

        Args:
            x: the layer input of the key positions.
            index_grad: the pooled index keys are differentiable (w.r.t. the indexer only: its
                input is detached, as the indexer KL trains the indexer alone); default False:
                computed without autograd (they only select).

        Returns:
            :class:`DSAKeys` ``(latent [B, n, C], pooled [B, n // P, DI] or None)``.
        """
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[..., : self.kv_lora_rank])  # qk_rope_head_dim is 0
        pooled = None
        if self.indexer is not None:
            if index_grad:
                pooled = self.indexer.project_keys(x.detach())
            else:
                with torch.no_grad():
                    pooled = self.indexer.project_keys(x)
        return DSAKeys(latent, pooled)

    def attend(
        self,
        x: torch.Tensor,
        keys: DSAKeys,
        prev_indices: torch.Tensor | None = None,
        q_offset: int = 0,
        kl: bool = False,
    ) -> DSAAttention:
        """The queries phase: queries ``x [B, n, H]`` at global positions ``q_offset .. q_offset +
        n - 1`` attend over ``keys`` of positions ``0 .. TK - 1`` (``TK >= q_offset + n``; keys past
        a query are never read).

        Per query the arithmetic is that of the whole-sequence layer (projections, selection,
        sparse attention, ``o_proj`` are position-wise given the keys), so a range's rows equal
        the whole layer's rows.

        Args:
            x: the layer input of the queries.
            keys: :meth:`project_keys` of positions ``0 .. TK - 1`` (concatenated or gathered).
            prev_indices: ``[B, n, K]`` global key positions of these queries (shared layers).
            q_offset: the first query's position (default 0; a multiple of ``index_kpool`` on
                layers with an indexer unless ``keys`` are exactly the queries' own).
            kl: compute the indexer KL of these queries (needs ``keys.pooled`` from
                ``project_keys(..., index_grad=True)``); default False.

        Returns:
            :class:`DSAAttention` ``(out [B, n, H], indices [B, n, K], kl or None)``.

        Raises:
            ValueError: a shared layer without ``prev_indices`` (or with the wrong shape).
        """
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, t, self.num_heads, self.qk_head_dim)
        latent = keys.latent
        q_idx = w = None
        if self.indexer is not None:
            assert keys.pooled is not None
            # through the module call, so hooks on the indexer see (and may replace) the selection
            indices = self.indexer(x, q_resid, k_pool=keys.pooled, q_offset=q_offset)
            if kl:  # the KL trains the indexer only, on detached inputs (as DeepSeek does)
                q_idx, w = self.indexer.project_queries(x.detach(), q_resid.detach())
        else:
            self.check_prev_indices(prev_indices, b, t)
            assert prev_indices is not None
            indices = prev_indices
        if self.absorb:
            # kv_b_proj absorbed (DeepSeek's MLA trick): q . (W_k c) = (W_k^T q) . c, and the
            # output W_v (sum p c); attention runs over the [T, kv_lora_rank] latent as one shared
            # key/value head, so each selected key gathers kv_lora_rank numbers instead of
            # H * (qk_nope + v) (small: 8x fewer; GLM-5.3-Flash: 64x fewer)
            wkv = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            w_k, w_v = wkv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # [H, D, C], [H, DV, C]
            attn_q = torch.einsum("bthd,hdc->bthc", q, w_k)  # [B, n, H, C]
            attn_k = latent.unsqueeze(2)  # [B, TK, 1, C]
            o_latent = self.kernels.sparse_attention(
                attn_q, attn_k, attn_k, indices, q_offset=q_offset, scale=self.scaling, query_block=self.query_block
            )
            o = torch.einsum("bthc,hvc->bthv", o_latent, w_v)
        else:
            # expanded keys and values of every key position
            kv = self.kv_b_proj(latent).view(b, latent.shape[1], self.num_heads, -1)
            k, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            attn_q, attn_k = q, k.contiguous()
            o = self.kernels.sparse_attention(
                q, attn_k, v.contiguous(), indices, q_offset=q_offset, scale=self.scaling, query_block=self.query_block
            )
        loss = None
        if kl:
            assert q_idx is not None and w is not None and keys.pooled is not None
            loss = self._indexer_kl(q_idx, w, keys.pooled, attn_q, attn_k, indices, q_offset)
        out = self.o_proj(o.reshape(b, t, self.num_heads * self.v_head_dim))
        return DSAAttention(out, indices, loss)

    def _indexer_kl(
        self,
        q_idx: torch.Tensor,
        w: torch.Tensor,
        pooled: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        indices: torch.Tensor,
        q_offset: int = 0,
    ) -> torch.Tensor:
        """Sparse-stage indexer KL (DeepSeek-V3.2, over the selected pools; see
        :func:`genolong.kernels.dsa.kpool_indexer_kl_loss`) of queries ``q_offset ..``: the mean over
        them. ``q [B, n, H, D]`` and ``k [B, TK, HK, D]`` are the main attention's (latent or
        expanded form: same scores; detached by the kernel); ``q_idx``, ``w`` and ``pooled`` the
        indexer's (from detached inputs: the KL trains the indexer only, the LM loss everything
        else)."""
        assert self.indexer is not None
        pool = self.indexer.index_kpool
        pools = kpool_pool_ids(indices, pool, tail=self.always_select_tail)
        tk = q_offset + q.shape[1]  # the keys of positions [0, tk): what these queries can see
        # the backend's kernel at every offset (queries q_offset .., keys and pools from position 0)
        return self.kernels.kpool_indexer_kl_loss(
            q,
            k[:, :tk],
            q_idx,
            pooled[:, : tk // pool],
            w,
            pools,
            pool,
            attn_scale=self.scaling,
            idx_scale=self.indexer.softmax_scale,
            tail=self.always_select_tail,
            q_offset=q_offset,
        )

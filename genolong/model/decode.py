"""Step-by-step inference for :class:`~genolong.model.lm.GenoLM`: one token at a time, with caches.

This is the independent path of the log-prob gap check: it never runs the chunked KDA form or the
blockwise training top-k over the whole sequence. Each layer keeps a state and consumes one token
per :meth:`Decoder.step`:

- KDA layers (:class:`KDAState`): the delta-rule state ``S [B, heads, dk, dv]`` (fp32), advanced by
  the token-by-token reference :func:`genolong.kernels.kda.recurrent_kda`, and the short-conv state,
  the last ``kernel - 1`` conv inputs (the concatenated q | k | v projections) of the stream.
- DSA layers (:class:`DSACache`): the MLA latent ``RMSNorm(kv_a_proj_with_mqa(x))[:kv_lora_rank]``
  of every past token (``kv_b_proj`` expands only the selected rows, never the whole cache); on
  "full" indexer layers also the KPool pooled index keys of every completed pool and the index keys
  and gate logits of the current incomplete pool, pooled when its last token arrives. A step
  scores the completed pools with :func:`genolong.kernels.dsa.indexer_scores` through the same
  blockwise top-k engine as training (:func:`genolong.kernels.dsa.indexer.causal_topk`, same
  256-pool tiles, ties to the lowest pool), expands the winners to tokens and appends the query's
  own incomplete pool (the tail). A "shared" layer reuses the indices the preceding full layer
  chose for the same token.
- The mHC streams, norms and FFNs (dense or MoE) are the model's own modules applied to ``[B, 1]``.

Results equal the training path (``GenoLM.forward`` + ``lm_head`` + ``log_softmax``) up to float
rounding (max |log-prob diff| about 2e-6 in fp32 on the ``tiny`` preset over 4,096 tokens): the
KDA chunked and recurrent forms sum in different orders and BLAS rounds a product differently for
different matrix shapes, so the index scores of the two paths differ by about 1e-6. Exact ties
(ReLU zeros; at random init about 30% of queries have their selection boundary inside a run of
zero scores) go to the lowest pool in both paths. A pool whose score ties the boundary only within
rounding can be chosen by one path and not the other (at random init about once in 8,000
query-layers), which moves that token's log-probs by ~1e-2: a property of top-k, not a decode error.
:meth:`Decoder.prefill` fills the caches from a prompt with the training path (chunked KDA with
its final state) and the step path continues from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..kernels.dsa import indexer_scores, kpool_keys
from ..kernels.dsa.indexer import causal_topk
from ..kernels.kda import recurrent_kda
from .cache import KDAState, _grow, kda_init_state
from .config import INDEXED_ATTENTION
from .dsa import DSAIndexer, DSAMixer
from .kda import KDAMixer, l2_normalize
from .lm import Block, GenoLM
from .mhc import collapse_streams, expand_streams, merge_streams

__all__ = ["DSACache", "DecodeState", "Decoder", "KDAState", "decode_log_probs", "sequence_log_probs"]

# pools per scoring tile: kpool_topk's default block_size, so a step scores the same tiles as training
_POOL_BLOCK = 256
_MIN_CAPACITY = 256


@dataclass
class DSACache:
    """Decoding cache of one DSA layer; rows ``[0, length)`` of the growable buffers are filled.

    Attributes:
        latent: MLA latents after ``kv_a_layernorm``, ``[B, capacity, kv_lora_rank]`` (model dtype).
        pooled: KPool pooled index keys of the completed pools, ``[B, capacity // P, index_head_dim]``
            (None on shared layers, which have no indexer).
        pool_keys: index keys ``LayerNorm(wk(x))`` of the current incomplete pool, ``[B, P, index_head_dim]``
            (slot ``t % P`` holds token ``t``; None on shared layers).
        pool_gate: KPool gate logits of the current incomplete pool, ``[B, P, index_head_dim]`` (None on
            shared layers).
        last_indices: the token positions ``[B, index_topk + P - 1]`` (``-1`` padded) the last step
            attended to (selected pools best first, then the tail); None before the first step.
    """

    latent: torch.Tensor
    pooled: torch.Tensor | None
    pool_keys: torch.Tensor | None
    pool_gate: torch.Tensor | None
    last_indices: torch.Tensor | None = None


@dataclass
class DecodeState:
    """The whole model's decoding state.

    Attributes:
        position: tokens consumed so far (the next token's position).
        layers: one :class:`KDAState` or :class:`DSACache` per layer, in layer order.
    """

    position: int
    layers: list[KDAState | DSACache]

    @property
    def batch_size(self) -> int:
        """B."""
        first = self.layers[0]
        return (first.recurrent if isinstance(first, KDAState) else first.latent).shape[0]


# ---------------------------------------------------------------------------------------------------
# KDA


def kda_step(mixer: KDAMixer, x: torch.Tensor, state: KDAState) -> torch.Tensor:
    """One token through a KDA layer: ``x [B, H] -> [B, H]``; ``state`` is advanced in place.

    The same ops as :meth:`KDAMixer.forward`, with the short conv read from ``state.conv`` (same
    multiply-add order as :class:`~genolong.model.kda.ShortConv`) and the recurrence of
    :func:`~genolong.kernels.kda.recurrent_kda` started from ``state.recurrent``.
    """
    b = x.shape[0]
    x3 = x[:, None]  # [B, 1, H]
    heads = (b, 1, mixer.num_heads, mixer.head_dim)
    proj = torch.cat([mixer.q_proj(x3), mixer.k_proj(x3), mixer.v_proj(x3)], dim=-1).float()  # [B, 1, C]
    window = torch.cat([state.conv, proj], dim=1)  # [B, kernel, C]: oldest first, this token last
    w = mixer.conv1d.weight[:, 0, :].float()  # [C, kernel]
    kernel = w.shape[-1]
    acc = window[:, kernel - 1] * w[:, kernel - 1]
    for j in range(kernel - 1):
        acc = acc + window[:, j] * w[:, j]
    mixed = F.silu(acc).to(x.dtype)  # [B, C]
    state.conv = window[:, 1:]
    q, k, v = (part.reshape(heads) for part in mixed.split(mixer.num_heads * mixer.head_dim, dim=-1))
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    g = mixer.forget_gate(x3)  # [B, 1, heads, dk]
    beta = torch.sigmoid(mixer.b_proj(x3).float())  # [B, 1, heads]
    o, s = recurrent_kda(q, k, v.float(), g, beta, initial_state=state.recurrent, output_final_state=True)
    assert s is not None
    state.recurrent = s
    gate = mixer.g_b_proj(mixer.g_a_proj(x3)).view(heads)
    return mixer.o_proj(mixer.o_norm(o.to(x.dtype), gate).reshape(b, -1))


def kda_prefill(mixer: KDAMixer, x: torch.Tensor) -> tuple[torch.Tensor, KDAState]:
    """A prompt through a KDA layer by the training path: ``x [B, T, H] -> (out [B, T, H], state)``."""
    b, t, _ = x.shape
    out, s = mixer(x, output_final_state=True)
    kernel = mixer.conv1d.weight.shape[-1]
    tail = x[:, max(t - (kernel - 1), 0) :]
    proj = torch.cat([mixer.q_proj(tail), mixer.k_proj(tail), mixer.v_proj(tail)], dim=-1).float()
    conv = F.pad(proj, (0, 0, kernel - 1 - proj.shape[1], 0))  # zeros before the sequence start
    return out, KDAState(recurrent=s, conv=conv)


# ---------------------------------------------------------------------------------------------------
# DSA


def dsa_init_cache(
    mixer: DSAMixer, batch_size: int, device: torch.device, dtype: torch.dtype, capacity: int
) -> DSACache:
    """Empty cache of ``mixer`` for ``batch_size`` sequences, room for ``capacity`` tokens (grows)."""
    ix = mixer.indexer
    latent = torch.zeros(batch_size, capacity, mixer.kv_lora_rank, dtype=dtype, device=device)
    if ix is None:
        return DSACache(latent=latent, pooled=None, pool_keys=None, pool_gate=None)
    p, di = ix.index_kpool, ix.head_dim
    return DSACache(
        latent=latent,
        pooled=torch.zeros(batch_size, max(capacity // p, 1), di, dtype=dtype, device=device),
        pool_keys=torch.zeros(batch_size, p, di, dtype=dtype, device=device),
        pool_gate=torch.zeros(batch_size, p, di, dtype=dtype, device=device),
    )


def _expand_pools(pools: torch.Tensor, position: int, pool_size: int, tail: bool) -> torch.Tensor:
    """Token positions of the selected pools ``[B, KP]`` plus the tail of the query at ``position``.

    The layout of :func:`genolong.kernels.dsa.kpool_expand` for one query: pools best first, each as
    ``j * P .. j * P + P - 1`` (``-1`` for an empty slot), then ``position + 1 - r .. position`` with
    ``r = (position + 1) % P``, padded with ``-1`` to ``P - 1`` slots.
    """
    b, kp = pools.shape
    p = pool_size
    offs = torch.arange(p, device=pools.device)
    tok = (pools[..., None] * p + offs).masked_fill(pools[..., None] < 0, -1).reshape(b, kp * p)
    if not tail or p == 1:
        return tok
    r = (position + 1) % p
    offs = offs[: p - 1]
    tail_tok = (position + 1 - r + offs).masked_fill(offs >= r, -1)
    return torch.cat([tok, tail_tok[None].expand(b, p - 1)], dim=-1)


def _indexer_step(
    ix: DSAIndexer, x3: torch.Tensor, q_resid: torch.Tensor, cache: DSACache, position: int
) -> torch.Tensor:
    """Selection of the query at ``position``: ``x3 [B, 1, H]``, ``q_resid [B, 1, q_lora] -> [B, topk + P - 1]``."""
    assert cache.pooled is not None and cache.pool_keys is not None and cache.pool_gate is not None
    b = x3.shape[0]
    p = ix.index_kpool
    slot = position % p
    cache.pool_keys[:, slot] = ix.k_norm(ix.wk(x3))[:, 0]
    cache.pool_gate[:, slot] = F.linear(x3, ix.index_kpool_compress_gate)[:, 0]
    n_pools = (position + 1) // p  # completed pools, all visible to this query
    if slot == p - 1:  # this token completes pool n_pools - 1
        cache.pooled = _grow(cache.pooled, n_pools)
        cache.pooled[:, n_pools - 1] = kpool_keys(cache.pool_keys, cache.pool_gate, ix.index_kpool_compress_ape)[:, 0]
    q_idx = ix.wq_b(q_resid).view(b, 1, ix.n_heads, ix.head_dim)
    w = ix.weights_proj(x3).float() * (ix.n_heads**-0.5)  # [B, 1, HI]
    pooled = cache.pooled

    def score_fn(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return indexer_scores(q_idx, pooled[:, k0:k1], w, ix.softmax_scale, "relu")

    limit = torch.tensor([n_pools - 1], device=x3.device)
    pools = causal_topk(score_fn, limit, n_pools, ix.index_topk // p, _POOL_BLOCK, 1, b, x3.device)[:, 0]
    return _expand_pools(pools, position, p, ix.always_select_tail)


def dsa_step(
    mixer: DSAMixer, x: torch.Tensor, cache: DSACache, position: int, prev_indices: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token through a DSA layer.

    Args:
        mixer: the layer.
        x: ``[B, H]``, the token at ``position``.
        cache: the layer's cache holding positions ``[0, position)``; this token is appended.
        position: the token's position.
        prev_indices: ``[B, K]`` the preceding full layer's selection for this token (shared layers only).

    Returns:
        ``(out [B, H], indices [B, K])``: the selected token positions (``-1`` padded) this layer used.
    """
    b = x.shape[0]
    x3 = x[:, None]
    q_resid = mixer.q_a_layernorm(mixer.q_a_proj(x3))  # [B, 1, q_lora]
    q = mixer.q_b_proj(q_resid).view(b, mixer.num_heads, mixer.qk_head_dim)
    latent = mixer.kv_a_layernorm(mixer.kv_a_proj_with_mqa(x3)[..., : mixer.kv_lora_rank])  # [B, 1, L]
    cache.latent = _grow(cache.latent, position + 1)
    cache.latent[:, position] = latent[:, 0]
    if mixer.indexer is not None:
        indices = _indexer_step(mixer.indexer, x3, q_resid, cache, position)
    else:
        if prev_indices is None or prev_indices.dim() != 2 or prev_indices.shape[0] != b:
            raise ValueError(
                f"DSA layer {mixer.layer_idx} is a 'shared' indexer layer and needs the preceding full "
                f"layer's indices [B={b}, K] for this token"
            )
        indices = prev_indices
    cache.last_indices = indices
    valid = (indices >= 0) & (indices <= position)  # [B, K]
    rows = indices.clamp(min=0)[..., None].expand(-1, -1, mixer.kv_lora_rank)
    kv = mixer.kv_b_proj(cache.latent.gather(1, rows)).view(b, indices.shape[1], mixer.num_heads, -1)
    k, v = kv.split([mixer.qk_nope_head_dim, mixer.v_head_dim], dim=-1)  # [B, K, heads, .]
    # the op order of sparse_attention's forward, for one query
    s = torch.einsum("bhd,bkhd->bhk", q.float(), k.float()) * mixer.scaling
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    pr = torch.exp(s - m)
    den = pr.sum(-1, keepdim=True)
    o = torch.einsum("bhk,bkhd->bhd", pr, v.float()) / den.clamp(min=torch.finfo(torch.float32).tiny)
    out = mixer.o_proj(o.reshape(b, mixer.num_heads * mixer.v_head_dim).to(x.dtype))
    return out, indices


def dsa_prefill(
    mixer: DSAMixer, x: torch.Tensor, prev_indices: torch.Tensor | None, capacity: int
) -> tuple[torch.Tensor, torch.Tensor | None, DSACache]:
    """A prompt through a DSA layer by the training path.

    Shapes: ``x [B, T, H]``, ``prev_indices [B, T, K]`` (shared layers) ``-> (out [B, T, H],
    indices for the next layer or None, cache)`` with room for ``capacity >= T`` tokens.
    """
    b, t, _ = x.shape
    out, indices = mixer(x, prev_indices)
    cache = dsa_init_cache(mixer, b, x.device, x.dtype, max(capacity, t))
    cache.latent[:, :t] = mixer.kv_a_layernorm(mixer.kv_a_proj_with_mqa(x)[..., : mixer.kv_lora_rank])
    ix = mixer.indexer
    if ix is not None:
        assert cache.pooled is not None and cache.pool_keys is not None and cache.pool_gate is not None
        p = ix.index_kpool
        k_idx = ix.k_norm(ix.wk(x))
        gate = F.linear(x, ix.index_kpool_compress_gate)
        n_pools = t // p
        cache.pooled = _grow(cache.pooled, n_pools)
        cache.pooled[:, :n_pools] = kpool_keys(k_idx, gate, ix.index_kpool_compress_ape)
        rest = t - n_pools * p  # tokens of the incomplete pool, in slots 0 .. rest - 1
        cache.pool_keys[:, :rest] = k_idx[:, n_pools * p :]
        cache.pool_gate[:, :rest] = gate[:, n_pools * p :]
    return out, indices, cache


# ---------------------------------------------------------------------------------------------------
# the whole model


def _is_dsa(block: Block) -> bool:
    return block.layer_type == INDEXED_ATTENTION


class Decoder:
    """Token-by-token inference over a :class:`GenoLM` (its parameters are used, not copied or changed).

    Args:
        model: the model; its parameters' device and dtype are used for the caches.

    Usage::

        dec = Decoder(model)
        dec.init_state(batch_size=2)          # or dec.prefill(prompt_ids [B, T0])
        lp = dec.step(token_ids)              # token_ids [B] -> log-probs of the next token [B, V] fp32

    The state is :attr:`state` (a :class:`DecodeState`; it may be read, copied or replaced; its
    tensors are inference tensors, made under ``torch.inference_mode``, which is about 20% faster
    per step than ``no_grad`` for small models: replace them rather than write into them). Each
    step costs O(layers * (dk * dv + index_topk)) per sequence, independent of the position apart
    from scoring the ``position / index_kpool`` pooled keys.
    """

    def __init__(self, model: GenoLM):
        if not isinstance(model, GenoLM):
            raise InputError(f"Decoder needs a genolong GenoLM model; got {type(model).__name__}")
        self.model = model
        self.state: DecodeState | None = None
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype

    def init_state(self, batch_size: int, capacity: int = _MIN_CAPACITY) -> DecodeState:
        """Reset to the empty state (before token 0) for ``batch_size`` sequences and return it.

        Args:
            batch_size: B (>= 1).
            capacity: DSA cache rows allocated up front (default 256; the caches grow by doubling).
        """
        if batch_size < 1 or capacity < 1:
            raise InputError(f"batch_size and capacity must be >= 1; got {batch_size} and {capacity}")
        layers: list[KDAState | DSACache] = []
        for block in self.model.layers:
            if _is_dsa(block):
                layers.append(dsa_init_cache(block.self_attn, batch_size, self.device, self.dtype, capacity))
            else:
                layers.append(kda_init_state(block.self_attn, batch_size, self.device))
        self.state = DecodeState(position=0, layers=layers)
        return self.state

    def _check_ids(self, ids: torch.Tensor, ndim: int, name: str) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != ndim or ids.dtype.is_floating_point or ids.numel() == 0:
            shape = "[B]" if ndim == 1 else "[B, T]"
            raise InputError(
                f"{name} must be a non-empty integer tensor {shape}; got {getattr(ids, 'shape', type(ids))}"
            )
        vocab = self.model.config.vocab_size
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise InputError(
                f"{name} holds ids outside [0, {vocab}) (min {lo}, max {hi}); map tokens into the model's vocabulary"
            )
        return ids.to(self.device, torch.long)

    def _log_probs(self, streams: torch.Tensor) -> torch.Tensor:
        hidden = self.model.norm(collapse_streams(streams))
        return self.model.logits(hidden).float().log_softmax(-1)

    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Consume one token per sequence; return the log-probs of the next token.

        Args:
            token_ids: ``[B]`` integer ids (the tokens at position ``state.position``).

        Returns:
            ``[B, vocab_size]`` float32 log-probabilities (``log_softmax`` of the LM head).

        Raises:
            InputError: no state yet (call :meth:`init_state` or :meth:`prefill`), a batch size
                other than the state's, or ids outside the vocabulary.
        """
        if self.state is None:
            raise InputError("Decoder.step needs a state: call init_state(batch_size) or prefill(prompt_ids) first")
        ids = self._check_ids(token_ids, 1, "token_ids")
        state = self.state
        if ids.shape[0] != state.batch_size:
            raise InputError(
                f"token_ids has {ids.shape[0]} sequences but the state holds {state.batch_size}; "
                "call init_state with the new batch size"
            )
        t = state.position
        model = self.model
        streams = expand_streams(model.embed_tokens(ids[:, None]), model.config.hc_mult)  # [B, 1, m, H]
        indices: torch.Tensor | None = None
        for block, layer_state in zip(model.layers, state.layers):
            post, comb, x = block.attn_hc(streams)
            x = block.input_layernorm(x)[:, 0]  # [B, H]
            if _is_dsa(block):
                assert isinstance(layer_state, DSACache)
                y, used = dsa_step(block.self_attn, x, layer_state, t, indices)
                indices = used if block.self_attn.returns_indices else None
            else:
                assert isinstance(layer_state, KDAState)
                y = kda_step(block.self_attn, x, layer_state)
                indices = None
            streams = merge_streams(post, comb, y[:, None], streams)
            post, comb, x = block.ffn_hc(streams)
            x = block.mlp(block.post_attention_layernorm(x))
            streams = merge_streams(post, comb, x, streams)
        state.position = t + 1
        return self._log_probs(streams)[:, 0]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, capacity: int = _MIN_CAPACITY) -> torch.Tensor:
        """Run a prompt by the training path and keep the state after it (replaces :attr:`state`).

        Args:
            input_ids: ``[B, T]`` prompt ids.
            capacity: minimum DSA cache rows (default 256; at least ``T`` are allocated).

        Returns:
            ``[B, T, vocab_size]`` float32 log-probs of the token after each prompt position.
        """
        ids = self._check_ids(input_ids, 2, "input_ids")
        b, t = ids.shape
        model = self.model
        streams = expand_streams(model.embed_tokens(ids), model.config.hc_mult)
        indices: torch.Tensor | None = None
        layers: list[KDAState | DSACache] = []
        cap = max(capacity, t)
        for block in model.layers:
            post, comb, x = block.attn_hc(streams)
            x = block.input_layernorm(x)
            if _is_dsa(block):
                y, indices, cache = dsa_prefill(block.self_attn, x, indices, cap)
                layers.append(cache)
            else:
                y, kda_state = kda_prefill(block.self_attn, x)
                layers.append(kda_state)
                indices = None
            streams = merge_streams(post, comb, y, streams)
            post, comb, x = block.ffn_hc(streams)
            x = block.mlp(block.post_attention_layernorm(x))
            streams = merge_streams(post, comb, x, streams)
        self.state = DecodeState(position=t, layers=layers)
        return self._log_probs(streams)


def decode_log_probs(model: GenoLM, input_ids: torch.Tensor, prefill: int = 0) -> torch.Tensor:
    """Log-probs of the token after every position, by the step path.

    Args:
        model: the model.
        input_ids: ``[B, T]`` ids.
        prefill: the first ``prefill`` positions go through :meth:`Decoder.prefill` (training path);
            the rest, one :meth:`Decoder.step` each (default 0: every position is stepped).

    Returns:
        ``[B, T, vocab_size]`` float32; row ``t`` is the distribution of token ``t + 1``.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1 or not 0 <= prefill <= input_ids.shape[1]:
        raise InputError(
            f"input_ids must be [B, T] with T >= 1 and 0 <= prefill <= T; got shape "
            f"{tuple(input_ids.shape)}, prefill {prefill}"
        )
    dec = Decoder(model)
    b, t = input_ids.shape
    parts: list[torch.Tensor] = []
    if prefill:
        parts.append(dec.prefill(input_ids[:, :prefill], capacity=t))
    else:
        dec.init_state(b, capacity=t)
    parts.extend(dec.step(input_ids[:, i])[:, None] for i in range(prefill, t))
    return torch.cat(parts, dim=1)


def sequence_log_probs(model: GenoLM, input_ids: torch.Tensor, prefill: int = 0) -> torch.Tensor:
    """Log-prob of each next token by the step path: ``input_ids [B, T] -> [B, T - 1]`` float32.

    Entry ``t`` is ``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])``; ``prefill`` as in
    :func:`decode_log_probs`.
    """
    lp = decode_log_probs(model, input_ids, prefill)
    return lp[:, :-1].gather(-1, input_ids[:, 1:, None].to(lp.device, torch.long))[..., 0]

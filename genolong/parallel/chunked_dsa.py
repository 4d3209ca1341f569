"""The attention half of a DSA block in query segments, for ``memory.recompute: chunked``.

A block's attention half (:class:`~genolong.model.lm.Block`: ``attn_hc -> input_layernorm ->
self_attn -> merge_streams``) on a DSA layer, run so that autograd keeps only small things and
backward rebuilds at most ``chunk_tokens`` query positions at a time:

1. Keys phase, in token chunks of ``chunk_tokens``, each under non-reentrant
   :func:`torch.utils.checkpoint.checkpoint`: ``attn_hc -> input_layernorm ->``
   :meth:`DSAMixer.project_keys <genolong.model.dsa.DSAMixer.project_keys>`. Kept for backward:
   the chunk outputs concatenated, i.e. the whole slice's kv latent ``[B, T, kv_lora_rank]`` and
   (full indexer layers) the pooled index keys ``[B, T // P, index_head_dim]``; the chunk inputs
   are views of the block input ``streams`` (which the caller keeps anyway).
2. Under context parallelism (``block.self_attn.cp_group`` set by
   :func:`genolong.parallel.context.apply_context_parallel`): one all-gather of those keys over the
   CP group, as :mod:`genolong.parallel.cp_dsa` does (:func:`~genolong.parallel.cp_dsa.gather_keys`);
   the gathered keys of positions ``[0, end)`` are kept (not re-gathered in backward: the
   all-gather's backward is one reduce-scatter of their summed gradient).
3. Queries phase, in segments of ``chunk_tokens`` queries, each checkpointed: ``attn_hc ->
   input_layernorm ->`` :meth:`DSAMixer.attend <genolong.model.dsa.DSAMixer.attend>` (q
   projections, indexer top-k, sparse attention over the keys up to the segment's end, ``o_proj``,
   the indexer KL: the backend's kernels with the segment's ``q_offset``, the Triton ones on the
   ``triton`` backend) ``-> merge_streams``. Kept: nothing of its own (its inputs are views of the
   streams, of the keys and of ``prev_indices``).

Per query the arithmetic is the whole half's (every op is position-wise given the keys), so the
outputs and the selected indices equal the unsegmented half's; gradients sum the same terms over
segments in another order (float rounding); the indexer KL is ``sum_s KL_s * n_s / sum_s n_s``
over the segments' means ``KL_s`` of ``n_s`` counted queries (under CP ``sum_s n_s`` is over the
group: each rank's ``last_indexer_kl`` is its share, as :func:`~genolong.parallel.cp_dsa.cp_dsa_forward`).

Segment starts must be multiples of ``index_kpool`` (so a segment's queries own whole pools and
the keys chunks pool exactly the whole-sequence pools): ``chunk_tokens % index_kpool == 0``
(``memory.recompute_chunk_tokens`` is a multiple of 64).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import InputError
from ..model.dsa import DSAKeys, DSAMixer, indexer_kl_count
from ..model.mhc import merge_streams
from .cp_dsa import check_cp_input, gather_keys, kl_share

__all__ = ["dsa_attention_half"]


def _keys_chunk(block: nn.Module, streams: torch.Tensor, index_grad: bool) -> DSAKeys:
    """Keys of a token chunk: ``streams [B, c, m, H] -> DSAKeys(latent [B, c, C], pooled)``."""
    _, _, x = block.attn_hc(streams)
    return block.self_attn.project_keys(block.input_layernorm(x), index_grad=index_grad)


def _query_segment(
    block: nn.Module,
    streams: torch.Tensor,
    latent: torch.Tensor,
    pooled: torch.Tensor | None,
    prev_indices: torch.Tensor | None,
    q_offset: int,
    kl: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One query segment of the half: ``streams [B, n, m, H]`` at global positions ``q_offset ..``
    over the keys of positions ``[0, q_offset + n)`` -> ``(streams out [B, n, m, H], indices
    [B, n, K], KL mean or None, KL count or None)``."""
    mixer: DSAMixer = block.self_attn
    post, comb, x = block.attn_hc(streams)
    x = block.input_layernorm(x)
    end = q_offset + streams.shape[1]  # keys past the segment are never read: not handed over
    keys = DSAKeys(latent[:, :end], None if pooled is None else pooled[:, : end // mixer.indexer.index_kpool])
    res = mixer.attend(x, keys, prev_indices, q_offset=q_offset, kl=kl)
    count = None
    if kl:
        count = indexer_kl_count(res.indices, mixer.indexer.index_kpool, mixer.always_select_tail, q_offset)
    return merge_streams(post, comb, res.out, streams), res.indices, res.kl, count


def _plain_half(
    block: nn.Module, streams: torch.Tensor, prev_indices: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    post, comb, x = block.attn_hc(streams)
    x, indices = block.self_attn(block.input_layernorm(x), prev_indices)
    return merge_streams(post, comb, x, streams), indices


def dsa_attention_half(
    block: nn.Module,
    streams: torch.Tensor,
    prev_indices: torch.Tensor | None,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A DSA block's attention half with its backward rebuilt ``chunk_tokens`` queries at a time.

    Equal to ``attn_hc -> input_layernorm -> self_attn -> merge_streams`` of ``block`` (outputs
    and indices exactly; gradients and the indexer KL to float rounding, see the module doc),
    on one process or, with ``block.self_attn.cp_group`` set, on this rank's slice under context
    parallelism (every rank of the group must call it; indices in global positions). Without
    autograd recording it runs the plain half (nothing is kept then).

    Args:
        block: a :class:`~genolong.model.lm.Block` whose ``self_attn`` is a
            :class:`~genolong.model.dsa.DSAMixer`.
        streams: ``[B, T, m, H]`` the block input (this rank's slice under CP).
        prev_indices: ``[B, T, K]`` the previous full layer's indices (shared layers), else None.
        chunk_tokens: queries per segment and tokens per keys chunk; a positive multiple of
            ``index_kpool`` on layers with an indexer.

    Returns:
        ``(streams [B, T, m, H], indices [B, T, index_topk + index_kpool - 1] or None)``: indices
        when ``self_attn.returns_indices`` (as the plain half). Sets ``self_attn.last_indexer_kl``
        as the plain mixer does.

    Raises:
        InputError: a block without a DSA mixer, a bad ``chunk_tokens``, bad shapes, a shared
            layer without ``prev_indices``, or (CP) a slice length that splits a pool.
    """
    mixer = getattr(block, "self_attn", None)
    if not isinstance(mixer, DSAMixer):
        raise InputError(f"dsa_attention_half needs a Block with a DSA mixer; got self_attn {type(mixer).__name__}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be a positive integer; got {chunk_tokens!r}")
    ix = mixer.indexer
    pool = mixer.indexer.index_kpool if ix is not None else 1
    if chunk_tokens % pool:
        raise InputError(
            f"memory.recompute_chunk_tokens ({chunk_tokens}) must be a multiple of index_kpool ({pool}) so that "
            "query segments and key chunks hold whole KPool pools"
        )
    if streams.dim() != 4:
        raise InputError(f"streams must be [B, T, hc_mult, hidden]; got shape {tuple(streams.shape)}")
    if not torch.is_grad_enabled():
        return _plain_half(block, streams, prev_indices)
    b, t = streams.shape[:2]
    group = mixer.cp_group
    if group is not None:
        check_cp_input(mixer, streams[:, :, 0], prev_indices)
    elif ix is None:
        mixer.check_prev_indices(prev_indices, b, t)
    kl = mixer.wants_indexer_kl()

    # 1. the keys of the slice, chunk by chunk (kept: the concatenated latent and pooled keys)
    chunks = [
        checkpoint(_keys_chunk, block, streams[:, c0 : c0 + chunk_tokens], kl, use_reentrant=False)
        for c0 in range(0, t, chunk_tokens)
    ]
    latent = torch.cat([c.latent for c in chunks], dim=1) if len(chunks) > 1 else chunks[0].latent
    pooled = None
    if ix is not None:
        pooled = torch.cat([c.pooled for c in chunks], dim=1) if len(chunks) > 1 else chunks[0].pooled
    del chunks
    keys = DSAKeys(latent, pooled)
    start = 0
    if group is not None:  # 2. positions [0, end) from ranks 0..rank, in one all-gather
        rank = dist.get_rank(group)
        start = rank * t
        keys = gather_keys(mixer, keys, group, rank)

    # 3. the queries, segment by segment
    outs, indices, kls, counts = [], [], [], []
    for s0 in range(0, t, chunk_tokens):
        s1 = min(s0 + chunk_tokens, t)
        prev = None if prev_indices is None or ix is not None else prev_indices[:, s0:s1]
        out, idx, kl_s, n_s = checkpoint(
            _query_segment,
            block,
            streams[:, s0:s1],
            keys.latent,
            keys.pooled,
            prev,
            start + s0,
            kl,
            use_reentrant=False,
        )
        outs.append(out)
        if mixer.returns_indices:
            indices.append(idx)
        if kl:
            kls.append(kl_s)
            counts.append(n_s)
    if kl:
        local = torch.stack(counts).sum()
        total = sum(k * n.to(k.dtype) for k, n in zip(kls, counts))
        mean = total / local.clamp(min=1).to(total.dtype)  # the mean over this rank's counted queries
        mixer.last_indexer_kl = mean if group is None else kl_share(mixer, mean, local, group)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if not mixer.returns_indices:
        return out, None
    return out, torch.cat(indices, dim=1) if len(indices) > 1 else indices[0]

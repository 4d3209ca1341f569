"""A long prefix through a :class:`~genolong.model.stream.PrefillStream` by a context-parallel group.

:class:`~genolong.model.stream.PrefillStream` runs a sequence in one process, segment after
segment; the model's context-parallel forward (:mod:`genolong.parallel.context`) runs it at once
over ``W`` ranks but keeps nothing for what follows. :func:`cp_prefill` joins them: the ranks of a
CP group each run one contiguous slice of a prefix with the same pieces the CP forward uses, and
every rank ends with the stream state the one-process stream would have after the whole prefix,
from which each continues alone (e.g. each with its own share of a block's variants,
:func:`genolong.evaluation.variant_score.score_block`):

- KDA layers: the short conv's halo across the rank boundary (:func:`~genolong.kernels.kda.cp.conv_halo`),
  the slice's affine state map (:meth:`~genolong.model.kda.KDAMixer.segment_transition`) folded
  over the earlier ranks (:func:`~genolong.kernels.kda.cp.fold_states`) into the slice's incoming
  state, then :meth:`~genolong.model.kda.KDAMixer.forward_segment` from it (the two passes of
  :mod:`genolong.parallel.chunked_kda` under CP). The last rank's final state and conv tail are
  the stream's: broadcast to the group.
- DSA layers: :meth:`~genolong.model.dsa.DSAMixer.project_keys` of the slice, one all-gather of
  the kv latents and pooled index keys (:func:`~genolong.parallel.cp_dsa.gather_keys`, every rank
  receiving all of them: they are the stream's caches), ``attend`` of the slice's queries over the
  keys up to its end at their global offset (as :func:`~genolong.parallel.cp_dsa.cp_dsa_forward`).
  The prefix ends on a pool boundary, so no incomplete pool is pending.
- embeddings, hyper-connections, norms and FFNs are position-wise: each rank runs its slice.

Results equal the one-process stream up to float rounding: the state reaches the slices by the
fold (another product order than one sequential recurrence), as under CP training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..kernels.kda.cp import conv_halo, fold_states
from ..model.config import INDEXED_ATTENTION
from ..model.dsa import DSAKeys
from ..model.mhc import collapse_streams, expand_streams, merge_streams
from ..model.stream import PrefillStream, StreamDSA
from .cp_dsa import gather_keys

__all__ = ["cp_prefill"]


@torch.no_grad()
def cp_prefill(stream: PrefillStream, input_ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Run a prefix split over ``group`` into a fresh ``stream``, on every rank of the group.

    Every rank of ``group`` must call it (collectives) with its own slice, of one length: rank
    ``r`` holds positions ``[r n, (r + 1) n)`` of a prefix of ``W n`` tokens, ``n`` a multiple of
    :func:`genolong.config.kernel_multiple` ``(config, 1)`` (whole KDA chunks and DSA pools per
    slice). Afterwards every rank's ``stream`` is at position ``W n`` with the KDA states, conv
    tails and DSA caches of the whole prefix (the one-process stream's, to float rounding), and
    :meth:`PrefillStream.extend` continues from there on each rank alone.

    Args:
        stream: a :class:`PrefillStream` at position 0 of a model without context parallelism
            installed (the same weights on every rank).
        input_ids: ``[B, n]`` model ids of this rank's slice.
        group: the context-parallel process group (``W`` ranks).

    Returns:
        ``[B, 1, H]``: the final hidden row of the prefix's last token (the last rank's, on every
        rank), which predicts the token after the prefix.

    Raises:
        InputError: a stream not at position 0, or an empty slice.
    """
    if stream.position != 0:
        raise InputError(f"cp_prefill starts a stream; this one is at position {stream.position}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise InputError(f"input_ids must be this rank's slice [B, n] with n >= 1; got shape {tuple(input_ids.shape)}")
    model = stream.model
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    last = dist.get_global_rank(group, world - 1)
    n = input_ids.shape[1]
    lo, end = rank * n, world * n
    streams = expand_streams(model.embed_tokens(input_ids), model.config.hc_mult)
    indices: torch.Tensor | None = None
    for block, state in zip(model.layers, stream.layers):
        post, comb, x = block.attn_hc(streams)
        x = block.input_layernorm(x)
        mixer = block.self_attn
        if block.layer_type == INDEXED_ATTENTION:
            assert isinstance(state, StreamDSA)
            # every rank receives every slice's keys: the stream's caches of the whole prefix
            keys = gather_keys(mixer, mixer.project_keys(x), group, world - 1)
            pool = stream.pool
            seen = DSAKeys(keys.latent[:, : lo + n], None if keys.pooled is None else keys.pooled[:, : (lo + n) // pool])
            res = mixer.attend(x, seen, indices, q_offset=lo)
            y, indices = res.out, (res.indices if mixer.returns_indices else None)
            state.latent = state.latent.new_zeros(state.latent.shape[0], max(state.latent.shape[1], end),
                                                  *state.latent.shape[2:])
            state.latent[:, :end] = keys.latent
            if state.pooled is not None:
                assert keys.pooled is not None
                state.pooled = state.pooled.new_zeros(state.pooled.shape[0], max(state.pooled.shape[1], end // pool),
                                                      *state.pooled.shape[2:])
                state.pooled[:, : end // pool] = keys.pooled
            state.pending = x[:, :0].clone()  # the prefix ends on a pool boundary
        else:
            projected = mixer.project(x)
            halo = conv_halo(projected, mixer.conv1d.weight.shape[-1], group)  # a collective: every rank
            halo = halo if rank > 0 else None  # rank 0: zeros before the sequence, as the stream's start
            # the slice's map S -> A S + B (rank 0's is never used: it starts from zeros), folded
            # over the earlier ranks into the slice's incoming state (collectives: every rank)
            _, carried = mixer.segment_transition(x, halo, None)
            incoming = fold_states(carried, group, mixer.head_dim)
            y, tail, final = mixer.forward_segment(x, halo, incoming if rank > 0 else None, output_tail=True)
            assert tail is not None
            # the stream continues from the last rank's state and conv tail
            tail, final = tail.float().contiguous(), final.contiguous()
            dist.broadcast(tail, src=last, group=group)
            dist.broadcast(final, src=last, group=group)
            state.conv, state.recurrent = tail, final
            indices = None
        streams = block.ffn_half(merge_streams(post, comb, y, streams))
    stream.position = end
    hidden = model.norm(collapse_streams(streams[:, -1:])).contiguous()
    dist.broadcast(hidden, src=last, group=group)
    return hidden

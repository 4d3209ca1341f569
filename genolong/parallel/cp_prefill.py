"""A long prefix through a :class:`~genolong.model.stream.PrefillStream` by a context-parallel group.

:class:`~genolong.model.stream.PrefillStream` runs a sequence in one process, segment after
segment; the model's context-parallel forward (:mod:`genolong.parallel.context`) runs it at once
over ``W`` ranks but keeps nothing for what follows. :func:`cp_prefill` joins them: the ranks of a
CP group each run one contiguous slice of a stretch of the prefix with the same pieces the CP
forward uses, and every rank ends with the stream state the one-process stream would have after
it; stretch after stretch (each rank's slice about one segment, so the memory stays one
segment's plus the caches), then each rank continues alone (e.g. with its own share of a block's
variants, :func:`genolong.evaluation.variant_score.score_block`):

- KDA layers: the short conv's halo across the rank boundary (:func:`~genolong.kernels.kda.cp.conv_halo`),
  the slice's affine state map (:meth:`~genolong.model.kda.KDAMixer.segment_transition`) folded
  over the earlier ranks (:func:`~genolong.kernels.kda.cp.fold_states`) into the slice's incoming
  state, then :meth:`~genolong.model.kda.KDAMixer.forward_segment` from it (the two passes of
  :mod:`genolong.parallel.chunked_kda` under CP). Rank 0 starts from the stream's conv tail and
  state (its map composed onto the constant ``[S_0 | 0]``, so the fold carries ``S_0`` on). The
  last rank's final state and conv tail are the stream's: broadcast to the group.
- DSA layers: :meth:`~genolong.model.dsa.DSAMixer.project_keys` of the slice, one all-gather of
  the kv latents and pooled index keys (:func:`~genolong.parallel.cp_dsa.gather_keys`, every rank
  receiving all of them: they are the stream's caches), ``attend`` of the slice's queries over the
  cached keys and the gathered ones up to its end, at their global offset (as
  :func:`~genolong.parallel.cp_dsa.cp_dsa_forward`). Every stretch starts and ends on a pool
  boundary, so no incomplete pool is pending.
- embeddings, hyper-connections, norms and FFNs are position-wise: each rank runs its slice.

Results equal the one-process stream up to float rounding: the state reaches the slices by the
fold (another product order than one sequential recurrence), as under CP training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..kernels.kda.cp import conv_halo, fold_states
from ..model.cache import KDAState, _grow
from ..model.config import INDEXED_ATTENTION
from ..model.dsa import DSAKeys
from ..model.mhc import collapse_streams, expand_streams, merge_streams
from ..model.stream import PrefillStream, StreamDSA
from .cp_dsa import gather_keys

__all__ = ["cp_prefill"]


@torch.no_grad()
def cp_prefill(stream: PrefillStream, input_ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Run the next stretch of a prefix, split over ``group``, into ``stream`` on every rank of the group.

    Every rank of ``group`` must call it (collectives) with its own slice, of one length, and the
    same stream state: with the stream at position ``p``, rank ``r`` holds positions ``[p + r n,
    p + (r + 1) n)`` of a stretch of ``W n`` tokens, ``n`` a multiple of
    :func:`genolong.config.kernel_multiple` ``(config, 1)`` (whole KDA chunks and DSA pools per
    slice). Afterwards every rank's ``stream`` is at position ``p + W n`` with the KDA states, conv
    tails and DSA caches of the whole prefix so far (the one-process stream's, to float rounding);
    call it again for the next stretch (a long prefix a segment per rank at a time), or continue
    on each rank alone with :meth:`PrefillStream.extend`.

    Args:
        stream: a :class:`PrefillStream` of a model without context parallelism installed (the
            same weights on every rank), at position 0 or where a previous call left it (on a DSA
            pool boundary, nothing pending).
        input_ids: ``[B, n]`` model ids of this rank's slice.
        group: the context-parallel process group (``W`` ranks).

    Returns:
        ``[B, 1, H]``: the final hidden row of the stretch's last token (the last rank's, on every
        rank), which predicts the token after it.

    Raises:
        InputError: an empty slice, or a stream with an incomplete DSA pool pending (one that
            :meth:`PrefillStream.extend` left off a pool boundary).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise InputError(f"input_ids must be this rank's slice [B, n] with n >= 1; got shape {tuple(input_ids.shape)}")
    if any(isinstance(state, StreamDSA) and state.pending.shape[1] for state in stream.layers):
        raise InputError(
            f"cp_prefill continues a stream on a DSA pool boundary; this one is at position {stream.position}, "
            f"inside a pool of {stream.pool}"
        )
    model = stream.model
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    last = dist.get_global_rank(group, world - 1)
    n = input_ids.shape[1]
    start = stream.position
    lo, end = start + rank * n, start + world * n
    streams = expand_streams(model.embed_tokens(input_ids), model.config.hc_mult)
    indices: torch.Tensor | None = None
    for block, state in zip(model.layers, stream.layers):
        post, comb, x = block.attn_hc(streams)
        x = block.input_layernorm(x)
        mixer = block.self_attn
        if block.layer_type == INDEXED_ATTENTION:
            assert isinstance(state, StreamDSA)
            # every rank receives every slice's keys: the stream's caches of the whole stretch
            keys = gather_keys(mixer, mixer.project_keys(x), group, world - 1)
            pool = stream.pool
            state.latent = _grow(state.latent, end)
            state.latent[:, start:end] = keys.latent
            if state.pooled is not None:
                assert keys.pooled is not None
                state.pooled = _grow(state.pooled, end // pool)
                state.pooled[:, start // pool : end // pool] = keys.pooled
            seen = DSAKeys(
                state.latent[:, : lo + n], None if state.pooled is None else state.pooled[:, : (lo + n) // pool]
            )
            res = mixer.attend(x, seen, indices, q_offset=lo)
            y, indices = res.out, (res.indices if mixer.returns_indices else None)
            state.pending = x[:, :0].clone()  # the stretch ends on a pool boundary
        else:
            assert isinstance(state, KDAState)
            projected = mixer.project(x)
            halo = conv_halo(projected, mixer.conv1d.weight.shape[-1], group)  # a collective: every rank
            carried = None
            if rank == 0:  # the rows and the state before the stretch are the stream's (zeros at its start)
                halo = None if start == 0 else state.conv.to(x.dtype)
                if start:  # the constant map to the state after rank 0's slice: [S_0 | 0] composed
                    carried = torch.cat(
                        [
                            state.recurrent,
                            state.recurrent.new_zeros(*state.recurrent.shape[:-1], state.recurrent.shape[-2]),
                        ],
                        dim=-1,
                    )
            # the slice's map S -> A S + B, folded over the earlier ranks into the slice's incoming
            # state (collectives: every rank)
            _, carried = mixer.segment_transition(x, halo, carried)
            incoming = fold_states(carried, group, mixer.head_dim)
            initial = incoming if rank > 0 else (None if start == 0 else state.recurrent)
            y, tail, final = mixer.forward_segment(x, halo, initial, output_tail=True)
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

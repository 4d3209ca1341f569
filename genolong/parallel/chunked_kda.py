"""The attention half of a KDA block in token segments with carried state (``memory.recompute: chunked``).

A :class:`~genolong.model.lm.Block`'s attention half is ``attn_hc -> input_layernorm -> self_attn
(KDAMixer) -> merge_streams`` on ``streams [B, T, m, H]``. Everything in it is position-wise except
two things, and both carry a small state forward in time:

- the causal short conv over the projected q|k|v: a token needs the ``kernel - 1`` projected rows
  before it (the *halo*, ``[B, kernel - 1, 3 * heads * dk]``);
- the delta-rule recurrence: a token needs the KDA state after the tokens before it
  (``[B, heads, dk, dv]`` fp32).

:func:`kda_attention_half` runs the half in segments of ``chunk_tokens`` tokens, each segment under
non-reentrant :func:`torch.utils.checkpoint.checkpoint`, handing the next segment its halo (a copy of
the segment's last projected rows) and its final state. Autograd then keeps per segment only the
segment's inputs (a view of ``streams``: no new storage), the halo and the state it received; the
backward rebuilds one segment at a time (at most ``chunk_tokens`` tokens of this half-block).

One process: a single pass. The outputs are those of the unsegmented half bit for bit on the torch
kernel backend when ``chunk_tokens`` is a multiple of the KDA chunk (64): every position-wise op
computes each row alike, and the chunked recurrence (:func:`genolong.kernels.kda.chunk_kda`) walks
the same chunks in the same order from the same state (``0 + S`` is ``S``). The gradients differ
only by float summation order (a parameter gradient is a sum over segments of per-segment sums;
the state and halo gradients meet the in-segment ones in another grouping).

Context parallelism (``block.self_attn.cp_group`` set, the rank holding a contiguous slice of the
sequence): the first segment of the rank needs the state left by the earlier ranks, which exists
only after every rank has summarised its whole slice. So, with the pieces of
:mod:`genolong.kernels.kda.cp`:

1. the halo across the rank boundary: :func:`~genolong.kernels.kda.cp.conv_halo` on the projected
   last ``kernel - 1`` rows of the slice (projected in a checkpoint of their own), once, outside
   every recomputed region (it runs collectives, which a recomputation must not repeat);
2. pass 1, per segment (checkpointed; outputs: the next halo and a ``[B, heads, dk, dv + dk]`` map):
   :meth:`~genolong.model.kda.KDAMixer.segment_transition` chains the slice's affine state map
   ``S -> A S + B`` segment by segment (:func:`~genolong.kernels.kda.cp.affine_state`, the widened
   run of :func:`~genolong.kernels.kda.cp.cp_chunk_kda`, started from the previous segment's map);
3. :func:`~genolong.kernels.kda.cp.fold_states`: all-gather the ranks' maps and fold the earlier
   ones into the slice's incoming state (its backward all-reduces, as in ``cp_chunk_kda``);
4. pass 2, per segment (checkpointed): :meth:`~genolong.model.kda.KDAMixer.forward_segment` from the
   true incoming state, carrying the state on, with the halos of pass 1.

Under CP the outputs equal the one-process unsegmented half to float rounding (the state reaches a
token by another product order than in one sequential pass).

Compute: one process, forward one plain KDA run per segment, backward its recomputation plus its
backward: the same kernel work as ``full`` recompute. Under CP, pass 1 runs the widened KDA
(``(dv + dk) / dv`` the plain work) and pass 2 the plain KDA, each once forward and once more when
its segment is rebuilt in backward, plus both backwards; ``cp_chunk_kda`` under ``full`` recompute
runs the widened KDA twice forward and once backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import InputError
from ..kernels.kda.cp import conv_halo, fold_states
from ..model.kda import KDAMixer
from ..model.mhc import merge_streams

__all__ = ["kda_attention_half", "segment_bounds"]


def segment_bounds(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of consecutive segments of ``chunk_tokens`` covering ``tokens``
    (the last one shorter when ``chunk_tokens`` does not divide ``tokens``; none for 0 tokens)."""
    return [(a, min(a + chunk_tokens, tokens)) for a in range(0, tokens, chunk_tokens)]


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under non-reentrant checkpointing when autograd records, else plainly."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def _mixer_input(block: torch.nn.Module, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attn_hc`` then ``input_layernorm``: ``seg [B, t, m, H] -> (post, comb, x [B, t, H])``."""
    post, comb, x = block.attn_hc(seg)
    return post, comb, block.input_layernorm(x)


def _check(block: torch.nn.Module, streams: torch.Tensor, chunk_tokens: int) -> KDAMixer:
    mixer = getattr(block, "self_attn", None)
    if not isinstance(mixer, KDAMixer):
        raise InputError(
            f"kda_attention_half needs a block whose self_attn is a KDAMixer, got "
            f"{type(mixer).__name__}; use the DSA half (genolong.parallel.chunked_dsa) for DSA layers"
        )
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise InputError(
            f"memory.recompute_chunk_tokens must be a positive integer (a multiple of 64), got {chunk_tokens!r}"
        )
    if streams.dim() != 4:
        raise InputError(f"kda_attention_half takes streams [B, T, m, H] (4 dims), got {tuple(streams.shape)}")
    return mixer


def kda_attention_half(block: torch.nn.Module, streams: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """A KDA block's attention half in segments of ``chunk_tokens`` tokens, each checkpointed.

    Args:
        block: a :class:`~genolong.model.lm.Block` whose ``self_attn`` is a
            :class:`~genolong.model.kda.KDAMixer` (``cp_group`` set: this rank's slice under context
            parallelism, every rank of the group calling this collectively, forward and backward).
        streams: the block input ``[B, T, m, H]`` (this rank's slice under CP).
        chunk_tokens: tokens per segment, >= 1; a multiple of the KDA chunk (64) keeps the one-process
            outputs bitwise equal to the unsegmented half on the torch backend. ``T`` need not be a
            multiple of it (the last segment is shorter); ``chunk_tokens >= T`` is one segment.

    Returns:
        the streams after the attention half ``[B, T, m, H]``: ``merge_streams(post, comb,
        self_attn(input_layernorm(x)), streams)`` with ``post, comb, x = attn_hc(streams)``.

    Saved for backward (per segment): the segment's input view of ``streams``, the halo
    ``[B, kernel - 1, 3 * heads * dk]`` (``streams``' dtype) and the state ``[B, heads, dk, dv]`` fp32
    it received; under CP also the pass-1 map ``[B, heads, dk, dv + dk]`` fp32 each segment but
    the first received, and the fold's gathered maps (``[W, B, heads, dk, dv + dk]``).

    Raises:
        InputError: ``block`` is not a KDA block, ``chunk_tokens`` is not a positive integer,
            ``streams`` is not 4-dimensional, or (under CP) the slice is empty.
    """
    mixer = _check(block, streams, chunk_tokens)
    T = streams.shape[1]
    bounds = segment_bounds(T, chunk_tokens)
    # split (one autograd node; its backward concatenates the pieces' gradients once) rather than
    # slicing per segment (each slice's backward would build a zero-filled [B, T, m, H] tensor)
    pieces = streams.split([b - a for a, b in bounds], dim=1) if bounds else ()

    def segment(
        seg: torch.Tensor, halo: torch.Tensor | None, state: torch.Tensor | None, output_tail: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        post, comb, x = _mixer_input(block, seg)
        out, tail, final = mixer.forward_segment(x, halo, state, output_tail=output_tail)
        return merge_streams(post, comb, out, seg), tail, final

    group = mixer.cp_group
    if group is None:
        outs = []
        halo: torch.Tensor | None = None
        state: torch.Tensor | None = None
        for i, seg in enumerate(pieces):
            last = i == len(pieces) - 1
            out, halo, state = _run(segment, seg, halo, state, not last)
            outs.append(out)
        return torch.cat(outs, dim=1) if outs else streams.clone()

    if T == 0:
        raise InputError(
            "kda_attention_half under context parallelism needs at least one token per rank "
            "(memory.recompute 'full' handles empty slices)"
        )
    kernel = mixer.conv1d.weight.shape[-1]
    n = min(T, kernel - 1)
    # 1. the projected rows before the slice, from the earlier ranks: the collective once, outside
    # any recomputed region; the slice's own last rows (its contribution) projected in a small
    # checkpoint of their own (kernel - 1 rows; nothing of it is kept but the input view)
    if n and pieces[-1].shape[1] >= n:
        tail_rows = pieces[-1][:, pieces[-1].shape[1] - n :]
    else:
        tail_rows = streams[:, T - n :]

    def project_rows(rows: torch.Tensor) -> torch.Tensor:
        return mixer.project(_mixer_input(block, rows)[2])

    # (a copy: conv_halo's result is a view of all ranks' gathered tails, W + 1 times as large)
    halos: list[torch.Tensor | None] = [conv_halo(_run(project_rows, tail_rows), kernel, group).clone()]

    # 2. pass 1: the slice's affine state map, segment by segment (small checkpoint outputs)
    def transition(
        seg: torch.Tensor, halo: torch.Tensor | None, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, x = _mixer_input(block, seg)
        return mixer.segment_transition(x, halo, carried)

    carried: torch.Tensor | None = None
    for seg in pieces:
        tail, carried = _run(transition, seg, halos[-1], carried)
        halos.append(tail)
    assert carried is not None
    # 3. the incoming state from the earlier ranks' maps (all-gather; backward all-reduce)
    state = fold_states(carried, group, mixer.head_dim)

    # 4. pass 2: the outputs from the true incoming state
    outs = []
    for i, seg in enumerate(pieces):
        out, _, state = _run(segment, seg, halos[i], state, False)
        outs.append(out)
    return torch.cat(outs, dim=1)

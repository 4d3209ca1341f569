"""Chunked prefill: a sequence of any length through :class:`~genolong.model.lm.GenoLM` in segments.

The one-shot forward materialises, per layer, tensors of the whole sequence (the mHC streams
``[B, T, hc_mult, H]``, the KDA projections and gates, the DSA queries and selections, the MoE
dispatch), so its peak memory grows with ``T`` many times over. :class:`PrefillStream` runs the
sequence ``S`` tokens at a time and carries between segments only what later tokens read:

- KDA layers (:class:`~genolong.model.cache.KDAState`, the decode path's state): the delta-rule
  state ``[B, heads, dk, dv]`` fp32 and the short conv's last ``kernel - 1`` projected q|k|v rows;
  a segment runs the chunked form from them (:meth:`~genolong.model.kda.KDAMixer.forward_segment`,
  as ``memory.recompute: chunked`` does in :mod:`genolong.parallel.chunked_kda`).
- DSA layers (:class:`StreamDSA`): the MLA kv latent of every past token, the KPool pooled index
  keys of every completed pool, and the layer inputs of the current incomplete pool's tokens
  (fewer than ``index_kpool``). A segment computes its keys with
  :meth:`~genolong.model.dsa.DSAMixer.project_keys` and its queries with
  :meth:`~genolong.model.dsa.DSAMixer.attend` over all cached keys (the two phases the one-shot
  forward, context parallelism and :mod:`genolong.parallel.chunked_dsa` run), causal, the
  indexer's top-k over the cached pooled keys. The incomplete pool's rows are run again in front
  of the next segment, so every segment starts on a pool boundary: its keys pool exactly the
  one-shot forward's pools, and ``attend`` takes its query offset (the selection's tail needs a
  pool-aligned offset). At most ``index_kpool - 1`` queries per DSA layer are recomputed.
- the mHC streams, norms and FFNs (dense or MoE) are position-wise: the model's own modules on
  the segment.

Only the DSA caches grow with the sequence (``kv_lora_rank`` numbers per token and
``index_head_dim`` per pool per DSA layer); everything else is the size of one segment.

Results equal the one-shot forward up to float rounding (max |per-token NLL diff| 4e-6 in fp32 on
the ``tiny`` and ``small`` presets over 1,000 tokens, segments of 1 to 999 tokens): with segments on KDA chunk boundaries (multiples of 64) every op computes each row as the one-shot
forward does except where BLAS rounds a product differently for a matrix of other shape; with
other segment lengths the KDA recurrence also walks other chunks (same state, other summation
order). As in :mod:`genolong.model.decode`, a pool whose index score ties the top-k boundary
within rounding could be chosen by one path and not the other (rare: a property of top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .cache import KDAState, _grow, kda_init_state
from .config import INDEXED_ATTENTION
from .dsa import DSAKeys, DSAMixer
from .kda import KDAMixer
from .loss import model_inputs, next_token_nll
from .mhc import collapse_streams, expand_streams, merge_streams
from .vocab import VocabMap

__all__ = ["PrefillStream", "StreamDSA", "StreamSnapshot", "check_segment_tokens", "stream_token_nll"]


def check_segment_tokens(segment_tokens: int | None) -> None:
    """``segment_tokens`` must be None (one-shot) or a positive integer.

    Raises:
        InputError: anything else (one line naming ``--segment-tokens``).
    """
    if segment_tokens is None:
        return
    if isinstance(segment_tokens, bool) or not isinstance(segment_tokens, int) or segment_tokens < 1:
        raise InputError(f"--segment-tokens must be a positive number of tokens (e.g. 65536), got {segment_tokens!r}")


@dataclass
class StreamDSA:
    """What one DSA layer keeps between segments; rows ``[0, position)`` of the buffers are filled.

    Attributes:
        latent: MLA kv latents ``[B, capacity, kv_lora_rank]`` (model dtype).
        pooled: KPool pooled index keys of the completed pools ``[B, capacity // P, index_head_dim]``
            (None on shared layers, which have no indexer).
        pending: the layer inputs ``[B, position % P, H]`` of the incomplete pool's tokens, run again
            in front of the next segment (``P = index_kpool``); empty at a pool boundary.
    """

    latent: torch.Tensor
    pooled: torch.Tensor | None
    pending: torch.Tensor


@dataclass(frozen=True)
class StreamSnapshot:
    """A :class:`PrefillStream`'s state at one position, for :meth:`PrefillStream.restore`.

    Attributes:
        position: tokens the stream had run.
        kda: per KDA layer ``(recurrent [B, heads, dk, dv], conv [B, kernel - 1, 3 * heads * dk])``
            (None at a DSA layer).
        pending: per DSA layer the incomplete pool's layer inputs ``[B, position % P, H]`` (None at
            a KDA layer).
    """

    position: int
    kda: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    pending: tuple[torch.Tensor | None, ...]


class PrefillStream:
    """A sequence through a :class:`~genolong.model.lm.GenoLM` one segment at a time.

    Args:
        model: the model (its parameters are used, not copied or changed).
        batch_size: B (default 1).
        capacity: tokens the DSA caches hold before they grow (default 0: grown as needed by
            doubling; give the sequence length to allocate them once).

    Usage::

        stream = PrefillStream(model, batch_size=1, capacity=T)
        for s0 in range(0, T, S):
            hidden = stream.extend(input_ids[:, s0:s0 + S])   # [B, n, H], as GenoLM.forward's rows

    Raises:
        InputError: a model other than GenoLM-like (no ``layers``), bad ``batch_size``/``capacity``, or
            a model with context parallelism installed.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int = 1, capacity: int = 0):
        if not hasattr(model, "layers") or not hasattr(model, "embed_tokens"):
            raise InputError(f"PrefillStream needs a genolong GenoLM model; got {type(model).__name__}")
        if batch_size < 1 or capacity < 0:
            raise InputError(f"batch_size must be >= 1 and capacity >= 0; got {batch_size} and {capacity}")
        if any(getattr(block.self_attn, "cp_group", None) is not None for block in model.layers):
            raise InputError(
                "PrefillStream runs a whole sequence in one process; this model has context "
                "parallelism installed (self_attn.cp_group): stream an unwrapped model"
            )
        self.model = model
        self.position = 0
        weight = model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.pool = model.config.index_kpool
        self.layers: list[KDAState | StreamDSA] = []
        for block in model.layers:
            mixer = block.self_attn
            if block.layer_type == INDEXED_ATTENTION:
                assert isinstance(mixer, DSAMixer)
                cap = max(capacity, 1)
                ix = mixer.indexer
                self.layers.append(
                    StreamDSA(
                        latent=torch.zeros(batch_size, cap, mixer.kv_lora_rank, dtype=dtype, device=device),
                        pooled=None
                        if ix is None
                        else torch.zeros(batch_size, max(cap // self.pool, 1), ix.head_dim, dtype=dtype, device=device),
                        pending=torch.zeros(batch_size, 0, model.config.hidden_size, dtype=dtype, device=device),
                    )
                )
            else:
                assert isinstance(mixer, KDAMixer)
                self.layers.append(kda_init_state(mixer, batch_size, device))

    def snapshot(self) -> StreamSnapshot:
        """The stream's state now, to branch from: run other tokens, then :meth:`restore` it.

        No tensor is copied. Every carried tensor but the DSA buffers is replaced, never written
        in place, by :meth:`extend` (the KDA state and conv tail are new tensors from
        ``forward_segment``; ``pending`` a new copy), so holding the references keeps them. The
        DSA ``latent`` / ``pooled`` buffers are written in place, but only at rows ``>=`` the
        incomplete pool's first token (``latent[position:]``, ``pooled[(position - pending) //
        P:]``) and read only up to the segment's end, every row of which the segment writes
        first: what a branch wrote beyond the snapshot's position is overwritten before it is
        read once the stream is restored and extended (the rows before it are never touched).
        """
        return StreamSnapshot(
            position=self.position,
            kda=tuple((s.recurrent, s.conv) if isinstance(s, KDAState) else None for s in self.layers),
            pending=tuple(s.pending if isinstance(s, StreamDSA) else None for s in self.layers),
        )

    def restore(self, snap: StreamSnapshot) -> None:
        """Return to ``snap`` (taken by :meth:`snapshot` on this stream, at or before the current
        position); the next :meth:`extend` continues from there, as if nothing had run since."""
        if snap.position > self.position or len(snap.kda) != len(self.layers):
            raise InputError(
                f"restore: a snapshot at position {snap.position} of another stream or from the "
                f"future (this stream is at {self.position})"
            )
        for state, kda, pending in zip(self.layers, snap.kda, snap.pending):
            if isinstance(state, KDAState):
                assert kda is not None
                state.recurrent, state.conv = kda
            else:
                assert pending is not None
                state.pending = pending
        self.position = snap.position

    def _kda(self, mixer: KDAMixer, x: torch.Tensor, state: KDAState) -> torch.Tensor:
        """A segment through a KDA layer from the carried state; ``state`` is advanced."""
        first = self.position == 0  # the sequence starts here: no halo, no state (as the one-shot forward)
        halo = None if first else state.conv.to(x.dtype)  # exact: the rows were x.dtype before the cast up
        out, tail, final = mixer.forward_segment(x, halo, None if first else state.recurrent, output_tail=True)
        assert tail is not None
        state.conv, state.recurrent = tail.float(), final
        return out

    def _dsa(
        self, mixer: DSAMixer, x: torch.Tensor, cache: StreamDSA, prev_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment through a DSA layer over the cached keys; the cache is extended.

        ``x [B, n, H]`` at positions ``position ..``; ``prev_indices`` the preceding full layer's
        indices of the rows ``[start, position + n)`` (``start`` the incomplete pool's first token;
        shared layers). Returns ``(out [B, n, H], indices of the rows [start, position + n))``.
        """
        p, pos = self.pool, self.position
        xa = torch.cat([cache.pending, x], dim=1) if cache.pending.shape[1] else x
        r = cache.pending.shape[1]  # rows run again: the incomplete pool before the segment
        start, end = pos - r, pos + x.shape[1]
        keys = mixer.project_keys(xa)  # latent of [start, end); pooled keys of its complete pools
        cache.latent = _grow(cache.latent, end)
        cache.latent[:, pos:end] = keys.latent[:, r:]
        pooled = None
        if cache.pooled is not None:
            assert keys.pooled is not None
            p0 = start // p
            cache.pooled = _grow(cache.pooled, end // p)
            cache.pooled[:, p0 : p0 + keys.pooled.shape[1]] = keys.pooled
            pooled = cache.pooled[:, : end // p]
        res = mixer.attend(xa, DSAKeys(cache.latent[:, :end], pooled), prev_indices, q_offset=start)
        cache.pending = xa[:, (end // p) * p - start :].clone()  # a copy: do not keep the whole segment alive
        return res.out[:, r:], res.indices

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the next segment and return its final hidden states.

        Args:
            input_ids: ``[B, n]`` model ids (n >= 1) of positions ``position .. position + n - 1``.

        Returns:
            ``[B, n, H]``: those rows of :meth:`GenoLM.forward <genolong.model.lm.GenoLM.forward>`
            (after the final norm) on the whole sequence so far, up to float rounding.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise InputError(f"input_ids must be [B, n] with n >= 1; got shape {tuple(input_ids.shape)}")
        model = self.model
        streams = expand_streams(model.embed_tokens(input_ids), model.config.hc_mult)
        indices: torch.Tensor | None = None
        for block, state in zip(model.layers, self.layers):
            post, comb, x = block.attn_hc(streams)
            x = block.input_layernorm(x)
            if isinstance(state, StreamDSA):
                y, used = self._dsa(block.self_attn, x, state, indices)
                indices = used if block.self_attn.returns_indices else None
            else:
                y = self._kda(block.self_attn, x, state)
                indices = None
            streams = block.ffn_half(merge_streams(post, comb, y, streams))
        self.position += input_ids.shape[1]
        return model.norm(collapse_streams(streams))


@torch.no_grad()
def stream_token_nll(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    segment_tokens: int,
    chunk_size: int = 4096,
    vocab: VocabMap | None = None,
) -> torch.Tensor:
    """:meth:`GenoLM.token_nll <genolong.model.lm.GenoLM.token_nll>` by a :class:`PrefillStream`.

    Args:
        model: the model.
        tokens: ``[B, T]`` store tokens (case kept).
        segment_tokens: tokens per segment (>= 1; any length).
        chunk_size: LM-head rows per chunk (default 4096).
        vocab: base ids -> model ids (default None: nucleotide ids).

    Returns:
        ``[B, T - 1]`` float32 nats, NaN where the target does not count; equal to the one-shot
        ``token_nll`` up to float rounding (see the module docstring).
    """
    check_segment_tokens(segment_tokens)
    inputs = model_inputs(tokens) if vocab is None else vocab.to_model(tokens)
    b, t = tokens.shape
    out = torch.empty(b, max(t - 1, 0), dtype=torch.float32, device=tokens.device)
    stream = PrefillStream(model, b, capacity=t)
    for s0 in range(0, t, segment_tokens):
        s1 = min(s0 + segment_tokens, t)
        hidden = stream.extend(inputs[:, s0:s1])
        if s1 < t:  # the segment's last row predicts the next segment's first token
            hidden = F.pad(hidden, (0, 0, 0, 1))  # a dummy row: next_token_nll scores rows [:-1]
            out[:, s0:s1] = next_token_nll(hidden, model.lm_head.weight, tokens[:, s0 : s1 + 1], chunk_size, vocab)
        else:
            out[:, s0:] = next_token_nll(hidden, model.lm_head.weight, tokens[:, s0:], chunk_size, vocab)
    return out

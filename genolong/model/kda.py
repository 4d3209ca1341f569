"""The KDA (Kimi Delta Attention) mixer of GLM-5.3-Flash: projections, short conv, gates, gated norm.

Per token: ``q, k, v = SiLU(causal depthwise conv(x W_q | x W_k | x W_v))``, split into heads;
``q`` and ``k`` L2-normalised (eps 1e-6, fp32); the per-channel log decay
``g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))`` (or the softplus form without
a lower bound); ``beta = sigmoid(b_proj(x))``; the delta-rule recurrence runs in
:mod:`genolong.kernels.kda`; the output is ``o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x))))``.
Parameter names are the checkpoint's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.backends import get_backend
from .config import ModelConfig
from .layers import GatedRMSNorm

__all__ = ["ShortConv", "ForgetGate", "KDAMixer", "l2_normalize"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (fla's form: eps inside the root)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class ShortConv(nn.Module):
    """Causal depthwise convolution by shift-and-add, then SiLU.

    ``nn.Conv1d``'s depthwise backward is slow on CPU; for a 4-tap kernel, K shifted
    multiply-adds compute the same thing with cheap gradients. The parameter keeps the
    checkpoint's ``Conv1d`` layout, ``weight [C, 1, K]`` in fp32.

    Shapes: ``x [B, T, C] -> [B, T, C]`` in ``x``'s dtype; ``y[t] = sum_j w[j] * x[t - K + 1 + j]``
    with zeros before the start, or the ``halo [B, K - 1, C]`` rows there (the previous
    context-parallel rank's last inputs).
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, halo: torch.Tensor | None = None) -> torch.Tensor:
        k = self.weight.shape[-1]
        t = x.shape[1]
        w = self.weight[:, 0, :].float()  # [C, K]
        if halo is None:
            padded = F.pad(x.float(), (0, 0, k - 1, 0))  # [B, T + K - 1, C]
        else:
            padded = torch.cat([halo.float(), x.float()], dim=1)
        out = padded[:, k - 1 :] * w[:, k - 1]
        for j in range(k - 1):
            out = out + padded[:, j : j + t] * w[:, j]
        return F.silu(out).to(x.dtype)


class ForgetGate(nn.Module):
    """Low-rank per-channel log decay ``g [B, T, heads, head_dim]`` (fp32, <= 0).

    :meth:`forward` returns the gate; :meth:`gated_kda` runs a backend's KDA op with the gate
    applied inside it (from the raw projection, ``A_log`` and ``dt_bias``).

    Attributes:
        fsdp_forward_methods: the methods besides ``forward`` that read the parameters: when the
            gate is an FSDP2 unit of its own (bf16-mixed, :func:`genolong.parallel.parallelize.apply_fsdp`)
            they gather its parameters as ``forward`` does.
    """

    fsdp_forward_methods: tuple[str, ...] = ("gated_kda",)

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, h = config.linear_head_dim, config.linear_num_heads
        self.head_dim, self.num_heads = d, h
        self.f_a_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.f_b_proj = nn.Linear(d, d * h, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(d * h, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.lower_bound = config.linear_lower_bound
        # fla's initialisation: dt in [1e-3, 1e-1] through an inverse softplus; A_log = 0 with the
        # lower-bound gate, log U(1, 16) without it
        dt = torch.empty(d * h).uniform_(-6.907755, -2.302585).exp().clamp_min(1e-4)
        with torch.no_grad():
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if self.lower_bound is not None:
                self.A_log.zero_()
            else:
                self.A_log.copy_(torch.empty(h).uniform_(1.0, 16.0).log())

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        """``f_b(f_a(x))``, ``[B, T, H] -> [B, T, heads * head_dim]``. Outside autocast ``x`` takes
        the projections' dtype first: a bf16-mixed FSDP2 run keeps this module fp32 (an fp32
        unit) while the block's activations are bf16 (under autocast the matmuls run in bf16
        either way, and no fp32 copy of ``x`` is made)."""
        if not torch.is_autocast_enabled(x.device.type):
            proj = self.f_a_proj  # an nn.Linear, or a LoRA wrapper around one (its .base)
            weight = proj.base.weight if isinstance(getattr(proj, "base", None), nn.Linear) else proj.weight
            x = x.to(weight.dtype)
        return self.f_b_proj(self.f_a_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        raw = self._raw(x).float() + self.dt_bias.float()
        raw = raw.view(b, t, self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, 1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw, threshold=20.0)

    def gated_kda(
        self,
        x: torch.Tensor,
        kda_gated: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta_logits: torch.Tensor,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``kda_gated`` (a backend's ``chunk_kda_gated``) with this gate: the raw projection
        ``f_b(f_a(x)) [B, T, heads, head_dim]``, ``A_log`` and ``dt_bias`` go to the op, which
        applies the gate itself (inside fla's kernel: no ``[B, T, heads, head_dim]`` fp32 gate
        saved for backward). ``q, k, v [B, T, heads, head_dim]``, ``beta_logits [B, T, heads]``;
        returns the op's ``(o, final_state)``."""
        b, t, _ = x.shape
        g_raw = self._raw(x).view(b, t, self.num_heads, self.head_dim)
        return kda_gated(
            q,
            k,
            v,
            g_raw,
            beta_logits,
            self.A_log,
            self.dt_bias,
            lower_bound=self.lower_bound,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=chunk_size,
        )


class KDAMixer(nn.Module):
    """The KDA token mixer.

    Args:
        config: the model config (``linear_*`` fields, ``hidden_size``, ``rms_norm_eps``).
        chunk_size: KDA chunk length (default 64).

    Shapes: ``x [B, T, H] -> [B, T, H]``; with ``initial_state [B, heads, dk, dv]`` and
    ``output_final_state=True`` it also returns the final state (for decoding).

    Context parallelism: with ``cp_group`` set (``genolong.parallel.context.apply_context_parallel``)
    ``x`` is this rank's contiguous slice of the sequence; the short conv takes the previous rank's
    last inputs (:func:`genolong.kernels.kda.cp.conv_halo`) and the recurrence the earlier ranks'
    states (:func:`genolong.kernels.kda.cp.cp_chunk_kda`), so the slice's outputs equal those rows
    of the whole sequence's.

    Segments (``memory.recompute: chunked``, :mod:`genolong.parallel.chunked_kda`):
    :meth:`forward_segment` runs a segment from the previous one's conv halo and state and returns
    both for the next; :meth:`segment_transition` composes a segment's affine state map onto the
    slice's so far (the context-parallel pass 1). :meth:`forward` is these same pieces on one segment.
    """

    def __init__(self, config: ModelConfig, chunk_size: int = 64):
        super().__init__()
        d, h = config.linear_head_dim, config.linear_num_heads
        qkv = d * h
        self.head_dim, self.num_heads, self.chunk_size = d, h, chunk_size
        self.q_proj = nn.Linear(config.hidden_size, qkv, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, qkv, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, qkv, bias=False)
        self.conv1d = ShortConv(3 * qkv, config.linear_conv_kernel_dim)
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(config.hidden_size, h, bias=False)
        self.g_a_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.g_b_proj = nn.Linear(d, qkv, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(qkv, config.hidden_size, bias=False)
        self.kernels = get_backend(config.kernel_backend)
        self.cp_group: Any = None  # a torch.distributed process group under context parallelism

    def _kda_fn(self) -> Any:
        """The backend's ``chunk_kda`` for the CP and segmented paths; the torch reference gets the
        lower-bound gate's bound (``-linear_lower_bound``), so it chooses its in-chunk path without
        reading the gate back to the host (no device-to-host sync per call; same result)."""
        from ..kernels.kda import chunk_kda

        bound = self.forget_gate.lower_bound
        if self.kernels.chunk_kda is chunk_kda and bound is not None and bound < 0:
            return functools.partial(chunk_kda, gate_bound=-bound)
        return self.kernels.chunk_kda

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The q|k|v projections before the short conv: ``x [B, T, H] -> [B, T, 3 * heads * head_dim]``
        in ``x``'s dtype (the rows :func:`genolong.kernels.kda.cp.conv_halo` and a segment's conv
        halo carry)."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def _qkv(
        self, x: torch.Tensor, projected: torch.Tensor, halo: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Short conv (with ``halo`` rows in front, or zeros) + SiLU, heads, L2-normalised q and k (fp32)."""
        b, t, _ = x.shape
        heads = (b, t, self.num_heads, self.head_dim)
        mixed = self.conv1d(projected, halo)
        q, k, v = (part.reshape(heads) for part in mixed.split(self.num_heads * self.head_dim, dim=-1))
        q, k = l2_normalize(q.float()), l2_normalize(k.float())  # in fp32, as fla does
        return q, k, v

    def _gated_kda(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The delta rule through the backend's ``chunk_kda_gated`` (one process, no CP fold)."""
        # the gate and beta from their raw projections inside the KDA op: on the fla backend
        # fla's kernel computes them (no [B, T, H, K] fp32 gate tensor saved for backward); on
        # the torch backend the same ops as ForgetGate.forward and a sigmoid. Called through the
        # gate's own method, so that an FSDP2 unit of the gate gathers A_log and dt_bias first.
        from torch.distributed.fsdp import FSDPModule

        fg = self.forget_gate
        if isinstance(fg, FSDPModule):  # its own FSDP2 unit (bf16-mixed): gathered by its method
            return fg.gated_kda(
                x,
                self.kernels.chunk_kda_gated,
                q,
                k,
                v.float(),
                self.b_proj(x),
                initial_state,
                output_final_state,
                self.chunk_size,
            )
        # otherwise the op directly, as before issue 45: the same ops through the method moved a
        # 2-rank fp32 data-parallel run 1.6e-5 (relative) off the one-process run by step 4
        b, t, _ = x.shape
        g_raw = fg.f_b_proj(fg.f_a_proj(x)).view(b, t, self.num_heads, self.head_dim)
        return self.kernels.chunk_kda_gated(
            q,
            k,
            v.float(),
            g_raw,
            self.b_proj(x),
            fg.A_log,
            fg.dt_bias,
            lower_bound=fg.lower_bound,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=self.chunk_size,
        )

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """``o_proj(RMSNorm(o) * sigmoid(g_b(g_a(x))))``: ``o [B, T, heads, dv]`` -> ``[B, T, H]``."""
        b, t, _ = x.shape
        gate = self.g_b_proj(self.g_a_proj(x)).view(b, t, self.num_heads, self.head_dim)
        return self.o_proj(self.o_norm(o.to(x.dtype), gate).reshape(b, t, -1))

    def conv_tail(self, projected: torch.Tensor, halo: torch.Tensor | None) -> torch.Tensor:
        """The last ``kernel - 1`` rows of ``[halo | projected]`` (zeros for a missing halo), as a copy.

        Shapes: ``projected [B, t, C]``, ``halo [B, kernel - 1, C]`` or None -> ``[B, kernel - 1, C]``:
        the conv halo of the segment that follows. A copy, so that keeping it (as a checkpoint output
        carried to the next segment) does not keep the segment's whole projection alive.
        """
        h = self.conv1d.weight.shape[-1] - 1
        b, t, c = projected.shape
        if t >= h:
            return projected[:, t - h :].clone()
        if halo is None:
            halo = projected.new_zeros(b, h, c)
        return torch.cat([halo, projected], dim=1)[:, t:].clone()

    def forward_segment(
        self,
        x: torch.Tensor,
        halo: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_tail: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One segment of a longer sequence, given what the tokens before it leave behind.

        Args:
            x: the segment's inputs ``[B, t, H]``.
            halo: the ``kernel - 1`` projected q|k|v rows before the segment ``[B, kernel - 1, 3 *
                heads * head_dim]`` (the previous segment's ``tail``, or
                :func:`~genolong.kernels.kda.cp.conv_halo`'s rows at a rank boundary); default None:
                zeros (the sequence starts here).
            initial_state: the KDA state after the tokens before ``[B, heads, dk, dv]`` (fp32);
                default None: zeros.
            output_tail: also return the next segment's halo (default True).

        Returns:
            ``(out [B, t, H], tail [B, kernel - 1, 3 * heads * head_dim] or None, final_state [B, heads,
            dk, dv] fp32)``. With ``halo`` and ``initial_state`` from the previous segment, ``out``
            equals those rows of :meth:`forward` on the whole sequence (bit for bit on the torch
            backend when the segments start on KDA chunk boundaries). ``cp_group`` is not consulted:
            the caller brings the rank boundary's halo and state
            (:mod:`genolong.parallel.chunked_kda`).
        """
        projected = self.project(x)
        q, k, v = self._qkv(x, projected, halo)
        o, state = self._gated_kda(x, q, k, v, initial_state, True)
        assert state is not None, "chunk_kda_gated returned no final state for output_final_state=True"
        tail = self.conv_tail(projected, halo) if output_tail else None
        return self._output(x, o), tail, state

    def segment_transition(
        self, x: torch.Tensor, halo: torch.Tensor | None, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's affine state map ``S -> A S + B`` composed onto ``carried`` (context parallelism).

        Args:
            x: the segment's inputs ``[B, t, H]``.
            halo: as in :meth:`forward_segment`.
            carried: ``[B_c | A_c]`` ``[B, heads, dk, dv + dk]`` (fp32) of the tokens of this slice
                before the segment (:func:`genolong.kernels.kda.cp.affine_state`); default None: the
                identity ``[0 | I]`` (the segment starts the slice).

        Returns:
            ``(tail, [B' | A'])``: the next segment's conv halo (see :meth:`conv_tail`) and the map
            of the slice up to the segment's end (``A' = A A_c``, ``B' = A B_c + B``), the same
            widened KDA run :func:`~genolong.kernels.kda.cp.cp_chunk_kda` makes, through the
            backend's ``chunk_kda``.
        """
        from ..kernels.kda.cp import affine_state

        projected = self.project(x)
        q, k, v = self._qkv(x, projected, halo)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        _, X = affine_state(q, k, v.float(), g, beta, carried, chunk_size=self.chunk_size, kda_fn=self._kda_fn())
        return self.conv_tail(projected, halo), X

    def forward(
        self, x: torch.Tensor, initial_state: torch.Tensor | None = None, output_final_state: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        projected = self.project(x)
        halo = None
        if self.cp_group is not None:
            if initial_state is not None or output_final_state:
                raise ValueError(
                    "KDAMixer: initial_state / output_final_state (decoding) do not combine with context parallelism"
                )
            from ..kernels.kda.cp import conv_halo

            halo = conv_halo(projected, self.conv1d.weight.shape[-1], self.cp_group)
        q, k, v = self._qkv(x, projected, halo)
        if self.cp_group is not None:
            from ..kernels.kda.cp import cp_chunk_kda

            g = self.forget_gate(x)
            beta = torch.sigmoid(self.b_proj(x).float())
            o = cp_chunk_kda(
                q, k, v.float(), g, beta, group=self.cp_group, chunk_size=self.chunk_size, kda_fn=self._kda_fn()
            )
            state = None
        else:
            o, state = self._gated_kda(x, q, k, v, initial_state, output_final_state)
        out = self._output(x, o)
        return (out, state) if output_final_state else out

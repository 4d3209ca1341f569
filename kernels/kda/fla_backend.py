"""fla-core's Triton ``chunk_kda`` behind genolong's :func:`~genolong.kernels.kda.chunk_kda` signature.

genolong's KDA ops already use fla's layout and argument order (q, k, g ``[B, T, H, K]``, v
``[B, T, H, V]``, beta ``[B, T, H]``, state ``[B, H, K, V]``, decay ``exp(g)`` applied before the
delta-rule update, ``o_t = S_t^T (scale * q_t)``), so the adapter converts only what fla's kernel
requires and restores genolong's return conventions:

- q, k, v go to the kernel in one dtype (``kernel_dtype``, default :func:`fla_input_dtype`: the
  autocast dtype when autocast is on for their device, as in a ``bf16-mixed`` run, else the
  promotion of the three; the KDA layer passes float32, which fla would run on its slower fp32
  path), contiguous; g (log decay, cumulated in float32 by fla) and the initial state (fla
  asserts float32) go in float32; beta in the kernel dtype (the gated op: its logits in float32).
  fla's ``chunk_kda`` docstring example passes bf16 q, k, v, beta and float32 ``A_log`` /
  ``dt_bias``, it asserts a float32 ``initial_state``, and its kernels accumulate in float32
  (``tl.dot`` float32 accumulators; the gate and its chunk cumsum in float32, ``fla.ops.kda.gate``);
- the gate and beta arrive already activated (fla's ``use_gate_in_kernel`` /
  ``use_beta_sigmoid_in_kernel`` / ``use_qk_l2norm_in_kernel`` are left off: the KDA layer applies
  them, in float32, so the torch and fla backends see the same inputs);
- ``chunk_size``: fla supports 32 and 64; any other power of two runs with 64 (the chunk size
  changes the blocking only, not the result);
- ``o`` is returned in ``v``'s dtype, ``final_state`` in float32 (or None), as the torch op does;
- ``T = 0`` returns empty outputs without calling the kernel.

Context parallelism: the adapter has the local op's signature, so
:func:`genolong.kernels.kda.cp.cp_chunk_kda` (``kda_fn=``, the KDA layer passes its backend's
``chunk_kda``) runs over it unchanged; fla's own ``cp_context`` path is not used (it needs
``B = 1`` flattened sequences and fla's ``cu_seqlens`` partition). fla-core older than 0.5.2
computed the context-parallel backward wrongly, so :func:`load_fla_kernel` refuses it.

Gate and beta in the kernel: :func:`make_fla_chunk_kda_gated` builds the op of
:func:`reference_chunk_kda_gated` (the KDA layer's gate ``lower_bound * sigmoid(exp(A_log) *
(g_raw + dt_bias))``, or ``-exp(A_log) * softplus(g_raw + dt_bias)`` without a lower bound, and
``beta = sigmoid(beta_logits)``), which fla computes inside ``chunk_kda``
(``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, and ``safe_gate`` for a lower bound in
``[-5, 0)``: fla's faster path for bounded gates), so the ``[B, T, H, K]`` float32 gate is never
stored for backward.

fla is imported only in :func:`load_fla_kernel` (never at module import), and the kernel can be
injected (:func:`make_fla_chunk_kda`): on CPU, where fla's Triton kernels cannot run, the tests bind
the adapter to fla's pure-torch ``naive_recurrent_kda`` to check every conversion.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..probe import MIN_FLA_CORE
from .chunk import chunk_kda
from .recurrent import check_kda_inputs

__all__ = [
    "FLA_CHUNK_SIZES",
    "MIN_FLA_VERSION",
    "check_fla_version",
    "fla_input_dtype",
    "fla_version",
    "load_fla_kernel",
    "kda_gate",
    "make_fla_chunk_kda",
    "make_fla_chunk_kda_gated",
    "reference_chunk_kda_gated",
]

#: Oldest fla-core whose ``chunk_kda`` genolong accepts: before 0.5.2 its context-parallel backward
#: was wrong (:data:`genolong.kernels.probe.MIN_FLA_CORE`).
MIN_FLA_VERSION: tuple[int, int, int] = MIN_FLA_CORE

#: Chunk sizes fla's ``chunk_kda`` accepts (``chunk_size`` keyword).
FLA_CHUNK_SIZES: tuple[int, ...] = (32, 64)

#: Largest key head dimension fla's KDA kernels support.
FLA_MAX_HEAD_DIM = 256


def _parse_version(version: str) -> tuple[int, int, int]:
    """``"0.6.0"`` / ``"0.5.2.dev3+g1234"`` -> ``(0, 6, 0)`` / ``(0, 5, 2)``; missing parts are 0."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    if not parts:
        raise InputError(
            f"fla-core version {version!r} cannot be read; install fla-core >= {'.'.join(map(str, MIN_FLA_VERSION))}"
        )
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def check_fla_version(version: str) -> None:
    """Raise :class:`~genolong.errors.InputError` unless ``version`` (fla-core's) is >= 0.5.2."""
    if _parse_version(version) < MIN_FLA_VERSION:
        need = ".".join(map(str, MIN_FLA_VERSION))
        raise InputError(
            f"fla-core {version} is too old for genolong's fla backend (its context-parallel "
            f"KDA backward is wrong before {need}); pip install 'fla-core>={need}'"
        )


def fla_version() -> str | None:
    """The installed fla-core version (distribution metadata, else ``fla.__version__``), or None."""
    from importlib import metadata

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def load_fla_kernel() -> Callable[..., Any]:
    """Import fla-core's Triton ``fla.ops.kda.chunk_kda`` after checking the installed version.

    Raises:
        ImportError: fla-core is not installed (or fails to import).
        InputError: fla-core is older than :data:`MIN_FLA_VERSION`.
    """
    version = fla_version()
    if version is None:
        raise ImportError("fla-core is not installed (pip install 'fla-core>=0.5.2')")
    check_fla_version(version)
    from fla.ops.kda import chunk_kda as fla_chunk_kda  # lazy: fla imports Triton

    return fla_chunk_kda


def fla_input_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype q, k and v go to fla's kernel in: the autocast dtype of their device when
    autocast is on there (a ``bf16-mixed`` run: bf16, fla's tensor-core path; the KDA layer hands
    over fp32 L2-normalised q, k and fp32 v, which are rounded once here), else the promotion of
    their dtypes (a ``32-true`` run stays fp32)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def _check_fla_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    cuda_only: bool,
) -> float:
    """The checks both fla ops make: genolong's KDA input checks
    (:func:`~genolong.kernels.kda.recurrent.check_kda_inputs`; ``g`` and ``beta`` may be their raw
    projections), then what fla's kernel cannot take. Returns the resolved scale.

    Raises:
        ValueError: bad shapes or a chunk size that is not a power of two.
        InputError: float64 inputs, a key head dim over :data:`FLA_MAX_HEAD_DIM`, or (``cuda_only``:
            the real fla kernel) tensors not on CUDA.
    """
    scale = check_kda_inputs(q, k, v, g, beta, scale, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two (e.g. 64), got {chunk_size!r}")
    if torch.float64 in (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype):
        raise InputError(
            "the fla KDA backend has no float64 kernels; pass float32/bfloat16/float16 "
            "inputs or use kernel_backend 'torch'"
        )
    K = q.shape[-1]
    if K > FLA_MAX_HEAD_DIM:
        raise InputError(
            f"the fla KDA backend supports key head dims up to {FLA_MAX_HEAD_DIM}, got "
            f"K = {K}; use kernel_backend 'torch'"
        )
    if cuda_only and q.device.type != "cuda":
        raise InputError(
            f"the fla KDA backend runs on CUDA tensors only, got {q.device}; "
            "use kernel_backend 'torch' (or 'auto') on this device"
        )
    return scale


def make_fla_chunk_kda(
    kernel: Callable[..., Any] | None = None, kernel_dtype: torch.dtype | None = None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """Build the fla-backed KDA op with :func:`genolong.kernels.kda.chunk_kda`'s signature.

    Args:
        kernel: the fla-style op to call, ``kernel(q=, k=, v=, g=, beta=, scale=, initial_state=,
            output_final_state=, chunk_size=) -> (o, final_state)``; default None: fla-core's Triton
            ``chunk_kda`` (:func:`load_fla_kernel`, imported now; CUDA tensors only). Tests pass
            fla's pure-torch ``naive_recurrent_kda`` (through a keyword shim) to run on CPU.
        kernel_dtype: dtype of q, k, v and beta inside the kernel; default None:
            :func:`fla_input_dtype` (bf16 under bf16 autocast, else the promotion of q's, k's and
            v's dtypes). g and the state always go in float32.

    Returns:
        ``fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        chunk_size=64) -> (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32 or None)``,
        differentiable through the kernel's autograd function.

    Raises:
        ImportError / InputError: as :func:`load_fla_kernel`, when ``kernel`` is None.
    """
    default_kernel = kernel is None
    if kernel is None:
        kernel = load_fla_kernel()
    bound_kernel = kernel

    def fla_chunk_kda(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Kimi Delta Attention through fla-core's ``chunk_kda``; see
        :func:`genolong.kernels.kda.chunk_kda` for the arguments, shapes and return values."""
        scale = _check_fla_inputs(q, k, v, g, beta, scale, initial_state, chunk_size, cuda_only=default_kernel)
        B, T, H, K = q.shape
        V = v.shape[-1]
        if T == 0:
            state = None
            if output_final_state:
                state = q.new_zeros(B, H, K, V, dtype=torch.float32)
                if initial_state is not None:
                    state = state + initial_state.float()
            return v.new_zeros(B, 0, H, V), state
        dt = kernel_dtype or fla_input_dtype(q, k, v)
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        o, final = bound_kernel(
            q=q.to(dt).contiguous(),
            k=k.to(dt).contiguous(),
            v=v.to(dt).contiguous(),
            g=g.to(torch.float32).contiguous(),
            beta=beta.to(dt).contiguous(),
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            chunk_size=chunk_size if chunk_size in FLA_CHUNK_SIZES else 64,
        )
        if output_final_state:
            final = final.to(torch.float32)
        else:
            final = None
        return o.to(v.dtype), final

    fla_chunk_kda.__qualname__ = fla_chunk_kda.__name__ = "fla_chunk_kda"
    return fla_chunk_kda


# ------------------------------------------------------------------------------------------------
# gate and beta inside the kernel


def kda_gate(
    g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """The KDA layer's per-channel log decay from its raw projection, in float32 (<= 0).

    ``g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`` when ``lower_bound`` is set, else
    ``g = -exp(A_log) * softplus(g_raw + dt_bias)`` (fla's ``naive_kda_lowerbound_gate`` /
    ``naive_kda_gate``; :class:`genolong.model.kda.ForgetGate`).

    Args:
        g_raw: ``[B, T, H, K]`` (``f_b_proj(f_a_proj(x))``, without ``dt_bias``).
        A_log: ``[H]``.
        dt_bias: ``[H * K]``.
        lower_bound: e.g. -5.0, or None for the softplus form.

    Returns:
        ``[B, T, H, K]`` float32.
    """
    H, K = g_raw.shape[-2:]
    if A_log.shape != (H,) or dt_bias.shape != (H * K,):
        raise InputError(
            f"A_log must be [H] = [{H}] and dt_bias [H * K] = [{H * K}] for g_raw "
            f"{tuple(g_raw.shape)}, got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    raw = g_raw.float() + dt_bias.float().view(H, K)
    rate = A_log.float().exp().view(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * raw)
    return -rate * F.softplus(raw, threshold=20.0)


def reference_chunk_kda_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_raw: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA with the gate and beta computed from their raw inputs, in torch (the reference).

    ``chunk_kda(q, k, v, kda_gate(g_raw, A_log, dt_bias, lower_bound), sigmoid(beta_logits), ...)``;
    shapes as :func:`genolong.kernels.kda.chunk_kda` with ``g_raw [B, T, H, K]``,
    ``beta_logits [B, T, H]``, ``A_log [H]``, ``dt_bias [H * K]``. Differentiable w.r.t. every
    tensor input (``A_log`` and ``dt_bias`` included).
    """
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logits.float())
    # the lower-bound gate keeps -g below -lower_bound: chunk_kda then needs no read of g (no sync)
    bound = -lower_bound if lower_bound is not None and lower_bound < 0 else None
    return chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        gate_bound=bound,
    )


def make_fla_chunk_kda_gated(
    kernel: Callable[..., Any] | None = None, kernel_dtype: torch.dtype | None = None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """Build the fla-backed op of :func:`reference_chunk_kda_gated`: gate and beta inside fla's kernel.

    Args:
        kernel: as in :func:`make_fla_chunk_kda` (default: fla-core's Triton ``chunk_kda``); it is
            called with ``use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=,
            dt_bias=, lower_bound=, safe_gate=`` in addition.
        kernel_dtype: dtype of q, k, v inside the kernel (default: :func:`fla_input_dtype`); the
            raw gate, ``A_log``, ``dt_bias`` and the state go in float32, the beta logits in
            float32 too.

    Returns:
        ``fla_chunk_kda_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound=None,
        scale=None, initial_state=None, output_final_state=False, chunk_size=64) -> (o, final_state)``
        with :func:`reference_chunk_kda_gated`'s semantics and return conventions. ``safe_gate``
        (fla's faster bounded-gate path) is on when ``-5 <= lower_bound < 0``.
    """
    default_kernel = kernel is None
    if kernel is None:
        kernel = load_fla_kernel()
    bound_kernel = kernel

    def fla_chunk_kda_gated(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g_raw: torch.Tensor,
        beta_logits: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        lower_bound: float | None = None,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """KDA through fla-core's ``chunk_kda`` with the gate and beta applied in the kernel; see
        :func:`reference_chunk_kda_gated`."""
        scale = _check_fla_inputs(
            q, k, v, g_raw, beta_logits, scale, initial_state, chunk_size, cuda_only=default_kernel
        )
        B, T, H, K = q.shape
        V = v.shape[-1]
        if A_log.shape != (H,) or dt_bias.shape != (H * K,):
            raise InputError(
                f"A_log must be [H] = [{H}] and dt_bias [H * K] = [{H * K}], got "
                f"{tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
            )
        if T == 0:
            # no kernel call; keep A_log / dt_bias in the graph so their gradients exist (zero)
            zero = (A_log.float().sum() + dt_bias.float().sum()) * 0
            state = None
            if output_final_state:
                state = q.new_zeros(B, H, K, V, dtype=torch.float32) + zero
                if initial_state is not None:
                    state = state + initial_state.float()
            return v.new_zeros(B, 0, H, V) + zero.to(v.dtype), state
        dt = kernel_dtype or fla_input_dtype(q, k, v)
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        o, final = bound_kernel(
            q=q.to(dt).contiguous(),
            k=k.to(dt).contiguous(),
            v=v.to(dt).contiguous(),
            g=g_raw.to(torch.float32).contiguous(),
            beta=beta_logits.to(torch.float32).contiguous(),
            scale=scale,
            initial_state=h0,
            output_final_state=output_final_state,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=A_log.to(torch.float32).contiguous(),
            dt_bias=dt_bias.to(torch.float32).contiguous(),
            lower_bound=lower_bound,
            safe_gate=lower_bound is not None and -5.0 <= lower_bound < 0.0,
            chunk_size=chunk_size if chunk_size in FLA_CHUNK_SIZES else 64,
        )
        final = final.to(torch.float32) if output_final_state else None
        return o.to(v.dtype), final

    fla_chunk_kda_gated.__qualname__ = fla_chunk_kda_gated.__name__ = "fla_chunk_kda_gated"
    return fla_chunk_kda_gated

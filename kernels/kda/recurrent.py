"""Recurrent (token-by-token) Kimi Delta Attention: the plain torch reference.

Matches fla's ``naive_recurrent_kda`` (``fla/ops/kda/naive.py``) exactly: per head, with the state
``S: [K, V]``, decay first, then the delta-rule update, then the read-out::

    S   <- Diag(exp(g_t)) S
    S   <- S + beta_t k_t (v_t - S^T k_t)^T          # = (I - b k k^T) Diag(a) S + b k v^T
    o_t  = S^T (scale * q_t)

q and k are used as given (the KDA layer L2-normalises them before calling the op).
"""

from __future__ import annotations

import torch

__all__ = ["recurrent_kda", "check_kda_inputs", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
) -> float:
    """Validate the shapes of KDA inputs (fla layout) and return the effective ``scale``.

    Shapes: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; initial_state
    ``[B, H, K, V]`` or None. Raises ``ValueError`` naming the offending input.
    """
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (4 dims), got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)} = [B, T, H, K], got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(
            f"g (per-channel log decay) must have the shape of q {tuple(q.shape)} = [B, T, H, K], got {tuple(g.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V] (B, T, H as in q), got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must have shape [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    V = v.shape[-1]
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating-point torch.Tensor of shape [B, H, K, V] or None")
        if initial_state.shape != (B, H, K, V):
            raise ValueError(
                f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}"
            )
    devices = {x.device for x in tensors.values()}
    if initial_state is not None:
        devices.add(initial_state.device)
    if len(devices) > 1:
        raise ValueError(f"all KDA inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if scale is None:
        scale = K**-0.5
    scale = float(scale)
    return scale


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, one token at a time (reference and decoding form).

    Args:
        q: queries ``[B, T, H, K]`` (used as given; the layer L2-normalises them).
        k: keys ``[B, T, H, K]`` (used as given; the layer L2-normalises them).
        v: values ``[B, T, H, V]``; ``V`` may differ from ``K``.
        g: per-channel log decay ``[B, T, H, K]``, expected ``<= 0`` (decay ``exp(g)``).
        beta: delta-rule step sizes ``[B, T, H]`` (usually in (0, 1)).
        scale: query scale; default ``K ** -0.5``.
        initial_state: state ``[B, H, K, V]`` before the first token; default zeros.
        output_final_state: return the state after the last token (else None). Default False.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``v``'s dtype; ``final_state`` ``[B, H, K, V]``
        in the accumulation dtype (float32, or float64 for float64 inputs), or None.

    Everything is accumulated in float32 (float64 for float64 inputs); differentiable with respect
    to every tensor input through autograd.
    """
    scale = check_kda_inputs(q, k, v, g, beta, scale, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    cdt = compute_dtype(q.dtype)

    qs = q.to(cdt) * scale
    kf, vf, gf, bf = (x.to(cdt) for x in (k, v, g, beta))
    decay = gf.exp()  # [B, T, H, K]
    S = q.new_zeros(B, H, K, V, dtype=cdt)  # [B, H, K, V]
    if initial_state is not None:
        S = S + initial_state.to(cdt)
    outs: list[torch.Tensor] = []
    for q_t, k_t, v_t, a_t, b_t in zip(qs.unbind(1), kf.unbind(1), vf.unbind(1), decay.unbind(1), bf.unbind(1)):
        S = S * a_t.unsqueeze(-1)  # [B, H, K, V]
        kS = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # S^T k: [B, H, V]
        S = S + (b_t.unsqueeze(-1) * k_t).unsqueeze(-1) * (v_t - kS).unsqueeze(-2)
        outs.append((q_t.unsqueeze(-2) @ S).squeeze(-2))  # [B, H, V]
    if outs:
        o = torch.stack(outs, dim=1)  # [B, T, H, V]
    else:
        o = vf.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)

"""Bytes the context-parallel collectives move, as plain arithmetic (no torch).

:func:`genolong.kernels.kda.cp.cp_kda_comm_bytes`, :func:`~genolong.kernels.kda.cp.conv_halo_comm_bytes`
and :func:`genolong.parallel.cp_dsa.cp_dsa_comm_bytes` count what their collectives send; the
formulas live here so that the memory planner (``genolong plan``) uses the same counts without
importing torch. The torch modules re-export or wrap them (element sizes from torch dtypes).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["kda_state_payload", "conv_halo_payload", "cp_dsa_comm_bytes"]


class DSAShape(Protocol):
    """The DSA sizes :func:`cp_dsa_comm_bytes` reads (a :class:`genolong.model.config.ModelConfig`
    has them; the kernels do not import the model)."""

    kv_lora_rank: int
    index_head_dim: int
    index_kpool: int


def kda_state_payload(B: int, H: int, K: int, V: int, cp: int, element_bytes: int) -> dict[str, int]:
    """Payload bytes one rank hands to the collectives in one ``cp_chunk_kda`` call.

    Args:
        B, H, K, V: batch, heads, key and value head dims.
        cp: context-parallel group size.
        element_bytes: bytes per element of the states (the accumulation dtype: 8 for float64
            inputs, 4 otherwise).

    Returns:
        ``{"forward": B*H*K*(K+V)*e, "backward": cp*B*H*K*(K+V)*e}``; 0 for ``cp == 1``.
    """
    if cp == 1:
        return {"forward": 0, "backward": 0}
    state = B * H * K * (K + V) * element_bytes
    return {"forward": state, "backward": cp * state}


def conv_halo_payload(B: int, C: int, kernel: int, cp: int, element_bytes: int) -> dict[str, int]:
    """Payload bytes one rank hands to the collectives in one ``conv_halo`` call.

    Returns ``{"forward": 8 + B*(kernel-1)*C*e, "backward": cp*B*(kernel-1)*C*e}`` with ``e`` =
    ``element_bytes`` (the 8 bytes are the slice length); 0 for ``cp == 1`` or ``kernel == 1``.
    """
    if cp == 1 or kernel == 1:
        return {"forward": 0, "backward": 0}
    rows = B * (kernel - 1) * C * element_bytes
    return {"forward": 8 + rows, "backward": cp * rows}


def cp_dsa_comm_bytes(
    config: DSAShape, batch: int, t_local: int, cp: int, full_indexer: bool, dtype_bytes: int = 4
) -> dict[str, int]:
    """Bytes one rank receives through the collectives of one ``cp_dsa_forward`` call
    (:mod:`genolong.parallel.cp_dsa`).

    Args:
        config: the model config (``kv_lora_rank``, ``index_head_dim``, ``index_kpool``).
        batch: ``B``; t_local: ``T_local``; cp: the CP group size ``W``.
        full_indexer: the layer has its own indexer (its pooled keys travel too).
        dtype_bytes: bytes per element of the model dtype (default 4, fp32).

    Returns:
        ``{"forward": n, "backward": n}`` with ``n = (W - 1) * B * T_local * (C + DI / P) * s``
        (``DI / P`` only with ``full_indexer``): the all-gather of the latent and pooled keys, and
        in backward the reduce-scatter of their gradient (gloo emulates it with scatters of the
        same volume). The indexer KL's scalar all-reduce is not counted.
    """
    latent = t_local * config.kv_lora_rank
    pooled = (t_local // config.index_kpool) * config.index_head_dim if full_indexer else 0
    n = (cp - 1) * batch * (latent + pooled) * dtype_bytes
    return {"forward": n, "backward": n}

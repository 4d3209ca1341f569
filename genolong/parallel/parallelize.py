"""Apply genolong's memory techniques to a plain GenoLM, in a fixed order (the torchtitan pattern).

Order: MoE token chunks -> activation recompute -> CPU activation offload. Each step only sets
attributes or installs hooks/forwards on the existing modules: parameter names, ``state_dict``
keys and the module tree are unchanged, so checkpoints load and save as without them.
Context parallelism and FSDP2 (multi-process meshes) are not part of this version:
``mesh`` accepts only None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..errors import InputError
from ..model.moe import MoE
from .offload import apply_offload
from .recompute import apply_recompute

__all__ = ["parallelize", "apply_moe_chunks"]


def apply_moe_chunks(model: nn.Module, chunk_tokens: int | None) -> int:
    """Set the dispatch chunk of every MoE module of ``model`` (None: the whole batch at once).

    Each MoE then routes and runs its experts ``chunk_tokens`` tokens at a time, so the gathered
    per-expert inputs (``[n_e, H]`` for expert ``e``) never exceed one chunk; results are the
    same up to float summation order. Returns the number of MoE modules changed.

    Raises:
        InputError: ``chunk_tokens`` is not None and not a positive integer.
    """
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise InputError(f"moe_chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, MoE):
            module.chunk_tokens = chunk_tokens
            count += 1
    return count


def parallelize(
    model: nn.Module,
    *,
    recompute: str = "none",
    recompute_modules: Sequence[str] = (),
    offload: bool = False,
    offload_min_bytes: int = 2**20,
    moe_chunk_tokens: int | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Apply the single-process memory techniques to a GenoLM in place; returns the same model.

    Args:
        model: a :class:`~genolong.model.GenoLM` (``input_ids [B, T] -> hidden [B, T, H]``).
        recompute: "none" (default), "selective" or "full"; see
            :func:`genolong.parallel.recompute.apply_recompute`. "full" keeps per layer only the
            block inputs (``streams [B, T, hc_mult, H]``, plus ``indices [B, T, K]`` on a shared
            DSA layer).
        recompute_modules: module kinds for "selective": any of "kda", "dsa", "attn", "moe",
            "mlp", "ffn", "hc" (default (): :data:`~genolong.parallel.recompute.DEFAULT_SELECTIVE`,
            ("attn", "hc")).
        offload: move each block's saved activations of at least ``offload_min_bytes`` to
            (pinned, on CUDA) host memory during forward and prefetch them back one block ahead
            in backward (default False); see :class:`genolong.parallel.offload.ActivationOffloader`
            and :func:`genolong.parallel.offload.offloader_of`.
        offload_min_bytes: smallest saved tensor worth offloading (default 1 MiB).
        moe_chunk_tokens: MoE dispatch chunk in tokens (default None: the whole batch).
        mesh: reserved for the device mesh of context parallelism and FSDP2; only None (one
            process) is accepted in this version.

    Raises:
        InputError: a mesh, an unknown recompute mode or module kind, a bad chunk size or
            threshold, a model that is not a GenoLM, or techniques already applied.

    Loss and gradients are unchanged by every combination (exactly for recompute and offload,
    up to float summation order for MoE chunks).
    """
    if mesh is not None:
        raise InputError("parallelize(mesh=...): context parallelism and FSDP2 are not available in this version; "
                         "pass mesh=None (one process)")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InputError(f"parallelize needs a GenoLM (a model with .layers); got {type(model).__name__}")
    if isinstance(offload_min_bytes, bool) or not isinstance(offload_min_bytes, int) or offload_min_bytes < 0:
        raise InputError(f"offload_min_bytes must be a non-negative integer, got {offload_min_bytes!r}")
    if not isinstance(offload, bool):
        raise InputError(f"offload must be true or false, got {offload!r}")
    apply_moe_chunks(model, moe_chunk_tokens)
    apply_recompute(model, recompute, recompute_modules)
    if offload:
        apply_offload(model, offload_min_bytes)
    return model

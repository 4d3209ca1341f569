"""genolong.parallel: memory techniques applied over the plain model.

- :func:`parallelize` applies them in a fixed order (MoE token chunks, recompute, offload);
- :func:`apply_recompute`: none | selective (per module kind) | full activation recomputation;
- :class:`ActivationOffloader` / :func:`apply_offload`: per-layer CPU activation offload with
  prefetch in backward.
"""

from __future__ import annotations

from .offload import ActivationOffloader, apply_offload, offloader_of
from .parallelize import apply_moe_chunks, parallelize
from .recompute import (
    DEFAULT_SELECTIVE,
    MODULE_KINDS,
    RECOMPUTE_MODES,
    apply_recompute,
    is_recomputed,
    recompute_module,
    remove_recompute,
)

__all__ = [
    "ActivationOffloader",
    "DEFAULT_SELECTIVE",
    "MODULE_KINDS",
    "RECOMPUTE_MODES",
    "apply_moe_chunks",
    "apply_offload",
    "apply_recompute",
    "is_recomputed",
    "offloader_of",
    "parallelize",
    "recompute_module",
    "remove_recompute",
]

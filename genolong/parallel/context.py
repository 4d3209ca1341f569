"""Context parallelism for a whole :class:`~genolong.model.GenoLM`: each rank of a process group
holds one contiguous slice of every sequence (DESIGN.md section 5).

Only the token mixers see other positions, so they are the only modules that talk to other ranks:
KDA layers take the previous rank's short-conv inputs and the earlier ranks' states
(:mod:`genolong.kernels.kda.cp`); DSA layers all-gather the kv latent and pooled index keys and
select over global positions (:mod:`genolong.parallel.cp_dsa`). Embeddings, hyper-connections,
norms, feed-forwards and the LM head work per token. Parameter gradients of a rank are its share:
sum them over the group (FSDP2 does, when the CP ranks are part of its sharding mesh:
:func:`genolong.parallel.parallelize` with a mesh). Slicing the windows
(``genolong.data.windows.context_parallel_bounds``, the last position of a slice predicting the
next slice's first token: ``GenoLM.loss(next_tokens=...)``) and reducing the loss over the group
are the trainer's (:class:`genolong.train.module.GenoLMModule`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..model.dsa import DSAMixer
from ..model.kda import KDAMixer
from .cp_dsa import cp_dsa_forward

__all__ = ["apply_context_parallel", "is_context_parallel"]


class _ContextParallelDSAForward:
    """A DSA mixer's forward under context parallelism: :func:`~genolong.parallel.cp_dsa.cp_dsa_forward`
    over ``mixer.cp_group``. Stored as the instance attribute ``mixer.forward`` (as recompute
    installs its checkpointed forwards), so ``nn.Module.__call__`` and its hooks call it and the
    plain :meth:`DSAMixer.forward` stays the single-process layer."""

    def __init__(self, mixer: DSAMixer):
        self.mixer = mixer

    def __call__(
        self, x: torch.Tensor, prev_indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return cp_dsa_forward(self.mixer, x, self.mixer.cp_group, prev_indices)


def is_context_parallel(module: nn.Module) -> bool:
    """Whether :func:`apply_context_parallel` installed the context-parallel forward on ``module``
    (a DSA mixer)."""
    return isinstance(module.__dict__.get("forward"), _ContextParallelDSAForward)


def apply_context_parallel(model: nn.Module, group: Any) -> nn.Module:
    """Route every KDA and DSA mixer of ``model`` through the context-parallel forms over
    ``group`` (a torch.distributed process group; None restores the single-process forms).
    Returns the same model.

    KDA mixers read ``cp_group`` themselves (the CP fold lives in :mod:`genolong.kernels.kda.cp`);
    a DSA mixer gets :func:`~genolong.parallel.cp_dsa.cp_dsa_forward` installed as its forward
    (instance attribute) and ``cp_group`` recorded (for the query-segmented recompute of
    :mod:`genolong.parallel.chunked_dsa`).

    Raises:
        InputError: a DSA mixer whose forward something else already replaced (apply context
            parallelism before recompute, as :func:`genolong.parallel.parallelize` does).
    """
    for module in model.modules():
        if isinstance(module, KDAMixer):
            module.cp_group = group
        elif isinstance(module, DSAMixer):
            if "forward" in module.__dict__ and not is_context_parallel(module):
                raise InputError(
                    f"DSA layer {module.layer_idx}'s forward is already replaced (recompute?): apply context "
                    "parallelism first, as genolong.parallel.parallelize does"
                )
            module.cp_group = group
            if group is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = _ContextParallelDSAForward(module)  # type: ignore[method-assign]
    return model

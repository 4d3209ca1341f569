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

from torch import nn

from ..model.dsa import DSAMixer
from ..model.kda import KDAMixer

__all__ = ["apply_context_parallel"]


def apply_context_parallel(model: nn.Module, group: Any) -> nn.Module:
    """Route every KDA and DSA mixer of ``model`` through the context-parallel forms over
    ``group`` (a torch.distributed process group; None restores the single-process forms).
    Returns the same model."""
    for module in model.modules():
        if isinstance(module, (KDAMixer, DSAMixer)):
            module.cp_group = group
    return model

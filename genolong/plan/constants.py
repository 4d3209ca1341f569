"""Sizes the planner's parts share: a GiB, the fixed device workspace and the fragmentation allowance
(:mod:`genolong.plan.train`, :mod:`genolong.plan.evaluate`), the element sizes and the block sizes
of genolong's kernels that set the saved tensors' shapes (:mod:`genolong.plan.activations`).

Nothing here is measured by the planner: the workspace is the CUDA context, cuBLAS and NCCL
buffers seen on H100/B200, and the block sizes are the kernels' own defaults, named where they
are defined.
"""

from __future__ import annotations

__all__ = ["DSA_QUERY_BLOCK", "FRAGMENTATION", "GIB", "INDEXER_TILE", "KDA_SUB_BLOCK", "WORKSPACE_BYTES"]

GIB = 1 << 30
#: Fixed device workspace: CUDA context, cuBLAS workspaces, NCCL buffers (about 2 GiB on H100/B200).
WORKSPACE_BYTES = 2 * GIB
#: Allocator rounding and fragmentation, as a fraction of everything else on the device.
FRAGMENTATION = 0.05
#: Sub-block size of the torch chunked KDA (``genolong.kernels.kda.chunk._SUB_BLOCK``): the
#: in-chunk matrices come from one matmul per sub-block, then a block-inverse hierarchy.
KDA_SUB_BLOCK = 16
#: Queries per block of the DSA sparse attention (``DSAMixer.query_block``) and of the indexer KL.
DSA_QUERY_BLOCK = 64
#: Query and pool tile of the KPool indexer top-k (``kernels.dsa.kpool_topk`` defaults).
INDEXER_TILE = 256

_F32 = 4
_I64 = 8

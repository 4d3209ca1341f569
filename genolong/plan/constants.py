"""Sizes the planner's parts share: a GiB, the fixed device workspace and the fragmentation allowance
(:mod:`genolong.plan.train`, :mod:`genolong.plan.evaluate`), the element sizes and the block sizes
of genolong's kernels that set the saved tensors' shapes (:mod:`genolong.plan.activations`).

Nothing here is measured by the planner: the CUDA context, cuBLAS workspace and NCCL
communicator sizes are stated constants with their sources (issues and docs named beside each),
and the block sizes are the kernels' own defaults, named where they are defined.
"""

from __future__ import annotations

__all__ = [
    "CUBLAS_WORKSPACES",
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_CONTEXT_BYTES",
    "DSA_QUERY_BLOCK",
    "FRAGMENTATION",
    "GIB",
    "INDEXER_TILE",
    "KDA_SUB_BLOCK",
    "MIB",
    "NCCL_ALLTOALL_PEER_BYTES",
    "NCCL_COMM_BYTES",
    "NCCL_SINGLE_RANK_BYTES",
    "WORKSPACE_BYTES",
]

GIB = 1 << 30
MIB = 1 << 20
#: Fixed device workspace of the evaluation plan (:mod:`genolong.plan.evaluate`): CUDA context,
#: cuBLAS workspaces, NCCL buffers (about 2 GiB on H100/B200). The training plan itemizes it
#: (:data:`CUDA_CONTEXT_BYTES`, :data:`CUBLAS_WORKSPACE_BYTES`, :data:`NCCL_COMM_BYTES` per communicator).
WORKSPACE_BYTES = 2 * GIB
#: The CUDA context of one process with lazily loaded kernels (torch's, Triton's, fla's): ~300 MB
#: with CUDA >= 11.7's lazy module loading (pytorch/pytorch#107667, ptrblck: "the currently used
#: ~300MB"; >1000 MB before lazy loading); nvidia-smi showed 200-700 MB across machines
#: (pytorch/pytorch#28113). Counted at 512 MiB: the kernels genolong loads (Triton DSA, fla KDA) add modules.
CUDA_CONTEXT_BYTES = 512 * MIB
#: One cuBLAS / cuBLASLt workspace on Hopper and Blackwell: 32 MiB (torch's default
#: ``:4096:8``, "32MiB for Hopper and Blackwell", aten/src/ATen/cuda/CublasHandlePool.cpp;
#: pytorch/pytorch#120925 after the cuBLAS guide's ``cublasSetWorkspace`` recommendation).
CUBLAS_WORKSPACE_BYTES = 32 * MIB
#: Workspaces held: cuBLAS and cuBLASLt, each per (handle, stream) that runs a matmul; genolong's
#: matmuls run on the compute stream (forward, recompute and backward alike).
CUBLAS_WORKSPACES = 2
#: One NCCL communicator of >= 2 ranks used for collectives (ring / tree buffers of its channels):
#: 688 MB per process group of more than 2 GPUs measured through torch on 4 x A100 with NVLink
#: (NVIDIA/nccl#964; 544 MB for a 2-rank group); "more communicators = more memory used"
#: (NVIDIA/nccl#864, #986: linear in the number of channels). Counted per mesh dimension a step uses.
NCCL_COMM_BYTES = 688 * 10**6
#: What an all-to-all adds per peer to its communicator: 8 x H100 went from 1.06 GB to 4.34 GB per
#: GPU at the first ``all_to_all_single`` (32 channels to each of 7 peers, NVIDIA/nccl#1685):
#: (4.34 - 1.06) GB / 7 peers.
NCCL_ALLTOALL_PEER_BYTES = (434 - 106) * 10**7 // 7
#: A single-rank communicator (an expert FSDP group of one rank when ``ep`` equals the shard
#: group): NCCL 2.28 still allocates its 512 MiB NET shared buffer (NVIDIA/nccl#2363).
NCCL_SINGLE_RANK_BYTES = 512 * MIB
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

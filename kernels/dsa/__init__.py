"""genolong.kernels.dsa: DeepSeek Sparse Attention as plain-torch tensor functions (reference).

- :func:`indexer_topk`: lightning-indexer causal top-k, blockwise with a running top-k (memory
  linear in T); ties go to the lowest position.
- :func:`kpool_keys`, :func:`kpool_topk`, :func:`kpool_expand`: GLM-5.3-Flash pooled-key
  selection (``index_kpool`` tokens a pool, softmax-gated sum with a pool-position embedding in the
  gate logits; the incomplete tail pool is always selected).
- :func:`sparse_attention`: attention over the selected keys only, chunked over queries, with a
  recomputing backward; GQA/MQA and ``D != DV`` (MLA shapes).
- :func:`indexer_kl_loss_dense` / :func:`indexer_kl_loss_sparse`: the indexer KL loss of the
  dense warm-up and of the sparse stage.

Layers of type ``"shared"`` (glm5_next ``indexer_types``) run no indexer: they pass the previous
full layer's ``indices`` to :func:`sparse_attention`. Nothing here imports fla or transformers.
"""

from __future__ import annotations

from .attention import sparse_attention
from .indexer import indexer_scores, indexer_topk
from .kpool import kpool_expand, kpool_keys, kpool_topk
from .kpool_loss import kpool_indexer_kl_loss, kpool_pool_ids, kpool_select_pools
from .loss import indexer_kl_loss_dense, indexer_kl_loss_sparse

__all__ = [
    "indexer_scores",
    "indexer_topk",
    "kpool_expand",
    "kpool_keys",
    "kpool_topk",
    "kpool_indexer_kl_loss",
    "kpool_pool_ids",
    "kpool_select_pools",
    "sparse_attention",
    "indexer_kl_loss_dense",
    "indexer_kl_loss_sparse",
]

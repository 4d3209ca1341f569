"""The kernel backend registry: which implementation of the token-mixing ops the model runs.

A backend is a named set of ops with the signatures of the plain-torch reference ops (KDA in
fla's layout, the DSA pooled-key indexer and sparse attention, the chunked cross-entropy). The
model asks for one by name (``ModelConfig.kernel_backend``, default ``"torch"``); the choice is
logged once per process.

``torch`` (the reference, CPU and GPU) is the backend that ships now; ``fla`` (fla-core's Triton
KDA) and ``triton`` (genolong's DSA kernels) register here with the GPU path. A backend's module
is imported only when the backend is first asked for, so a CPU machine never imports Triton.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError

__all__ = ["KernelBackend", "available_backends", "get_backend", "register_backend"]

log = logging.getLogger("genolong")


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of every op the model calls (see the reference ops for shapes).

    Attributes:
        name: registry name (``"torch"``, ...).
        description: one line for the log.
        chunk_kda: :func:`genolong.kernels.kda.chunk_kda` signature (training form).
        recurrent_kda: :func:`genolong.kernels.kda.recurrent_kda` signature (decoding form).
        kpool_keys: :func:`genolong.kernels.dsa.kpool_keys` signature.
        kpool_topk: :func:`genolong.kernels.dsa.kpool_topk` signature.
        sparse_attention: :func:`genolong.kernels.dsa.sparse_attention` signature.
        kpool_indexer_kl_loss: :func:`genolong.kernels.dsa.kpool_indexer_kl_loss` signature.
        chunked_cross_entropy: :func:`genolong.kernels.ce.chunked_cross_entropy` signature.
    """

    name: str
    description: str
    chunk_kda: Callable
    recurrent_kda: Callable
    kpool_keys: Callable
    kpool_topk: Callable
    sparse_attention: Callable
    kpool_indexer_kl_loss: Callable
    chunked_cross_entropy: Callable


_LOADERS: dict[str, Callable[[], KernelBackend]] = {}
_LOADED: dict[str, KernelBackend] = {}


def register_backend(name: str, loader: Callable[[], KernelBackend]) -> None:
    """Register ``loader`` (called once, on first use) under ``name``; replaces an earlier one."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def available_backends() -> tuple[str, ...]:
    """Names of the registered backends."""
    return tuple(_LOADERS)


def get_backend(name: str = "torch") -> KernelBackend:
    """The backend called ``name``, loaded (and logged) on first use.

    Raises:
        InputError: ``name`` is not registered, or its loader fails (e.g. Triton missing).
    """
    backend = _LOADED.get(name)
    if backend is not None:
        return backend
    if name not in _LOADERS:
        raise InputError(
            f"unknown kernel backend {name!r}; this build has {', '.join(available_backends())} "
            "(set kernel_backend in the model config)"
        )
    try:
        backend = _LOADERS[name]()
    except ImportError as exc:
        raise InputError(f"kernel backend {name!r} cannot load here ({exc}); use kernel_backend 'torch'") from None
    _LOADED[name] = backend
    log.info("genolong: kernel backend %r: %s", name, backend.description)
    return backend


def _torch_backend() -> KernelBackend:
    from .ce import chunked_cross_entropy
    from .dsa import kpool_indexer_kl_loss, kpool_keys, kpool_topk, sparse_attention
    from .kda import chunk_kda, recurrent_kda

    return KernelBackend(
        name="torch",
        description="plain torch (chunked KDA, blockwise pooled-key DSA top-k, query-chunked sparse attention, chunked CE)",
        chunk_kda=chunk_kda,
        recurrent_kda=recurrent_kda,
        kpool_keys=kpool_keys,
        kpool_topk=kpool_topk,
        sparse_attention=sparse_attention,
        kpool_indexer_kl_loss=kpool_indexer_kl_loss,
        chunked_cross_entropy=chunked_cross_entropy,
    )


register_backend("torch", _torch_backend)

"""The kernel backend registry: which implementation of the token-mixing ops the model runs.

A backend is a named set of ops with the signatures of the plain-torch reference ops (KDA in
fla's layout, the DSA pooled-key indexer and sparse attention, the chunked cross-entropy). The
model asks for one by name (``ModelConfig.kernel_backend``, default ``"torch"``); the choice is
logged once per process.

Registered backends:

- ``torch``: the plain-torch reference ops (CPU and GPU).
- ``fla``: KDA training forms (``chunk_kda``, and ``chunk_kda_gated`` with the gate and beta
  applied inside the kernel) from fla-core's Triton ``chunk_kda`` through
  :mod:`genolong.kernels.kda.fla_backend` (fla-core >= 0.5.2, CUDA); every other op (decoding
  ``recurrent_kda``, the DSA indexer, KPool, sparse attention, indexer KL loss, cross-entropy) is
  the torch reference.
- ``triton``: every DSA op from genolong's Triton kernels (``genolong.kernels.dsa.triton_kpool``:
  KPool key pooling and the indexer KL loss; ``triton_topk``: pooled-key scores with a running
  top-k; ``triton_attention``: sparse attention), KDA ``chunk_kda`` from fla when fla-core imports
  (else the torch reference); recurrent KDA and the cross-entropy are the torch reference.
- ``auto``: ``torch`` without CUDA; on a CUDA machine ``triton`` with fla-core's KDA, or an
  :class:`~genolong.errors.InputError` of one line naming the fix (``pip install
  'genolong[gpu]'``) when Triton or fla-core is missing, too old or fails to load: never a silent
  torch fallback for the model's main layers (:mod:`genolong.kernels.probe`). A recipe that wants
  the torch reference on a GPU says ``torch``. It loads and returns the resolved backend (whose
  ``name`` is the resolved one) and the log line names both.

In the GPU backends, the fast ops run on CUDA tensors; tensors on any other device go through the
torch reference op (so a model built with ``auto`` on a CUDA machine still runs on CPU).

A backend's module is imported only when the backend is first asked for, so a CPU machine never
imports Triton or fla.

What runs each op is recorded, not inferred from the backend's name: ``KernelBackend.impls`` maps
every op to ``torch``, ``genolong-triton`` or ``fla-core`` (``triton`` without fla-core runs KDA
on the torch reference, and says so with a warning), and :func:`dispatch_counts` counts the calls
the GPU backends' dispatching ops sent to each (``benchmarks/gpu_check.py`` records both).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError

__all__ = [
    "KernelBackend",
    "OPS",
    "available_backends",
    "dispatch_counts",
    "get_backend",
    "register_backend",
    "resolve_auto",
]

log = logging.getLogger("genolong")


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of every op the model calls (see the reference ops for shapes).

    Attributes:
        name: registry name (``"torch"``, ...).
        description: one line for the log.
        chunk_kda: :func:`genolong.kernels.kda.chunk_kda` signature (training form).
        chunk_kda_gated: :func:`genolong.kernels.kda.fla_backend.reference_chunk_kda_gated`
            signature (training form with the gate and beta computed from their raw inputs; in
            the kernel on the fla backend).
        recurrent_kda: :func:`genolong.kernels.kda.recurrent_kda` signature (decoding form).
        kpool_keys: :func:`genolong.kernels.dsa.kpool_keys` signature.
        kpool_topk: :func:`genolong.kernels.dsa.kpool_topk` signature.
        sparse_attention: :func:`genolong.kernels.dsa.sparse_attention` signature.
        kpool_indexer_kl_loss: :func:`genolong.kernels.dsa.kpool_indexer_kl_loss` signature.
        chunked_cross_entropy: :func:`genolong.kernels.ce.chunked_cross_entropy` signature.
        impls: op name (those of :data:`OPS`) -> what runs it for CUDA tensors (``"torch"``,
            ``"genolong-triton"``, ``"fla-core"``; tensors elsewhere always run ``"torch"``), so
            that a report can say which implementation really ran, not only the backend's name
            (``triton`` without fla-core runs KDA on the torch reference).
    """

    name: str
    description: str
    chunk_kda: Callable
    chunk_kda_gated: Callable
    recurrent_kda: Callable
    kpool_keys: Callable
    kpool_topk: Callable
    sparse_attention: Callable
    kpool_indexer_kl_loss: Callable
    chunked_cross_entropy: Callable
    impls: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


# the ops every backend provides (the KernelBackend fields that are callables)
OPS = (
    "chunk_kda",
    "chunk_kda_gated",
    "recurrent_kda",
    "kpool_keys",
    "kpool_topk",
    "sparse_attention",
    "kpool_indexer_kl_loss",
    "chunked_cross_entropy",
)

# (op, implementation) -> calls dispatched by the GPU backends' ops in this process (see _on_cuda)
_DISPATCHED: Counter[tuple[str, str]] = Counter()


def dispatch_counts() -> dict[str, dict[str, int]]:
    """Calls made so far in this process through the ``fla`` and ``triton`` backends' dispatching
    ops, by op and by what ran them: ``{"sparse_attention": {"genolong-triton": 12, "torch": 0}}``
    (``torch`` counts the calls on non-CUDA tensors, which take the reference). The ``torch``
    backend's ops are the reference functions themselves and are not counted."""
    out: dict[str, dict[str, int]] = {}
    for (op, impl), n in sorted(_DISPATCHED.items()):
        out.setdefault(op, {})[impl] = n
    return out


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
        raise InputError(
            f"kernel backend {name!r} cannot load here ({_one_line(exc)}); use kernel_backend 'torch'"
        ) from None
    _LOADED[name] = backend
    if backend.name == name:
        log.info("genolong: kernel backend %r: %s", name, backend.description)
    else:
        log.info("genolong: kernel backend %r resolved to %r: %s", name, backend.name, backend.description)
    return backend


def _one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (Triton and CUDA errors can span many lines)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _on_cuda(fast: Callable, reference: Callable, name: str = "", impl: str = "") -> Callable:
    """An op that runs ``fast`` when its first tensor argument is on CUDA, else ``reference``;
    each call is counted under ``(name, impl)`` or ``(name, "torch")`` (:func:`dispatch_counts`)."""

    def op(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if first.is_cuda:
            _DISPATCHED[name, impl] += 1
            return fast(*args, **kwargs)
        _DISPATCHED[name, "torch"] += 1
        return reference(*args, **kwargs)

    op.__name__ = op.__qualname__ = getattr(fast, "__name__", "op")
    op.__doc__ = fast.__doc__
    return op


def _require_cuda(name: str) -> None:
    if not _cuda_available():
        raise InputError(
            f"kernel backend {name!r} needs CUDA (torch.cuda.is_available() is False here); "
            "use kernel_backend 'torch' or 'auto'"
        )


def _fla_chunk_kda() -> tuple[Callable, Callable]:
    """fla-core's ``chunk_kda`` through genolong's adapters: ``(chunk_kda, chunk_kda_gated)``
    (raises ImportError / InputError)."""
    from .kda.fla_backend import load_fla_kernel, make_fla_chunk_kda, make_fla_chunk_kda_gated

    kernel = load_fla_kernel()
    return make_fla_chunk_kda(kernel), make_fla_chunk_kda_gated(kernel)


def _triton_op(module: str, function: str) -> Callable:
    """One of genolong's Triton DSA kernels, ``genolong.kernels.dsa.<module>.<function>`` (each
    has its torch reference op's signature and semantics).

    Raises:
        ImportError: the kernel module (or Triton) fails to import, naming the cause.
    """
    import importlib

    try:
        return getattr(importlib.import_module(f"{__package__}.dsa.{module}"), function)
    except ImportError:
        raise
    except Exception as exc:  # Triton raises RuntimeError & co. when it finds no usable driver
        raise ImportError(
            f"genolong.kernels.dsa.{module} failed to import: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc


def _fla_backend() -> KernelBackend:
    _require_cuda("fla")
    reference = _torch_backend()
    fla_kda, fla_kda_gated = _fla_chunk_kda()
    return KernelBackend(
        name="fla",
        description="fla-core Triton chunk_kda for KDA training (CUDA tensors; gate and beta in the kernel "
        "through chunk_kda_gated); torch reference for recurrent KDA, the DSA indexer/KPool/"
        "sparse attention/KL loss and chunked CE",
        chunk_kda=_on_cuda(fla_kda, reference.chunk_kda, "chunk_kda", "fla-core"),
        chunk_kda_gated=_on_cuda(fla_kda_gated, reference.chunk_kda_gated, "chunk_kda_gated", "fla-core"),
        recurrent_kda=reference.recurrent_kda,
        kpool_keys=reference.kpool_keys,
        kpool_topk=reference.kpool_topk,
        sparse_attention=reference.sparse_attention,
        kpool_indexer_kl_loss=reference.kpool_indexer_kl_loss,
        chunked_cross_entropy=reference.chunked_cross_entropy,
        impls={**reference.impls, "chunk_kda": "fla-core", "chunk_kda_gated": "fla-core"},
    )


def _triton_backend() -> KernelBackend:
    from .probe import GPU_FIX, package_problem

    _require_cuda("triton")
    old = package_problem("Triton")
    if old is not None:  # the kernels import with an old Triton, then fail to compile mid-run
        raise ImportError(f"{old}; {GPU_FIX}")
    reference = _torch_backend()
    gt = "genolong-triton"
    sparse_attention = _on_cuda(
        _triton_op("triton_attention", "sparse_attention_triton"), reference.sparse_attention, "sparse_attention", gt
    )
    kpool_topk = _on_cuda(_triton_op("triton_topk", "kpool_topk_triton"), reference.kpool_topk, "kpool_topk", gt)
    kpool_keys = _on_cuda(_triton_op("triton_kpool", "kpool_keys_triton"), reference.kpool_keys, "kpool_keys", gt)
    kpool_indexer_kl_loss = _on_cuda(
        _triton_op("triton_kpool", "kpool_indexer_kl_loss_triton"),
        reference.kpool_indexer_kl_loss,
        "kpool_indexer_kl_loss",
        gt,
    )
    impls = {**reference.impls, "sparse_attention": gt, "kpool_topk": gt, "kpool_keys": gt, "kpool_indexer_kl_loss": gt}
    try:
        fla_kda, fla_kda_gated = _fla_chunk_kda()
        chunk_kda = _on_cuda(fla_kda, reference.chunk_kda, "chunk_kda", "fla-core")
        chunk_kda_gated = _on_cuda(fla_kda_gated, reference.chunk_kda_gated, "chunk_kda_gated", "fla-core")
        impls.update(chunk_kda="fla-core", chunk_kda_gated="fla-core")
        kda_from = "fla-core Triton chunk_kda for KDA training"
    except (ImportError, InputError) as exc:
        # a warning, not an info line: the backend is named 'triton' but KDA (most of the model's
        # layers) runs the torch reference; impls says so too (gpu_check records it)
        log.warning(
            "genolong: kernel backend 'triton': fla-core unavailable (%s); KDA runs the torch reference", _one_line(exc)
        )
        chunk_kda, chunk_kda_gated = reference.chunk_kda, reference.chunk_kda_gated
        kda_from = "torch chunked KDA (fla-core unavailable)"
    return KernelBackend(
        name="triton",
        description=f"genolong Triton DSA kernels for CUDA tensors (KPool key pooling, pooled-key scores with a "
        f"running top-k, sparse attention, the indexer KL loss); {kda_from}; torch reference for "
        "recurrent KDA and chunked CE",
        chunk_kda=chunk_kda,
        chunk_kda_gated=chunk_kda_gated,
        recurrent_kda=reference.recurrent_kda,
        kpool_keys=kpool_keys,
        kpool_topk=kpool_topk,
        sparse_attention=sparse_attention,
        kpool_indexer_kl_loss=kpool_indexer_kl_loss,
        chunked_cross_entropy=reference.chunked_cross_entropy,
        impls=impls,
    )


def resolve_auto() -> str:
    """The backend ``auto`` stands for here: ``torch`` without CUDA, else ``triton`` with its KDA
    from fla-core.

    Raises:
        InputError: on a CUDA machine, Triton or fla-core missing or older than their floors
            (:func:`genolong.kernels.probe.gpu_kernel_problem`), or the ``triton`` backend failing
            to load or to take its KDA from fla-core: one line naming ``pip install
            'genolong[gpu]'`` (and ``kernel_backend: torch`` for the reference on purpose).
    """
    from .probe import gpu_kernel_problem, refusal

    if not _cuda_available():
        return "torch"
    problem = gpu_kernel_problem()
    if problem is None:
        try:
            backend = get_backend("triton")
        except InputError as exc:
            problem = _one_line(exc)
        else:
            if backend.impls.get("chunk_kda_gated") != "fla-core":
                problem = "fla-core failed to import"
    if problem is not None:
        raise InputError(refusal("auto", problem))
    return "triton"


def _auto_backend() -> KernelBackend:
    return get_backend(resolve_auto())


def _torch_backend() -> KernelBackend:
    from .ce import chunked_cross_entropy
    from .dsa import kpool_indexer_kl_loss, kpool_keys, kpool_topk, sparse_attention
    from .kda import chunk_kda, recurrent_kda
    from .kda.fla_backend import reference_chunk_kda_gated

    return KernelBackend(
        name="torch",
        description="plain torch (chunked KDA, blockwise pooled-key DSA top-k, query-chunked sparse attention, chunked CE)",
        chunk_kda=chunk_kda,
        chunk_kda_gated=reference_chunk_kda_gated,
        recurrent_kda=recurrent_kda,
        kpool_keys=kpool_keys,
        kpool_topk=kpool_topk,
        sparse_attention=sparse_attention,
        kpool_indexer_kl_loss=kpool_indexer_kl_loss,
        chunked_cross_entropy=chunked_cross_entropy,
        impls=dict.fromkeys(OPS, "torch"),
    )


register_backend("torch", _torch_backend)
register_backend("fla", _fla_backend)
register_backend("triton", _triton_backend)
register_backend("auto", _auto_backend)

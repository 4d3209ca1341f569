"""Which kernels' save sets the planner counts for a model's ``kernel_backend`` (:func:`backend_kernels`).

``auto`` on a GPU recipe is the ``triton`` backend: fla-core's ``chunk_kda`` for KDA (its
``save_for_backward`` read from fla's source, see :func:`genolong.plan.activations._kda`; fla cannot
run on CPU) and genolong's Triton DSA kernels (metered on CPU in Triton's interpreter by the
tests); on a CPU-only recipe it is ``torch``. ``tests/plan/test_plan_activations.py`` holds the table to
the registry (``genolong.kernels.backends``) and the fla save set to the installed fla-core's source.
"""

from __future__ import annotations

from ..errors import InputError

__all__ = ["BACKEND_KERNELS", "DSA_KERNELS", "KDA_KERNELS", "backend_kernels"]

#: KDA chunk kernels the planner knows: ``torch`` (genolong's, validated against the meter) and
#: ``fla`` (fla-core's Triton ``chunk_kda``, read from its source: not runnable on CPU, so not
#: validated here; see :func:`~genolong.plan.activations._kda`).
KDA_KERNELS = ("torch", "fla")
#: DSA kernels the planner knows: ``torch`` (the reference ops) and ``triton`` (genolong's Triton
#: DSA kernels, ``genolong.kernels.dsa.triton_*``: measured on CPU under ``TRITON_INTERPRET=1``).
DSA_KERNELS = ("torch", "triton")
#: ``ModelConfig.kernel_backend`` -> (KDA chunk kernel, DSA kernels) the planner counts, for a GPU
#: run (``genolong.kernels.backends``): ``triton`` takes KDA from fla-core when it imports (the
#: planner assumes it does on a GPU machine) and ``auto`` resolves to ``triton`` on CUDA
#: (``resolve_auto``), to ``torch`` on a CPU-only run (``parallel.accelerator: cpu``).
BACKEND_KERNELS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "torch"),
    "fla": ("fla", "torch"),
    "triton": ("fla", "triton"),
    "auto": ("fla", "triton"),
}


def backend_kernels(backend: str, accelerator: str = "gpu") -> tuple[str, str]:
    """The (KDA chunk kernel, DSA kernel) pair a ``kernel_backend`` runs on ``accelerator``.

    ``auto`` on ``cpu`` is ``torch`` (no CUDA: ``genolong.kernels.backends.resolve_auto``); on
    ``gpu``, ``cuda`` or ``auto`` it is the ``triton`` backend (fla-core's ``chunk_kda`` and the
    Triton DSA kernels), assuming the GPU machine has Triton and fla-core >= 0.5.2.

    Raises:
        InputError: an unknown backend name.
    """
    if backend not in BACKEND_KERNELS:
        raise InputError(
            f"kernel_backend {backend!r} is unknown to the planner; choose one of {', '.join(BACKEND_KERNELS)}"
        )
    if backend == "auto" and accelerator == "cpu":
        return "torch", "torch"
    return BACKEND_KERNELS[backend]

"""What kernels this machine can run, probed without importing torch, Triton or fla.

``kernel_backend: auto`` must never fall back to a slow path in silence: on a CUDA machine it
runs genolong's Triton DSA kernels and fla-core's ``chunk_kda`` or refuses with one line naming
the fix (:data:`GPU_FIX`); only a recipe that asks for ``torch`` runs the torch reference there.
This module holds that rule in a form both the run (:func:`genolong.kernels.backends.resolve_auto`,
which then imports the kernels) and ``genolong plan`` (which must start without torch:
``tests/cli/test_cli_startup.py``) use:

- :func:`package_version`: an installed distribution's version from its metadata (no import);
- :func:`package_problem` / :func:`gpu_kernel_problem`: what is missing or too old for the GPU
  kernels (None: nothing);
- :func:`cuda_here`: whether this machine has a usable CUDA device (torch's own answer when torch
  is already imported, else the driver's device count through ``libcuda`` and a CUDA build of
  torch);
- :func:`kernels_here` and :func:`kernel_line`: the kernels a backend runs here, in the words
  the plan prints and the run logs (``KDA fla-core, DSA genolong-triton``).

The floors: fla-core 0.5.2 (its context-parallel KDA backward was wrong before), Triton 3.6
(pyproject's ``gpu`` extra: 3.3 has no ``tl.topk``, 3.4-3.5 spill registers in genolong's top-k
kernel; every kernel compiles on sm_90 from 3.6, ``benchmarks/gpu_compile.py``).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

__all__ = [
    "GPU_FIX",
    "MIN_FLA_CORE",
    "MIN_TRITON",
    "cuda_here",
    "describe_here",
    "gpu_kernel_problem",
    "kernel_line",
    "kernels_here",
    "package_problem",
    "package_version",
    "parse_version",
    "refusal",
]

#: The install line that brings every GPU kernel (pyproject's ``gpu`` extra: fla-core and Triton).
GPU_FIX = "pip install 'genolong[gpu]'"
#: Oldest fla-core whose ``chunk_kda`` genolong accepts (its context-parallel backward before 0.5.2 was wrong).
MIN_FLA_CORE: tuple[int, int, int] = (0, 5, 2)
#: Oldest Triton genolong's DSA kernels compile with (``tl.topk``, register budget; see the module docstring).
MIN_TRITON: tuple[int, int, int] = (3, 6, 0)


def parse_version(version: str) -> tuple[int, int, int] | None:
    """``"0.6.0"`` / ``"0.5.2.dev3+g1234"`` / ``"3.7.1"`` -> ``(0, 6, 0)`` / ``(0, 5, 2)`` /
    ``(3, 7, 1)``; missing parts are 0; None when no number can be read."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    if not parts:
        return None
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` (distribution names) that is installed, or None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _floor(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


#: what each GPU package is called: label -> (distribution names, floor)
_PACKAGES: dict[str, tuple[tuple[str, ...], tuple[int, int, int]]] = {
    "Triton": (("triton",), MIN_TRITON),
    "fla-core": (("fla-core", "flash-linear-attention"), MIN_FLA_CORE),
}


def package_problem(label: str) -> str | None:
    """Why GPU package ``label`` (``"Triton"`` or ``"fla-core"``) cannot serve here, as a clause
    (``"fla-core is not installed"``, ``"Triton 3.3.0 is older than 3.6.0"``), or None when it is
    installed at or above its floor (whether it imports is for the run to find out)."""
    dists, floor = _PACKAGES[label]
    version = package_version(*dists)
    if version is None:
        return f"{label} is not installed"
    parsed = parse_version(version)
    if parsed is None or parsed < floor:
        return f"{label} {version} is older than {_floor(floor)}"
    return None


def gpu_kernel_problem() -> str | None:
    """Why ``auto`` cannot run every GPU kernel here (Triton's and fla-core's problems, joined by
    "; "), or None. CUDA itself is not checked (:func:`cuda_here`)."""
    return "; ".join(p for p in (package_problem("Triton"), package_problem("fla-core")) if p) or None


def refusal(backend: str, problem: str) -> str:
    """The one line ``auto`` fails with on a CUDA machine that lacks the GPU kernels."""
    return (
        f"kernel_backend {backend!r} on this CUDA machine would run the slow torch reference ({problem}); "
        f"{GPU_FIX}, or set kernel_backend: torch to run the reference on purpose"
    )


def _torch_has_cuda_build() -> bool:
    """Whether the installed torch is a CUDA build: its ``torch/version.py`` read as text
    (``cuda = '12.8'``, or ``None`` in a CPU build), without importing torch."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "version.py"
        if path.is_file():
            match = re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+)$", path.read_text(), flags=re.M)
            return match is not None and match.group(1).strip() not in ("None", "''", '""')
    return False


def _driver_devices() -> int:
    """CUDA devices the driver reports (``cuInit`` + ``cuDeviceGetCount`` through ``libcuda``);
    0 without a driver or on any error."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        try:
            if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
        except (AttributeError, OSError):
            return 0
        return count.value
    return 0


def cuda_here() -> bool:
    """Whether this machine can run CUDA tensors: ``torch.cuda.is_available()`` when torch is
    already imported (the run), else a CUDA build of torch and at least one device reported by
    the driver (``genolong plan``, which must not import torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        return bool(torch.cuda.is_available())
    return _torch_has_cuda_build() and _driver_devices() > 0


def kernels_here(backend: str) -> tuple[str, str, str | None]:
    """``(KDA implementation, DSA implementation, refusal)`` for ``kernel_backend`` ``backend`` on
    this machine, from the probes alone (no kernel is imported); names as
    :attr:`genolong.kernels.backends.KernelBackend.impls` has them (``torch``, ``fla-core``,
    ``genolong-triton``). ``refusal`` is the one line the run stops with, else None:

    - no CUDA here, or ``torch``: the torch reference for both;
    - ``auto``: fla-core's KDA and genolong's Triton DSA, or a refusal naming :data:`GPU_FIX`;
    - ``fla`` / ``triton``: as asked, refused when its package is missing or too old (fla-core
      needs Triton too); ``triton`` without fla-core runs KDA on the torch reference (the run
      warns), as the backend registry does.
    """
    if backend == "torch" or not cuda_here():
        return "torch", "torch", None
    triton, fla = package_problem("Triton"), package_problem("fla-core")
    if backend == "auto":
        problem = gpu_kernel_problem()
        return ("torch", "torch", refusal(backend, problem)) if problem else ("fla-core", "genolong-triton", None)
    needed = [p for p in ((triton, fla) if backend == "fla" else (triton,)) if p]
    if needed:
        return (
            "torch",
            "torch",
            (
                f"kernel backend {backend!r} cannot load here ({'; '.join(needed)}); "
                f"{GPU_FIX}, or use kernel_backend 'torch'"
            ),
        )
    if backend == "fla":
        return "fla-core", "torch", None
    return ("torch" if fla else "fla-core"), "genolong-triton", None


def kernel_line(backend: str, resolved: str, kda: str, dsa: str) -> str:
    """The words for what runs: ``"backend 'auto' -> 'triton': KDA fla-core, DSA genolong-triton"``
    (the plan's "on this machine" line and the run's log line say the same)."""
    name = repr(backend) if backend == resolved else f"{backend!r} -> {resolved!r}"
    return f"backend {name}: KDA {kda}, DSA {dsa}"


def describe_here(backend: str) -> str:
    """What ``kernel_backend`` ``backend`` runs on this machine, as ``genolong plan`` prints it:
    :func:`kernel_line` (``"backend 'auto' -> 'torch': KDA torch, DSA torch (no CUDA here)"``),
    or ``"backend 'auto': refused: <the run's one-line error>"``."""
    kda, dsa, refused = kernels_here(backend)
    if refused is not None:
        return f"backend {backend!r}: refused: {refused}"
    cuda = cuda_here()
    resolved = ("triton" if cuda else "torch") if backend == "auto" else backend
    return kernel_line(backend, resolved, kda, dsa) + ("" if cuda else " (no CUDA here)")

"""Shared fixtures: the bundled sample prepared once per session, one torch thread per module;
Triton's interpreter mode for the kernel tests; genolong's CPU allocator setting."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# genolong's Triton kernels are tested on CPU tensors in Triton's interpreter (the GPU runs are
# benchmarks/gpu_check.sh). The interpreter works only if Triton itself is imported in that mode
# (``triton.language``'s own helpers are jit functions decorated at import), and fla-core imports
# Triton as soon as any test imports fla: so the mode is set here, before any test module is
# collected (export TRITON_INTERPRET=0 to override).
os.environ.setdefault("TRITON_INTERPRET", "1")

from genolong.allocator import keep_freed_memory
from genolong.data.prepare import prepare_genome
from genolong.quickstart import SAMPLE_EVAL, SAMPLE_TRAIN, sample_fasta

# the suite's long-context tests allocate as genolong's commands do: freed memory kept (see
# genolong.allocator; GENOLONG_MALLOC=system runs the suite with glibc's defaults)
keep_freed_memory()


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample prepared once per test session (read-only for tests)."""
    out = tmp_path_factory.mktemp("sample") / "genome"
    prepare_genome([sample_fasta()], out, train=SAMPLE_TRAIN, eval=SAMPLE_EVAL, progress=False)
    return out


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op torch thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    These tests run many small ops: with two OpenMP threads on a shared 2-core machine each op can
    wait for a descheduled worker (one ``index_add_`` took 45 ms under load; a loss + backward at
    T = 200 took 0.47 s with 2 threads and 0.025 s with 1).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _interpreter_numpy_problem() -> str | None:
    """Why Triton's interpreter cannot run genolong's kernels with the installed versions, or None.

    triton 3.6's interpreter turns a loop bound computed from ``tl.program_id`` into a Python int
    through ``int()`` of a one-element array, which numpy 2.4 refuses ("only 0-dimensional arrays
    can be converted to Python scalars"); triton >= 3.7 does not. torch 2.11's CUDA builds pin
    triton 3.6.0 (pyproject.toml's floor), so that combination is a supported one with numpy < 2.4.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from importlib.metadata import version

        import numpy

        triton_version = version("triton")
    except Exception:  # no triton: the kernel tests say so themselves
        return None

    def release(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())

    if release(triton_version) < (3, 7) and release(numpy.__version__) >= (2, 4):
        return (
            f"triton {triton_version}'s interpreter cannot run genolong's kernel tests with numpy "
            f"{numpy.__version__}: install numpy < 2.4 (pip install 'numpy<2.4') or triton >= 3.7"
        )
    return None


_INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under ``tests/integration/`` ``integration`` (``-m "not integration"``
    leaves out the end-to-end and multi-process runs), from its folder rather than by hand."""
    for item in items:
        if item.path.is_relative_to(_INTEGRATION):
            item.add_marker(pytest.mark.integration)


def pytest_configure(config: pytest.Config) -> None:
    """One line, before any test runs, for a version combination the kernel tests cannot run on."""
    problem = _interpreter_numpy_problem()
    if problem is not None:
        raise pytest.UsageError(problem)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real one-node SLURM (munge, slurmctld, slurmd; :mod:`tests.slurm_cluster`) for the session,
    stopped at its end (the daemons it started, by PID). Skips with the reason where SLURM's
    binaries are missing (apt-get install slurmctld slurmd slurm-client munge; .ci/run does)."""
    from .slurm_cluster import missing, start

    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    cluster = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()

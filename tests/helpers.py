"""Test helpers: small FASTA writers, a naive reference segmenter, paths of the test data, the
bitwise comparison of floating-point results, the transformers child process, the multi-process
(gloo) launcher and a spy on Triton kernel launches."""

from __future__ import annotations

import faulthandler
import gzip
import re
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pysam
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genolong.parallel.shutdown import exit_process

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = Path(__file__).resolve().parent / "data"
SOFTMASKED_CHR16 = TEST_DATA / "hg38_chr16_186964-397118.softmasked.fa.gz"
CHRM = TEST_DATA / "chrM_rCRS.fa.gz"

_AMBIGUITY = re.compile(r"[RYSWKMBDHV]")


def fasta_text(
    records: Iterable[tuple[str, str]], width: int = 60, newline: str = "\n", final_newline: bool = True
) -> str:
    """FASTA text of (header, sequence) records wrapped at ``width`` columns."""
    lines: list[str] = []
    for header, seq in records:
        lines.append(f">{header}")
        lines.extend(seq[i : i + width] for i in range(0, len(seq), width))
    text = newline.join(lines)
    return text + newline if final_newline else text


def write_fasta(
    path: Path,
    records: Iterable[tuple[str, str]],
    width: int = 60,
    compress: str | None = None,
    newline: str = "\n",
    index: bool = False,
) -> Path:
    """Write records as plain, gzip or bgzip FASTA (bgzip/plain optionally with .fai/.gzi)."""
    text = fasta_text(records, width, newline).encode()
    if compress == "gzip":
        with gzip.open(path, "wb") as handle:
            handle.write(text)
    elif compress == "bgzip":
        plain = path.with_name(path.name + ".plain")
        plain.write_bytes(text)
        pysam.tabix_compress(str(plain), str(path), force=True)
        plain.unlink()
    else:
        path.write_bytes(text)
    if index:
        pysam.faidx(str(path))
    return path


def reference_segments(seq: str, min_gap: int) -> list[tuple[int, int]]:
    """Naive segmentation: trim N at both ends, cut at N runs of at least ``min_gap``.

    Ambiguity codes count as N (they become N tokens). Returns half-open record coordinates.
    """
    as_n = _AMBIGUITY.sub("N", seq.upper())
    segments = []
    i = 0
    for m in re.finditer(r"N+", as_n):
        at_end = m.start() == 0 or m.end() == len(as_n)
        if at_end or m.end() - m.start() >= min_gap:
            if m.start() > i:
                segments.append((i, m.start()))
            i = m.end()
    if i < len(as_n):
        segments.append((i, len(as_n)))
    return segments


def expected_text(seq: str) -> str:
    """What decode() returns for ``seq``: ambiguity codes become N, case kept."""
    return re.sub(r"[ryswkmbdhv]", "n", _AMBIGUITY.sub("N", seq))


# -- bitwise comparisons of floating-point results ---------------------------------------------------


def assert_bitwise_equal(actual: Any, expected: Any, what: str) -> None:
    """Assert that two floating-point results are bitwise equal, under one torch thread only.

    Bitwise equality of computed floats holds for the same computation on the same shapes with the
    same number of intra-op threads: with two threads a reduction is split in two partial sums whose
    boundary moves with the shapes (a prefix against the whole sequence, an expert's token count in
    the MoE), and results differ in the last bits (3e-8 in issue 13). So this helper fails unless
    ``torch.get_num_threads() == 1``: the calling module must be under the ``one_thread`` fixture
    (``pytestmark = pytest.mark.usefixtures("one_thread")``; tests/test_suite_rules.py checks that
    statically too). Where different shapes are compared (causality: a prefix against the whole), one
    thread is not enough either, as the BLAS picks kernels by shape: compare with a tolerance there
    and say why that tolerance.

    Args:
        actual, expected: tensors or numpy arrays of the same shape and dtype, or mappings of them
            (state dicts: the same keys, each value compared).
        what: what is compared, for the failure message (e.g. ``"logits of the resumed run"``).

    Raises:
        pytest.fail.Exception: when more than one torch thread is set, or when the keys, shapes,
            dtypes or any bit differ (with the count of differing elements and the largest difference).
    """
    threads = torch.get_num_threads()
    if threads != 1:
        pytest.fail(
            f"{what}: a bitwise comparison of floating-point results under {threads} torch threads; "
            "put the test module under the one_thread fixture "
            '(pytestmark = pytest.mark.usefixtures("one_thread")) or compare with a tolerance and say why',
            pytrace=False,
        )
    if isinstance(actual, Mapping) or isinstance(expected, Mapping):
        if not (isinstance(actual, Mapping) and isinstance(expected, Mapping)) or actual.keys() != expected.keys():
            pytest.fail(f"{what}: the keys differ", pytrace=False)
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{what}[{key!r}]")
        return
    a = torch.from_numpy(actual) if isinstance(actual, np.ndarray) else actual
    b = torch.from_numpy(expected) if isinstance(expected, np.ndarray) else expected
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise TypeError(
            f"{what}: assert_bitwise_equal compares tensors or numpy arrays, got "
            f"{type(actual).__name__} and {type(expected).__name__}"
        )
    if a.shape != b.shape or a.dtype != b.dtype:
        pytest.fail(f"{what}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}", pytrace=False)
    if not torch.equal(a, b):
        differ = a != b
        largest = (a.double() - b.double()).abs()[differ].max().item() if a.is_floating_point() else float("nan")
        pytest.fail(
            f"{what}: {int(differ.sum())} of {a.numel()} elements differ (largest difference {largest:.3g})",
            pytrace=False,
        )


# transformers routes glm5_next's KDA to fla's Triton kernels whenever fla is importable, and those
# fail on CPU: every transformers reference runs in a child process that hides fla first.
_TRANSFORMERS_PRELUDE = 'import sys\nsys.modules["fla"] = None\n'


_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+', re.MULTILINE)


def genolong_frames(text: str) -> list[str]:
    """The traceback frames in ``text`` (``File "PATH", line N``) whose file lies in genolong's own
    code (the ``genolong``, ``genolong.kernels`` and ``genolong.evaluation`` package folders).

    A frame is matched by its file, not by any path that contains the project's name: a checkout
    in a folder named ``genolong`` (what ``git clone`` makes) puts ``/genolong/`` in every path of
    its virtualenv, Lightning's hints included.
    """
    import genolong
    import genolong.evaluation
    import genolong.kernels

    roots = [Path(p).resolve() for pkg in (genolong, genolong.kernels, genolong.evaluation) for p in pkg.__path__]
    frames = []
    for path in _FRAME.findall(text):
        resolved = Path(path).resolve()
        if any(resolved.is_relative_to(root) for root in roots):
            frames.append(path)
    return frames


def run_transformers(script: str, *args: str, stdin: str = "") -> str:
    """Run a transformers reference ``script`` (with ``args`` in ``sys.argv[1:]`` and ``stdin``)
    in a child process where fla cannot be imported; returns its stdout.

    Raises:
        AssertionError: with the child's stderr if it fails.
    """
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _TRANSFORMERS_PRELUDE + script, *args], input=stdin, text=True, capture_output=True
    )
    if run.returncode:
        raise AssertionError(f"the transformers reference failed:\n{run.stderr[-4000:]}")
    return run.stdout


# -- multi-process runs (gloo) ----------------------------------------------------------------------


def _rank_entry(rank: int, fn: Callable[..., None], world: int, init_file: str, args: tuple[Any, ...]) -> None:
    # one intra-op thread per process: the machine's cores are shared by all ranks
    torch.set_num_threads(1)
    # a rank that aborts in C++ prints where its Python threads stood (none: finalization)
    faulthandler.enable(all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        fn(rank, world, *args)
        # every rank past its last collective before any rank closes its connections: a gloo send
        # can complete before the peer has read it
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # a rank whose work is done ends without the interpreter's finalization, where the gloo worker
    # threads of groups torch still holds aborted finished ranks (SIGABRT, "terminate called
    # without an active exception": twice in CI; 3 in 140 2-rank FSDP2 jobs of
    # benchmarks/rank_exit.py ended by barrier + destroy as here, 0 in 140 with exit_process after
    # them); a rank that raised has its traceback written by spawn already
    exit_process(0)


def run_ranks(fn: Callable[..., None], world: int, tmp_path: Path, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined in a gloo process group.

    ``fn`` must be a module-level function (it is pickled). A rank that raises fails the call with
    its traceback (the other ranks are terminated); a run longer than ``timeout`` seconds is
    terminated and fails the test (the process group's own timeout, 60 s, also ends a rank stuck
    in a collective whose partner died).
    """
    init_file = tmp_path / f"pg_init_{time.monotonic_ns()}"
    ctx = mp.start_processes(
        _rank_entry, args=(fn, world, str(init_file), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
            pytest.fail(f"{world}-process run of {fn.__name__} did not finish within {timeout:.0f} s")


def spy_on_launches(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> list[list[torch.dtype]]:
    """Record the dtypes of the tensor arguments of each launch of ``kernel`` (an interpreted
    ``@triton.jit`` function, whose ``kernel[grid](...)`` calls its ``run``); the kernel still runs.

    Returns:
        the list the launches are appended to, one ``[dtype, ...]`` per launch in argument order.
    """
    seen: list[list[torch.dtype]] = []
    real = kernel.run

    def run(*args: Any, **kwargs: Any) -> Any:
        seen.append([a.dtype for a in args if isinstance(a, torch.Tensor)])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    return seen


def trained_parameter_names(recipe: Any) -> set[str]:
    """The names of the parameters of ``recipe.model.preset`` that ``recipe.model.freeze`` leaves
    trained (built on the meta device: no memory, no weights)."""
    from genolong.model import GenoLM
    from genolong.model.config import ModelConfig
    from genolong.train.module import freeze_parameters

    with torch.device("meta"):
        model = GenoLM(ModelConfig.from_preset(recipe.model.preset))
    freeze_parameters(model, recipe.model.freeze)
    return {name for name, p in model.named_parameters() if p.requires_grad}


def register_interpreted_triton() -> None:
    """Register a ``triton`` kernel backend that runs on CPU tensors, for spawned rank processes
    (it replaces the process-wide registry entry; a test process must restore it).

    It is the real backend's wiring (``genolong.kernels.backends._triton_backend``: which op goes to
    which of genolong's Triton kernels, and its dispatch counts), built as on a CUDA machine without
    fla-core, except that the ops it sends to genolong's Triton kernels run them on CPU tensors
    too, in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before Triton is
    imported; a spawned process inherits the environment). KDA runs the torch reference, as the
    real backend does without fla-core.
    """
    from genolong.kernels import backends

    def on_any_device(fast: Callable, reference: Callable, name: str = "", impl: str = "") -> Callable:
        run = fast if impl == "genolong-triton" else reference

        def op(*args: Any, **kwargs: Any) -> Any:
            backends._DISPATCHED[name, impl if run is fast else "torch"] += 1
            return run(*args, **kwargs)

        return op

    def no_fla() -> tuple[Callable, Callable]:
        raise ImportError("fla-core's kernels are not interpreted here")

    def loader() -> Any:
        saved = backends._cuda_available, backends._on_cuda, backends._fla_chunk_kda
        backends._cuda_available, backends._on_cuda, backends._fla_chunk_kda = (lambda: True), on_any_device, no_fla
        try:
            return backends._triton_backend()
        finally:
            backends._cuda_available, backends._on_cuda, backends._fla_chunk_kda = saved

    backends.register_backend("triton", loader)


class TorchDSAEngineCalls:
    """Counts calls of the torch DSA engines while active (a context manager): the blockwise top-k
    ``causal_topk`` (wherever a genolong module imported it), the torch indexer KL's per-block
    target ``_block_log_target`` and the torch sparse attention's ``_block_indices``. The torch
    backend runs them on every DSA layer; a backend whose kernels take every offset never does.

    Attributes:
        calls: ``{"causal_topk": n, "kl_block": n, "attention_block": n}``.
    """

    def __init__(self) -> None:
        self.calls = {"causal_topk": 0, "kl_block": 0, "attention_block": 0}
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> TorchDSAEngineCalls:
        import sys

        from genolong.kernels.dsa import attention, indexer, kpool_loss

        targets = [
            (indexer.causal_topk, "causal_topk"),
            (kpool_loss._block_log_target, "kl_block"),
            (attention._block_indices, "attention_block"),
        ]
        for fn, key in targets:

            def counted(*args: Any, _fn: Callable = fn, _key: str = key, **kwargs: Any) -> Any:
                self.calls[_key] += 1
                return _fn(*args, **kwargs)

            for name, module in list(sys.modules.items()):
                if name.startswith("genolong") and getattr(module, fn.__name__, None) is fn:
                    self._saved.append((module, fn.__name__, fn))
                    setattr(module, fn.__name__, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

#!/usr/bin/env python
"""Compile every Triton kernel a genolong backend can launch, for sm_90 and sm_100, at real shapes.

No GPU needed: Triton compiles for a target it does not have (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`` runs the whole pipeline down to PTX and the wheel's ``ptxas``),
which finds what the CPU interpreter cannot: type errors across loop iterations, shared memory over
the per-block limit, register spills, dots that do not run on tensor cores.

What is compiled is *captured*, not restated. The ``triton`` backend's wrappers (the
``_triton_op(module, function)`` routes of ``kernels/backends.py``) run forward and, through
autograd, backward on ``meta`` tensors of the real geometry and context length (a ``meta`` tensor
has shape, dtype and strides but no storage, so a [1, 1M, 64, 512] query costs nothing). Every
``kernel[grid](...)`` launch goes through Triton's own ``JITFunction.run``, which binds it for the
target exactly as a launch on that GPU would be (Triton's active driver is a stand-in that reports
the target and loads no CUDA driver), and is recorded by Triton's JIT cache hook, which then skips
the compile and the launch (``Autotuner.run`` expands into one launch per config): the signature
(``*bf16``, ``i32`` or ``i64`` by the integer's actual value at that length, ``constexpr``), the
specialisation attributes (16-divisibility) and the options the wrapper chose (``num_warps``,
``num_stages``). Nothing of the wrappers' block-size logic is duplicated here, so a changed or new
kernel is picked up as it is launched.

Triton releases: this runs on every release from 3.3.0 to 3.9.0; genolong's kernels pass its checks
from 3.6 on (torch 2.11's pin), which is pyproject.toml's lower bound (docs/contributing.md, "Triton,
fla-core and transformers versions checked"; the 3.6.0 run: ``benchmarks/results/gpu_compile_triton36.json``). The few things this needs that are not Triton's public API (where
the cache hook and the active driver live, the ptxas command line) moved between releases; the
functions of the "Triton versions" section handle each release explicitly, older ones included, so
that it can say what fails on them.

Shapes (the absorbed DSA layer of ``genolong/model/dsa.py``: ``sparse_attention(q, latent,
latent, ...)``, ``v is k``), from ``genolong.model.config.PRESETS``:

- ``glm-5.3-flash``: 64 query heads on one latent head of ``kv_lora_rank + qk_rope_head_dim`` = 512,
  top-k 2,048 tokens as 128 pools of 16 (+ the 15-token tail), indexer 32 heads x 128;
- ``1b``: 12 heads on a 256 latent, top-k 2,048 as 128 pools of 16, indexer 8 x 64.

Context lengths: every ``(data.context, parallel.cp)`` of ``recipes/*.yaml`` (up to 1,048,576 tokens,
cp 8), batch 1 (the recipes' ``batch_size``). Per length, every wrapper runs on the whole sequence
(cp 1), and for cp > 1 also as the last context-parallel rank calls it (``genolong.parallel.cp_dsa``:
``sparse_attention``, ``kpool_topk`` and the indexer KL loss with ``T / cp`` local queries over all
``T`` keys (``T / P`` pools) at ``q_offset = T - T / cp``, ``kpool_keys`` on the local slice).
Launches whose bound signature is the same compile once; the table lists the lengths each covers.

Dtypes (``--dtypes``): ``bf16`` (a model in bf16: every float input bf16 except the indexer head
weights, which ``DSAIndexer.project`` makes fp32), ``bf16-mixed`` (what the recipes' ``bf16-mixed``
autocast with fp32 master weights hands the kernels: bf16 queries and index queries, an fp32
latent out of the RMSNorm, fp32 index keys out of the LayerNorm and so fp32 pooled keys, bf16 gate
logits, fp32 ``ape`` and head weights), ``fp32`` (``32-true``; not in the default set).

Per (kernel, phase, shape, dtype, arch): compiled or the error (one line); shared memory per
block (Triton's metadata, the dynamic shared memory the launch asks for); registers, spill stores
and loads per thread (``ptxas -v`` of the wheel, run on the kernel's PTX with Triton's own flags,
cached under Triton's cache directory by the PTX's hash); the dots (``tt.dot`` in the TTIR: operand
types, and how many are fp32 ``ieee``, i.e. FMA, not tensor cores) and the tensor-core
instructions in the PTX (``wgmma`` on sm_90, ``tcgen05.mma`` on sm_100, ``mma.sync`` on either).

Compiles run ``--jobs`` at a time, each in a forked child killed after ``--timeout`` seconds (a
kernel whose build takes minutes stalls a training run's first step as long: it counts as an error).

Checks (``--check`` exits 1; ``tests/kernels/test_gpu_compile.py`` asserts the same on the JSON): every
kernel compiles (within the timeout); shared memory <= 232,448 B per block (H100/H200/B200 opt-in maximum); spill stores
within the kernel's budget (:data:`SPILL_BUDGETS`, with the reasons); with 16-bit inputs every dot
runs on tensor cores (no fp32 ``ieee`` dot, and tensor-core instructions in the PTX).

Example::

    python benchmarks/gpu_compile.py                   # everything; writes benchmarks/results/gpu_compile.json
    python benchmarks/gpu_compile.py --shapes 1b --archs 90 --dtypes bf16 --json /tmp/gc.json

Must run without ``TRITON_INTERPRET`` (the interpreter replaces the kernels the harness compiles).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

ROOT = HERE.parent
DEFAULT_JSON = HERE / "results" / "gpu_compile.json"

#: Opt-in maximum of dynamic shared memory per block on H100, H200 and B200 (227 KiB).
SMEM_LIMIT = 232_448

ARCHS = {90: "sm_90", 100: "sm_100"}
SHAPES = ("glm-5.3-flash", "1b")
DTYPES = ("bf16", "bf16-mixed", "fp32")
DEFAULT_DTYPES = ("bf16", "bf16-mixed")

#: Spill stores allowed per thread (bytes, ``ptxas -v``) per kernel, and why. A kernel not listed
#: gets :data:`DEFAULT_SPILL_BUDGET`.
SPILL_BUDGETS: dict[str, tuple[int, str]] = {
    "_kpool_fwd_kernel": (0, "a [16, 64] softmax per program: nothing should spill"),
    "_kpool_bwd_kernel": (0, "a [16, 64] softmax and its partial dape per program: nothing should spill"),
    "_kpool_topk_kernel": (0, "the [BLOCK_Q, BLOCK_K] int64 running top-k and one score tile fit in registers"),
    "_kl_target_kernel": (
        16,
        "[G, 64] score tiles over 64-channel slices; at the 1b shape ptxas keeps one "
        "4-byte value in local memory with 72 registers in use (a placement choice, not "
        "pressure: GLM-5.3-Flash uses 103 registers and spills nothing)",
    ),
    "_kl_rows_kernel": (0, "[HI, KP] scores with num_warps chosen per shape: nothing should spill"),
    "_sparse_attn_fwd_kernel": (
        384,
        "the GLM-5.3-Flash [64, 512] fp32 accumulator over 8 warps uses every register "
        "(255); ptxas spills 72-76 B (bf16, sm_90) to 308-312 B (bf16 q with the fp32 "
        "latent cast in the kernel, sm_90); 4 warps spilled 3.1 KB before",
    ),
    "_sparse_attn_bwd_dq_kernel": (0, "the head group split over programs keeps dQ's accumulator at 16K elements"),
    "_sparse_attn_bwd_dkv_kernel": (
        256,
        "key-major: the 1b shape on sm_90 holds a [16, 256] dK accumulator and the "
        "Q/dO operand rows at 255 registers, spilling 160 B; GLM-5.3-Flash 0 B",
    ),
    "_sparse_attn_dkv_reduce_kernel": (0, "an elementwise sum of float32 partials"),
}
#: Budget of kernels without an entry (e.g. new ones): a few spilled registers around a loop cost
#: little next to the gathered loads; kilobytes mean the tiles or num_warps are wrong.
DEFAULT_SPILL_BUDGET = (512, "default: a few spilled registers around a loop; kilobytes mean the tiles are wrong")

_TC_PATTERNS = {
    "wgmma": re.compile(r"\bwgmma\.mma_async"),
    "tcgen05": re.compile(r"\btcgen05\.mma"),
    "mma": re.compile(r"\bmma\.sync"),
}
_DOT_RE = re.compile(r"tt\.dot\s([^:\n]*):\s*tensor<(?:\d+x)*(\w+)>\s*\*\s*tensor<(?:\d+x)*(\w+)>")
_PREC_RE = re.compile(r"inputPrecision\s*=\s*(\w+)")


# ----------------------------------------------------------------------------- shapes and lengths


@dataclass(frozen=True)
class Geometry:
    """What the DSA kernels see of a model preset (the absorbed layer)."""

    name: str
    heads: int  # query heads H
    latent: int  # kv_lora_rank + qk_rope_head_dim: the shared key/value head's width
    qk_head_dim: int  # for the softmax scale only
    topk: int
    pool: int
    tail: bool
    idx_heads: int
    idx_dim: int


def geometry(name: str) -> Geometry:
    """The :class:`Geometry` of preset ``name`` of ``genolong.model.config.PRESETS``."""
    from genolong.model.config import PRESETS

    c = PRESETS[name]
    return Geometry(
        name,
        c.num_attention_heads,
        c.kv_lora_rank + c.qk_rope_head_dim,
        c.qk_head_dim,
        c.index_topk,
        c.index_kpool,
        c.index_kpool_always_select_tail,
        c.index_n_heads,
        c.index_head_dim,
    )


def recipe_lengths() -> list[tuple[int, int]]:
    """Every ``(data.context, parallel.cp)`` of ``recipes/*.yaml``, longest first."""
    from genolong.config import load_recipe

    out = set()
    for path in sorted(glob.glob(str(ROOT / "recipes" / "*.yaml"))):
        r = load_recipe(path)
        out.add((int(r.data.context), int(r.parallel.cp)))
    return sorted(out, reverse=True)


def routed_wrappers() -> list[tuple[str, str]]:
    """``(module, function)`` of every Triton op the ``triton`` backend routes to (the
    ``_triton_op("module", "function")`` calls in ``kernels/backends.py``)."""
    text = (ROOT / "kernels" / "backends.py").read_text()
    body = text[text.index("def _triton_backend") :]
    body = body[: body.index("\ndef ", 1)]
    return re.findall(r'_triton_op\("(\w+)",\s*"(\w+)"\)', body)


# ----------------------------------------------------------------------------- Triton versions

# Everything this needs of Triton that is not public API moved between releases (3.3.0 to 3.9.0 each
# checked: docs/contributing.md, "Triton, fla-core and transformers versions checked"); each piece below
# says where it lives in which release.


def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton (``"3.7.1"`` -> ``(3, 7)``)."""
    import triton

    major, minor = re.match(r"(\d+)\.(\d+)", triton.__version__).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


@contextlib.contextmanager
def jit_cache_hook(hook: Callable[..., bool]) -> Iterator[None]:
    """Install ``hook`` as Triton's JIT cache hook for the block, and put the previous one back.

    ``JITFunction.run`` calls it before compiling a launch it has not compiled, with keywords ``key``,
    ``repr``, ``fn`` (``fn.jit_function``: the kernel), ``compile`` (the bound ``signature``,
    ``constants``, ``configs=[attrs]`` and ``specialization_data``: the compile's inputs as JSON) and
    more; when it returns true, ``run`` returns None without compiling or launching. Triton 3.3: the
    class attribute ``JITFunction.cache_hook``; 3.4 on: ``triton.knobs.runtime.jit_cache_hook``.
    """
    if triton_version() < (3, 4):
        from triton.runtime.jit import JITFunction as owner

        name = "cache_hook"
    else:
        from triton import knobs

        owner, name = knobs.runtime, "jit_cache_hook"
    saved = getattr(owner, name)
    setattr(owner, name, hook)
    try:
        yield
    finally:
        setattr(owner, name, saved)


class TargetDriver:
    """What ``JITFunction.run`` asks of ``triton.runtime.driver.active`` before it compiles (the
    device, its stream, its target), answered for a GPU of compute capability ``arch`` that is not
    there: no CUDA driver is loaded. Its device is a name of its own, so that Triton's per-device
    binder caches never mix it with a real GPU's."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> str:
        """The stand-in device's name (``"genolong-gpu-compile-sm90"``)."""
        return f"genolong-gpu-compile-sm{self.arch}"

    def get_current_stream(self, device: Any = None) -> int:
        """A null stream: nothing is launched."""
        return 0

    def get_current_target(self) -> Any:
        """``GPUTarget("cuda", arch, 32)``."""
        return self.target


@contextlib.contextmanager
def active_target(arch: int) -> Iterator[None]:
    """Make :class:`TargetDriver` (``arch``) Triton's active driver for the block, then put back the
    one that was set, without creating Triton's default driver (which needs a GPU). Triton 3.3-3.4
    keep the active driver in the attribute ``active`` of ``triton.runtime.driver.driver`` (a lazy
    proxy), 3.5 on in ``_active`` (None until first use)."""
    from triton.runtime.driver import driver

    saved = vars(driver)["active" if triton_version() < (3, 5) else "_active"]
    driver.set_active(TargetDriver(arch))  # type: ignore[arg-type]
    try:
        yield
    finally:
        driver.set_active(saved)


def options_from_specialization(specialization_data: str) -> dict[str, Any]:
    """The launch's full compile options (``options.__dict__``) from the cache hook's
    ``specialization_data`` (JSON), with JSON's lists turned back into tuples, as Triton's own
    ``JITFunction.preload`` reads them (3.3 on)."""
    options = json.loads(specialization_data)["options"]
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def ptxas_command(arch: int, options: dict[str, Any], ptx: Path, cubin: Path) -> list[str]:
    """The ``ptxas -v`` command line Triton's CUDA backend runs on a kernel's PTX, for the installed
    release: its ptxas (3.3: ``get_ptxas(arch)`` returns ``(path, version)``; 3.4-3.5: ``get_ptxas()``
    with no argument returns a tool with ``.path``; 3.6 on: ``get_ptxas(arch).path``, ``ptxas-blackwell``
    for sm_100) and its flags (``-lineinfo``; ``--fmad=false`` when ``enable_fp_fusion`` is off; the
    options' ``ptx_options``, 3.4 on; ``--regAllocOptLevel=2``, 3.7 on)."""
    from triton.backends.nvidia import compiler as nv

    version = triton_version()
    if version < (3, 4):
        exe = nv.get_ptxas(arch)[0]
    elif version < (3, 6):
        exe = nv.get_ptxas().path
    else:
        exe = nv.get_ptxas(arch).path
    fmad = [] if options.get("enable_fp_fusion", True) else ["--fmad=false"]
    extra = options["ptx_options"].split(" ") if version >= (3, 4) and options.get("ptx_options") else []
    reg_alloc = ["--regAllocOptLevel=2"] if version >= (3, 7) else []
    return [
        exe,
        "-lineinfo",
        *fmad,
        "-v",
        *reg_alloc,
        *extra,
        f"--gpu-name={nv.sm_arch_from_capability(arch)}",
        str(ptx),
        "-o",
        str(cubin),
    ]


def triton_cache_dir() -> Path:
    """Triton's cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``): 3.3
    ``triton.runtime.cache.default_cache_dir()`` under the variable, 3.4 on ``triton.knobs.cache.dir``."""
    if triton_version() < (3, 4):
        from triton.runtime.cache import default_cache_dir

        return Path(os.getenv("TRITON_CACHE_DIR", "").strip() or default_cache_dir())
    from triton import knobs

    return Path(knobs.cache.dir)


@contextlib.contextmanager
def ptxas_log_on_stdout() -> Iterator[bool]:
    """Have Triton print the log of its own ``ptxas -v`` run (``knobs.nvidia.dump_ptxas_log``, 3.5
    on) for the block; yields whether it does (3.3-3.4 keep no log: the stats come from a ptxas run
    of ours, :func:`ptxas_command`)."""
    if triton_version() < (3, 5):
        yield False
        return
    from triton import knobs

    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        yield True
    finally:
        knobs.nvidia.dump_ptxas_log = saved


# ----------------------------------------------------------------------------- capture


@dataclass
class Launch:
    """One intercepted launch, bound for one target."""

    module: str
    kernel: str
    phase: str  # "fwd" / "bwd" / "fwd (autotune config i)"
    arch: int
    signature: dict[str, str]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, Any]
    options: dict[str, Any]

    def key(self) -> str:
        """A digest of everything the compile depends on: launches with the same key compile once."""
        blob = repr(
            (
                self.module,
                self.kernel,
                self.arch,
                sorted(self.signature.items()),
                sorted((k, repr(v)) for k, v in self.constexprs.items()),
                sorted((k, repr(v)) for k, v in self.attrs.items()),
                sorted((k, repr(v)) for k, v in self.options.items()),
            )
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class _Capture:
    arch: int
    phase: str = "fwd"
    launches: list[Launch] = field(default_factory=list)


@contextlib.contextmanager
def capturing(arch: int) -> Iterator[_Capture]:
    """Record every Triton launch in the block as bound for a GPU of capability ``arch``; nothing
    compiles or runs. Triton's own ``JITFunction.run`` binds each launch (against
    :class:`TargetDriver`), and its JIT cache hook (:func:`jit_cache_hook`) records what it would
    compile and stops it there. ``Autotuner.run`` becomes one launch per config."""
    from triton.runtime.autotuner import Autotuner

    cap = _Capture(arch)

    def record(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        kernel = fn.jit_function.fn
        cap.launches.append(
            Launch(
                kernel.__module__,
                kernel.__name__,
                cap.phase,
                arch,
                dict(compile["signature"]),
                dict(compile["constants"]),
                dict(compile["configs"][0]),
                options_from_specialization(compile["specialization_data"]),
            )
        )
        return True  # skip the compile and the launch

    def autotune_run(self: Any, *args: Any, **kwargs: Any) -> None:
        phase = cap.phase
        for i, config in enumerate(self.configs):
            cap.phase = f"{phase} (autotune config {i})"
            self.fn.run(*args, **{**kwargs, **config.all_kwargs()})
        cap.phase = phase

    saved = Autotuner.run
    Autotuner.run = autotune_run  # type: ignore[method-assign]
    try:
        with active_target(arch), jit_cache_hook(record):
            yield cap
    finally:
        Autotuner.run = saved  # type: ignore[method-assign]


def _dtypes(variant: str) -> dict[str, Any]:
    """The float dtype of each kernel input under a precision variant (see the module doc)."""
    import torch

    bf, f32 = torch.bfloat16, torch.float32
    if variant == "bf16":
        return dict(q=bf, latent=bf, k_idx=bf, gate=bf, ape=bf, q_idx=bf, k_pool=bf, w=f32)
    if variant == "bf16-mixed":
        return dict(q=bf, latent=f32, k_idx=f32, gate=bf, ape=f32, q_idx=bf, k_pool=f32, w=f32)
    if variant == "fp32":
        return dict(q=f32, latent=f32, k_idx=f32, gate=f32, ape=f32, q_idx=f32, k_pool=f32, w=f32)
    raise SystemExit(f"--dtypes: unknown variant {variant!r}; choose from {', '.join(DTYPES)}")


@contextlib.contextmanager
def meta_key_lists(attention: Any) -> Iterator[None]:
    """Stand-ins for the key-major backward's inverse index lists during a capture on meta tensors.

    ``triton_attention._key_lists`` and ``_segments`` sort the selected (query, key) pairs with
    data-dependent torch ops (``unique``, ``bincount``, ``repeat_interleave``) that a meta tensor
    cannot run. What the launches need of them is only their dtypes (pointer types of the
    signature) and the kernels' integer arguments, which do not depend on the data: the stand-ins
    give tensors of the real functions' dtypes (tests/kernels/test_gpu_compile.py checks them against the
    real ones) at worst-case sizes (every selected pair its own entry), and one split key tile, so
    that the reduction kernel of split tiles launches too.
    """
    import torch

    real = attention._key_lists, attention._segments

    def key_lists(indices: torch.Tensor, TK: int, q_offset: int, block_k: int) -> Any:
        B, T, K = indices.shape
        entries = B * T * K
        tiles = B * -(-TK // block_k)
        return attention._KeyLists(
            torch.empty(entries, dtype=torch.int32, device="meta"),
            torch.empty(entries, dtype=torch.int32, device="meta"),
            torch.empty(tiles, dtype=torch.int64, device="meta"),
        )

    def segments(counts: torch.Tensor, segment: int) -> Any:
        programs = torch.empty(counts.numel() + 1, dtype=torch.int64, device="meta")
        one = torch.empty(1, dtype=torch.int64, device="meta")
        return attention._Segments(programs, programs, programs, programs, 2, one, one, one)

    attention._key_lists, attention._segments = key_lists, segments
    try:
        yield
    finally:
        attention._key_lists, attention._segments = real


def _drive(cap: _Capture, function: str, fn: Callable, g: Geometry, variant: str, T: int, cp: int) -> None:
    """Call wrapper ``function`` (forward, then backward when it is differentiable) on meta tensors of
    geometry ``g`` at context ``T`` (as the last of ``cp`` context-parallel ranks when cp > 1)."""
    import torch

    dt_ = _dtypes(variant)
    meta = dict(device="meta")

    def leaf(shape: tuple[int, ...], dtype: Any, grad: bool = True) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, **meta).requires_grad_(grad)

    def backward(out: torch.Tensor) -> None:
        cap.phase = "bwd"
        out.sum().backward()
        cap.phase = "fwd"

    B, P, K = 1, g.pool, g.topk + (g.pool - 1 if g.tail else 0)
    tl_ = T // cp  # local queries of a context-parallel rank
    if function == "sparse_attention_triton":
        q = leaf((B, tl_, g.heads, g.latent), dt_["q"])
        lat = leaf((B, T, 1, g.latent), dt_["latent"])
        idx = torch.empty(B, tl_, K, dtype=torch.int64, **meta)
        with meta_key_lists(importlib.import_module(fn.__module__)):
            backward(fn(q, lat, lat, idx, scale=g.qk_head_dim**-0.5, q_offset=T - tl_))
    elif function == "kpool_keys_triton":
        k_idx, gate = leaf((B, tl_, g.idx_dim), dt_["k_idx"]), leaf((B, tl_, g.idx_dim), dt_["gate"])
        backward(fn(k_idx, gate, leaf((P, g.idx_dim), dt_["ape"])))
    elif function == "kpool_topk_triton":
        # the last context-parallel rank's queries over the pools of the whole sequence (cp 1: all)
        q_idx = leaf((B, tl_, g.idx_heads, g.idx_dim), dt_["q_idx"], False)
        k_pool = leaf((B, T // P, g.idx_dim), dt_["k_pool"], False)
        w = leaf((B, tl_, g.idx_heads), dt_["w"], False)
        fn(q_idx, k_pool, w, g.topk, P, tail=g.tail, scale=g.idx_dim**-0.5, activation="relu", q_offset=T - tl_)
    elif function == "kpool_indexer_kl_loss_triton":
        q = leaf((B, tl_, g.heads, g.latent), dt_["q"], False)
        k = leaf((B, T, 1, g.latent), dt_["latent"], False)
        q_idx = leaf((B, tl_, g.idx_heads, g.idx_dim), dt_["q_idx"])
        k_pool = leaf((B, T // P, g.idx_dim), dt_["k_pool"])
        w = leaf((B, tl_, g.idx_heads), dt_["w"])
        pools = torch.empty(B, tl_, g.topk // P, dtype=torch.int64, **meta)
        backward(
            fn(
                q,
                k,
                q_idx,
                k_pool,
                w,
                pools,
                P,
                attn_scale=g.qk_head_dim**-0.5,
                idx_scale=g.idx_dim**-0.5,
                tail=g.tail,
                q_offset=T - tl_,
            )
        )
    else:
        raise SystemExit(
            f"the triton backend routes to {function}, which this harness has no driver for: "
            "add one to benchmarks/gpu_compile.py::_drive"
        )


@contextlib.contextmanager
def _capability(torch: Any, arch: int) -> Iterator[None]:
    """``torch.cuda.get_device_capability()`` answers ``divmod(arch, 10)`` (no GPU here)."""
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: divmod(arch, 10)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


@dataclass
class Job:
    """One compile: a bound launch and every (shape, dtype, context, cp) that produced it."""

    launch: Launch
    shape: str
    dtype: str
    lengths: list[str] = field(default_factory=list)


def capture_jobs(
    shapes: list[str], dtypes: list[str], archs: tuple[int, ...], lengths: list[tuple[int, int]]
) -> tuple[list[Job], list[str]]:
    """All distinct compiles, and the names of the Triton kernels of the routed modules never launched."""
    from triton.runtime.jit import JITFunction

    jobs: dict[tuple[str, str, str], Job] = {}
    defined: set[tuple[str, str]] = set()
    wrappers = []
    for module, function in routed_wrappers():
        mod = importlib.import_module(f"genolong.kernels.dsa.{module}")
        wrappers.append((function, getattr(mod, function)))
        defined |= {(mod.__name__, n) for n, v in vars(mod).items() if isinstance(v, JITFunction)}
    launched: set[tuple[str, str]] = set()
    import torch

    for arch in archs:
        # one capture per target, the device reporting that target's capability, so that a wrapper
        # that picks its tiles per architecture is captured with the choice it makes there
        with capturing(arch) as cap, _capability(torch, arch):
            for shape in shapes:
                g = geometry(shape)
                for variant in dtypes:
                    for T, cp in lengths:
                        for c in [1] if cp == 1 else [1, cp]:
                            for function, fn in wrappers:
                                start = len(cap.launches)
                                _drive(cap, function, fn, g, variant, T, c)
                                for launch in cap.launches[start:]:
                                    launched.add((launch.module, launch.kernel))
                                    job = jobs.setdefault((launch.key(), shape, variant), Job(launch, shape, variant))
                                    tag = f"{T}" if c == 1 else f"{T}/cp{c}"
                                    if tag not in job.lengths:
                                        job.lengths.append(tag)
    unlaunched = sorted(f"{m}.{n}" for m, n in defined - launched)
    return list(jobs.values()), unlaunched


# ----------------------------------------------------------------------------- compile (worker)


def _parse_ptxas(log: str) -> dict[str, Any] | None:
    """Registers, spills and stack per thread from a ``ptxas -v`` log (None without them)."""
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None  # noqa: E731
    regs = num(r"Used (\d+) registers")
    if regs is None:
        return None
    return {
        "registers": regs,
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
        "source": "ptxas -v",
    }


def _ptxas_stats(ptx: str, arch: int, options: dict[str, Any], cache_dir: Path, log: str) -> dict[str, Any]:
    """Registers and spills per thread from the wheel's ``ptxas -v``: the log of Triton's own
    ptxas run when it compiled (``log``, Triton passes ``-v``; empty on a Triton cache hit, and always
    before 3.5), else a cached earlier result for this PTX, else a fresh ``ptxas -v`` with Triton's
    command line (:func:`ptxas_command`). Results are cached by the hash of the PTX and the Triton
    release (each release ships its own ptxas and flags)."""
    import triton

    key = hashlib.sha256(f"{triton.__version__}\n{arch}\n{ptx}".encode()).hexdigest()
    path = cache_dir / f"{key}.json"
    stats = _parse_ptxas(log)
    if stats is None and path.exists():
        return json.loads(path.read_text())
    if stats is None:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.ptx"
            src.write_text(ptx)
            cmd = ptxas_command(arch, options, src, Path(tmp) / "k.cubin")
            stats = _parse_ptxas(subprocess.run(cmd, capture_output=True, text=True, check=True).stderr)
        assert stats is not None, "ptxas -v printed no register count"
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
    tmp_path.write_text(json.dumps(stats))
    tmp_path.replace(path)
    return stats


def compile_job(launch: Launch) -> dict[str, Any]:
    """Compile one launch for its target; everything the table reports, or the error in one line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    out: dict[str, Any] = {"status": "ok", "error": None}
    try:
        fn = getattr(importlib.import_module(launch.module), launch.kernel)
        src = ASTSource(fn, launch.signature, launch.constexprs, launch.attrs)
        # Triton runs ptxas with -v; keep its log (printed to stdout) instead of running ptxas again
        log = io.StringIO()
        with ptxas_log_on_stdout(), contextlib.redirect_stdout(log):
            ck = triton.compile(src, target=GPUTarget("cuda", launch.arch, 32), options=launch.options)
    except Exception as exc:  # a compile error: the table reports it, the check fails on it
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        # Triton's CompilationError puts the source excerpt first and the message last
        msg = next((ln for ln in reversed(lines) if not ln.startswith("^")), type(exc).__name__)
        out.update(status="error", error=f"{type(exc).__name__}: {msg}"[:300])
        out["compile_s"] = round(time.perf_counter() - t0, 2)
        return out
    ptx, ttir = ck.asm["ptx"], ck.asm["ttir"]
    dots = [
        (m.group(1), (p.group(1) if (p := _PREC_RE.search(m.group(1))) else ""), m.group(2), m.group(3))
        for m in _DOT_RE.finditer(ttir)
    ]
    out["shared"] = int(ck.metadata.shared)
    out["num_warps"], out["num_stages"] = int(ck.metadata.num_warps), int(ck.metadata.num_stages)
    out["dots"] = len(dots)
    # TTIR prints inputPrecision only when it is not the default, ieee (on f32 operands: FMA, no tensor cores)
    out["dot_types"] = sorted(
        {f"{a}x{b}" + (f"/{prec or 'ieee'}" if a == b == "f32" else "") for _, prec, a, b in dots}
    )
    out["dots_fp32_ieee"] = sum(1 for _, prec, a, b in dots if a == b == "f32" and prec in ("", "ieee"))
    out["tensor_core_ops"] = {name: len(p.findall(ptx)) for name, p in _TC_PATTERNS.items() if p.search(ptx)}
    out.update(_ptxas_stats(ptx, launch.arch, launch.options, triton_cache_dir() / "genolong_ptxas", log.getvalue()))
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    return out


def _child(launch: Launch, conn: Any) -> None:
    try:
        conn.send(compile_job(launch))
    except BaseException as exc:  # noqa: BLE001 (the parent reports it as the row's error)
        conn.send({"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})
    conn.close()


def compile_all(launches: dict[str, Launch], jobs: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Compile every launch, ``jobs`` at a time, each in a forked child (this process has imported
    torch, Triton and the kernels: a fork starts in milliseconds) killed after ``timeout`` seconds:
    a kernel that takes minutes to compile stalls the first training step for as long, and is
    reported as an error."""
    ctx = get_context("fork")
    todo = list(launches.items())
    running: dict[str, tuple[Any, Any, float]] = {}
    results: dict[str, dict[str, Any]] = {}
    while todo or running:
        while todo and len(running) < jobs:
            key, launch = todo.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(launch, send), daemon=True)
            proc.start()
            send.close()
            running[key] = (proc, recv, time.perf_counter())
        for key, (proc, recv, t0) in list(running.items()):
            if recv.poll():
                try:
                    results[key] = recv.recv()
                except EOFError:
                    results[key] = {"status": "error", "error": f"compiler process died (exit {proc.exitcode})"}
            elif not proc.is_alive():
                results[key] = {"status": "error", "error": f"compiler process died (exit {proc.exitcode})"}
            elif time.perf_counter() - t0 > timeout:
                proc.kill()
                results[key] = {
                    "status": "error",
                    "error": f"compile took over {timeout:g} s (killed)",
                    "compile_s": round(time.perf_counter() - t0, 1),
                }
            else:
                continue
            proc.join()
            recv.close()
            del running[key]
        time.sleep(0.05)
    return results


# ----------------------------------------------------------------------------- checks and report


def _is16(variant: str) -> bool:
    return variant in ("bf16", "bf16-mixed")


def problems(row: dict[str, Any]) -> list[str]:
    """What fails the checks for one result row (empty when it passes)."""
    if row["status"] != "ok":
        return [f"does not compile: {row['error']}"]
    out = []
    if row["shared"] > SMEM_LIMIT:
        out.append(f"shared memory {row['shared']:,} B > {SMEM_LIMIT:,} B per block")
    budget = row["spill_budget"]
    if row["spill_stores"] is None or row["spill_stores"] > budget:
        out.append(f"spills {row['spill_stores']} B per thread > budget {budget} B")
    if _is16(row["dtype"]) and row["dots"]:
        if row["dots_fp32_ieee"]:
            out.append(
                f"{row['dots_fp32_ieee']} of {row['dots']} dots are fp32 ieee (no tensor cores) with 16-bit inputs"
            )
        if not row["tensor_core_ops"]:
            out.append("no tensor-core instruction in the PTX with 16-bit inputs")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Capture, compile (in ``args.jobs`` processes), check; returns the JSON document."""
    import triton

    archs = tuple(int(a) for a in args.archs.split(","))
    shapes = args.shapes.split(",")
    dtypes = args.dtypes.split(",")
    for a in archs:
        if a not in ARCHS:
            raise SystemExit(f"--archs: {a} is not one of {', '.join(map(str, ARCHS))}")
    lengths = [_length(s) for s in args.lengths.split(",")] if args.lengths else recipe_lengths()
    t0 = time.perf_counter()
    jobs, unlaunched = capture_jobs(shapes, dtypes, archs, lengths)
    t_capture = time.perf_counter() - t0
    if args.kernels:
        jobs = [j for j in jobs if re.search(args.kernels, j.launch.kernel)]
    # unique compiles (the same launch can serve several shapes or dtypes)
    uniq: dict[str, Launch] = {}
    for j in jobs:
        uniq.setdefault(j.launch.key(), j.launch)
    order = sorted(uniq, key=lambda k: -len(repr(uniq[k].constexprs)))  # big kernels first
    t1 = time.perf_counter()
    results = compile_all({k: uniq[k] for k in order}, args.jobs, args.timeout)
    t_compile = time.perf_counter() - t1
    rows = []
    for j in jobs:
        r = results[j.launch.key()]
        budget, why = SPILL_BUDGETS.get(j.launch.kernel, DEFAULT_SPILL_BUDGET)
        opts = j.launch.options
        row = {
            "kernel": j.launch.kernel,
            "module": j.launch.module,
            "phase": j.launch.phase,
            "shape": j.shape,
            "dtype": j.dtype,
            "arch": ARCHS[j.launch.arch],
            "lengths": j.lengths,
            "requested_num_warps": opts.get("num_warps"),
            "requested_num_stages": opts.get("num_stages"),
            "constexprs": _named_constexprs(j.launch),
            "i64_args": sorted(n for n, t in j.launch.signature.items() if t == "i64"),
            "spill_budget": budget,
            "spill_budget_reason": why,
            **r,
        }
        row["problems"] = problems(row)
        rows.append(row)
    rows.sort(
        key=lambda r: (
            r["module"],
            r["kernel"],
            r["phase"],
            SHAPES.index(r["shape"]) if r["shape"] in SHAPES else 9,
            r["dtype"],
            r["arch"],
            r["lengths"],
        )
    )
    return {
        "benchmark": "gpu_compile",
        **environment("date"),
        "triton": triton.__version__,
        "smem_limit": SMEM_LIMIT,
        "archs": [ARCHS[a] for a in archs],
        "shapes": {s: geometry(s).__dict__ for s in shapes},
        "dtypes": dtypes,
        "lengths": [f"{T}" if cp == 1 else f"{T} (cp {cp})" for T, cp in lengths],
        "routed_wrappers": [f"{m}.{f}" for m, f in routed_wrappers()],
        "kernels_never_launched": unlaunched,
        "spill_budgets": {k: {"bytes": b, "reason": w} for k, (b, w) in SPILL_BUDGETS.items()},
        "default_spill_budget": {"bytes": DEFAULT_SPILL_BUDGET[0], "reason": DEFAULT_SPILL_BUDGET[1]},
        "unique_compiles": len(uniq),
        "capture_s": round(t_capture, 2),
        "compile_s": round(t_compile, 2),
        "jobs": args.jobs,
        "rows": rows,
        "failures": sum(1 for r in rows if r["problems"]),
    }


def _length(text: str) -> tuple[int, int]:
    """``"131072"`` -> (131072, 1); ``"1048576/8"`` -> (1048576, 8)."""
    try:
        T, _, cp = text.partition("/")
        return int(T), int(cp or 1)
    except ValueError:
        raise SystemExit(f"--lengths: {text!r} is not CONTEXT or CONTEXT/CP") from None


def _plain(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str)) or v is None else repr(v)


def _named_constexprs(launch: Launch) -> dict[str, Any]:
    names = list(launch.signature)
    return {
        names[k[0]] if len(k) == 1 else str(k): _plain(v)
        for k, v in launch.constexprs.items()
        if launch.signature.get(names[k[0]]) == "constexpr" and not names[k[0]].startswith("stride")
    }


def print_table(doc: dict[str, Any]) -> None:
    """The table: one line per (kernel, phase, shape, dtype, arch, signature)."""
    hdr = (
        f"{'kernel [phase]':42} {'shape':13} {'dtype':10} {'arch':6} {'warps':>5} {'smem B':>8} {'regs':>4} "
        f"{'spill':>6} {'tensor cores':14} {'lengths':24} result"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in doc["rows"]:
        lab = f"{r['kernel']} [{r['phase']}]"
        lengths = ",".join(r["lengths"])
        if r["status"] != "ok":
            print(
                f"{lab:42} {r['shape']:13} {r['dtype']:10} {r['arch']:6} {r['requested_num_warps']:>5} {'-':>8} "
                f"{'-':>4} {'-':>6} {'-':14} {lengths[:24]:24} FAIL {r['error']}"
            )
            continue
        tc = ("+".join(f"{k}" for k in r["tensor_core_ops"]) or "none") if r["dots"] else "(no dots)"
        if r["dots_fp32_ieee"]:
            tc += f" {r['dots_fp32_ieee']}xfp32"
        res = "ok" if not r["problems"] else "FAIL " + "; ".join(r["problems"])
        print(
            f"{lab:42} {r['shape']:13} {r['dtype']:10} {r['arch']:6} {r['num_warps']:>5} {r['shared']:>8,} "
            f"{r['registers']:>4} {r['spill_stores']:>6} {tc:14} {lengths[:24]:24} {res}"
        )
    print(
        f"\n{len(doc['rows'])} rows, {doc['unique_compiles']} distinct compiles; capture {doc['capture_s']} s, "
        f"compile {doc['compile_s']} s ({doc['jobs']} processes); {doc['failures']} rows fail the checks"
    )
    if doc["kernels_never_launched"]:
        print("Triton kernels of the routed modules never launched: " + ", ".join(doc["kernels_never_launched"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help="model presets (default: %(default)s)")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES), help=f"of {', '.join(DTYPES)} (default: %(default)s)")
    p.add_argument("--archs", default="90,100", help="compute capabilities (default: %(default)s)")
    p.add_argument("--lengths", default=None, help="CONTEXT[/CP],... (default: those of recipes/*.yaml)")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="compile processes")
    p.add_argument(
        "--timeout",
        type=float,
        default=240.0,
        help="seconds per compile before it counts as an error (default: %(default)s)",
    )
    p.add_argument("--kernels", default=None, help="only compile kernels whose name matches this regex")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="output (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="exit 1 when a row fails the checks")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit(
            "gpu_compile.py compiles for GPUs: unset TRITON_INTERPRET (the interpreter replaces the kernels)"
        )
    doc = run(args)
    print_table(doc)
    write_json(args.json, doc, allow_nan=False)
    print(f"wrote {args.json}")
    return 1 if (args.check and doc["failures"]) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every Triton kernel the ``triton`` backend launches compiles for sm_90 and sm_100 at real shapes.

Runs ``benchmarks/gpu_compile.py`` in a child process without ``TRITON_INTERPRET`` (the
interpreter, which tests/conftest.py turns on for this session, would replace the kernels it
compiles): the wrappers' launches at the ``1b`` and GLM-5.3-Flash shapes and the recipes' context
lengths, in bf16 and under bf16-mixed, compiled down to PTX and ptxas for both targets. It fails on
any compile error, shared memory over 232,448 B per block, spills over the kernel's budget
(``SPILL_BUDGETS`` in the script, with the reasons) and dots off the tensor cores with 16-bit inputs.
Compiles are cached in Triton's own cache directory (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), so a warm run takes seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_compile.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_compile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_and_sm100_within_limits(tmp_path: Path) -> None:
    out = tmp_path / "gpu_compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), "--jobs", jobs, "--timeout", "150"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=1800,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    doc = json.loads(out.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    rows = doc["rows"]
    gc = _load_script()
    # coverage: every routed wrapper's kernels, both targets, both shapes, both dtypes, and the
    # longest recipe length (1M tokens)
    assert doc["kernels_never_launched"] == [], doc["kernels_never_launched"]
    modules = {r["module"].rsplit(".", 1)[-1] for r in rows}
    assert modules == {m for m, _ in gc.routed_wrappers()}, modules
    for kernel in {r["kernel"] for r in rows}:
        combos = {(r["shape"], r["dtype"], r["arch"]) for r in rows if r["kernel"] == kernel}
        assert len(combos) == len(gc.SHAPES) * len(gc.DEFAULT_DTYPES) * len(gc.ARCHS), (kernel, sorted(combos))
    assert any("1048576" in r["lengths"] for r in rows)
    # integers are typed by their value at the length: a GLM-5.3-Flash query at 1M tokens has a
    # batch stride of 2**35 elements (i64), at 1,024 tokens of 2**25 (i32)
    attn = [r for r in rows if r["kernel"] == "_sparse_attn_fwd_kernel" and r["shape"] == "glm-5.3-flash"]
    assert attn and all("stride_qb" in r["i64_args"] for r in attn if "1048576" in r["lengths"])
    assert all("stride_qb" not in r["i64_args"] for r in attn if "1024" in r["lengths"])
    failures = [
        f"{r['kernel']} [{r['phase']}] {r['shape']} {r['dtype']} {r['arch']} ({','.join(r['lengths'])}): "
        + "; ".join(r["problems"])
        for r in rows
        if r["problems"]
    ]
    assert not failures, f"{len(failures)} of {len(rows)} kernel builds fail:\n" + "\n".join(failures)


# Run in a child without TRITON_INTERPRET (under the interpreter, @triton.jit makes no JITFunction):
# capture one small launch of the installed Triton, check that the harness put Triton's driver and
# JIT cache hook back, compile it for sm_90 in a fresh Triton cache (so Triton runs ptxas itself), and
# run the harness's own ptxas command on the same PTX.
_ONE_KERNEL = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import gpu_compile as gc
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver

def hook_now():
    if gc.triton_version() < (3, 4):
        return triton.runtime.jit.JITFunction.cache_hook
    return triton.knobs.runtime.jit_cache_hook

before = (dict(vars(driver)), hook_now())
jobs, _ = gc.capture_jobs(["1b"], ["bf16"], (90,), [(1024, 1)])
launch = next(j.launch for j in jobs if j.launch.kernel == "_kpool_fwd_kernel")
row = gc.compile_job(launch)
fn = getattr(__import__(launch.module, fromlist=["x"]), launch.kernel)
ck = triton.compile(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs),
                    target=GPUTarget("cuda", 90, 32), options=launch.options)
ours = gc._ptxas_stats(ck.asm["ptx"], 90, launch.options, Path(tempfile.mkdtemp()), "")
print(json.dumps({"restored": before == (dict(vars(driver)), hook_now()), "launch": {
    "arch": launch.arch, "signature": launch.signature, "options": {k: repr(v) for k, v in launch.options.items()}},
    "row": row, "ours": ours, "triton": triton.__version__}))
"""


@pytest.mark.slow
def test_one_launch_is_captured_and_compiled_on_the_installed_triton(tmp_path: Path) -> None:
    """The version-specific parts (:func:`capturing`'s driver and cache hook, the options read back,
    the ptxas command line, Triton's cache directory) on the installed Triton: the ``1b`` K-pool
    forward at 1,024 tokens is bound for sm_90 with bf16 pointers and the wrapper's ``num_warps``,
    the driver and hook are put back, it compiles, and the harness's ``ptxas -v`` of its PTX gives
    the registers and spills that Triton's own ptxas run gave (3.5 on: Triton's log; 3.3-3.4 keep
    none, so both come from the harness's command)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_KERNEL, str(SCRIPT.parent)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["restored"], doc
    launch, row, ours = doc["launch"], doc["row"], doc["ours"]
    assert launch["arch"] == 90
    assert {"*bf16", "constexpr"} <= set(launch["signature"].values()), launch["signature"]
    assert launch["options"]["num_warps"] == "4" and launch["options"]["num_stages"] == "3", launch["options"]
    assert row["status"] == "ok", row
    assert isinstance(row["registers"], int) and row["registers"] > 0, row
    assert (ours["registers"], ours["spill_stores"], ours["spill_loads"]) == (
        row["registers"],
        row["spill_stores"],
        row["spill_loads"],
    ), (doc["triton"], ours, row)


def test_the_checks_catch_each_kind_of_failure() -> None:
    """``problems`` flags a compile error, shared memory over the limit, spills over the budget and
    fp32 IEEE dots (or no tensor-core instruction) with 16-bit inputs; a clean row passes."""
    gc = _load_script()
    ok = {
        "status": "ok",
        "error": None,
        "shared": 100_000,
        "spill_stores": 0,
        "spill_budget": 0,
        "dtype": "bf16",
        "dots": 2,
        "dots_fp32_ieee": 0,
        "tensor_core_ops": {"wgmma": 4},
    }
    assert gc.problems(ok) == []
    assert gc.problems({**ok, "dtype": "fp32", "dots_fp32_ieee": 2, "tensor_core_ops": {}}) == []  # fp32 meant
    assert "does not compile" in gc.problems({**ok, "status": "error", "error": "CompilationError: x"})[0]
    assert "shared memory 295,424 B > 232,448 B" in gc.problems({**ok, "shared": 295_424})[0]
    assert "spills 8 B per thread > budget 0 B" in gc.problems({**ok, "spill_stores": 8})[0]
    assert "fp32 ieee" in gc.problems({**ok, "dtype": "bf16-mixed", "dots_fp32_ieee": 1})[0]
    assert "no tensor-core instruction" in gc.problems({**ok, "tensor_core_ops": {}})[0]
    assert gc.problems({**ok, "dots": 0, "tensor_core_ops": {}}) == []  # no dots: nothing to check


def test_meta_key_lists_stand_ins_have_the_real_dtypes() -> None:
    """The capture's stand-ins for the key-major backward's inverse index lists (meta tensors cannot
    run ``unique``/``bincount``) carry the dtypes of the real ``_key_lists`` / ``_segments`` (they
    become the kernel's pointer types), checked on real indices with a split key tile."""
    import torch

    from genolong.kernels.dsa import triton_attention as attention

    gc = _load_script()
    indices = torch.tensor([[[0, 3, -1], [1, 2, 0], [4, 1, 2]]])  # [B=1, T=3, K=3]
    real_lists = attention._key_lists(indices, 5, 2, 4)
    real_segments = attention._segments(real_lists.counts, 1)  # a segment per entry: tiles split
    assert real_segments.n_slots > 0 and real_segments.red_tile.numel() > 0
    with gc.meta_key_lists(attention):
        stand_lists = attention._key_lists(indices.to("meta"), 5, 2, 4)
        stand_segments = attention._segments(stand_lists.counts, 1)
    assert attention._key_lists.__name__ == "_key_lists"  # put back
    for real, stand in ((real_lists, stand_lists), (real_segments, stand_segments)):
        for name, value in real._asdict().items():
            other = getattr(stand, name)
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and other.device.type == "meta", name
            else:
                assert isinstance(other, int) and other > 0, name

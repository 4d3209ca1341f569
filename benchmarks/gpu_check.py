#!/usr/bin/env python
"""One-shot GPU check (issue 7): kernel correctness, DSA vs dense attention, and the ``1b`` preset.

Four parts, each in a process of its own (``--in-process`` runs them in one), in this order:
``dsa_correctness``, ``dsa``, ``model`` and, last, ``kda`` (fla-core: fla-org/flash-linear-attention#734
reports a kernel crash on H100 with triton 3.6.0, and a crash or a sticky CUDA error in one process
cannot spoil another's figures). Each part has its own time budget (:data:`PART_BUDGET_S`, 420 s in
all) and its process is killed at it; a failure, crash or kill is recorded under ``errors`` in the
JSON and the next part still runs. The JSON is rewritten atomically after every part (each part's
own ``<out>.<part>.json`` after every measurement), so a killed run keeps what it had. It records
the versions (python, torch, its CUDA, triton, fla-core, numpy, transformers), the GPU, and for each
part the backend, what implements each op (``backend_impls``) and what the dispatching ops really
ran (``dispatch``). A missing fla-core is an error of the ``kda`` part, never a torch fallback.

The parts (the names of the old three-part layout are the JSON keys):

(a) ``correctness`` (parts ``dsa_correctness`` and ``kda``): bf16 outputs and gradients of the fast ops against a float32 reference at
    ``T = 32k`` (the RMS-ratio criterion, ``RMS(ref - x) / RMS(ref)``, of
    :func:`genolong.kernels.testing.rms_ratio`):

    - DSA sparse attention: ``genolong.kernels.dsa.triton_attention.sparse_attention_triton`` (the
      op the ``triton`` backend routes to) on the ``1b`` preset's absorbed-MLA shapes as
      ``DSAMixer`` calls it (12 query heads over one shared ``kv_lora_rank``-wide latent passed as
      both k and v, ``v is k``, so its gradient is ``dK + dV``; top-k ``index_topk + index_kpool -
      1`` random causal positions per query), against the torch
      :func:`~genolong.kernels.dsa.sparse_attention` in float32 on the same (bf16-rounded) inputs;
      also with bf16 queries and an fp32 latent (what ``bf16-mixed`` autocast with fp32 master
      weights passes: the latent comes out of an RMSNorm in fp32);
    - KDA: the fla backend (:mod:`genolong.kernels.kda.fla_backend`, fla-core's ``chunk_kda`` in
      bf16) against genolong's torch :func:`~genolong.kernels.kda.chunk_kda` in float32 with an
      initial state (``1b`` geometry: 12 heads x 128, lower-bound gate ``-5 sigmoid``), also with
      float32 inputs (what the KDA layer passes) and in the gated form (gate and beta computed in
      fla's kernel from their raw inputs), with forward+backward times;

    the bf16 torch reference's own ratios are recorded beside them, as the yardstick for bf16.
(b) ``dsa_vs_sdpa``: forward+backward time of one DSA layer of the ``1b`` preset (``DSAMixer``, the
    first full-indexer layer, bf16, top-k 2048, backend ``--backend``) against dense causal
    ``scaled_dot_product_attention`` (flash) on ``[1, 12, T, 128]`` q/k/v, at 32k and 128k; the
    SDPA figure is the attention core only (no projections), so the ratio favours SDPA.
    Target (issue 7): ``sdpa_ms / dsa_ms >= 4`` at 128k.
(c) ``model``: tokens/s and peak device memory of one training step (``GenoLM.loss`` forward +
    backward, bf16 weights, batch 1) of the ``1b`` preset with ``parallelize(recompute="full")``,
    with and without activation offload, at 32k and 128k. Target: 128k fits in one H200 with
    recompute + offload.

``--small`` runs every part at tiny sizes (``tiny`` preset, T of a few hundred) on the machine's
device (CPU here, torch backend; on CPU the KDA candidate is the fla adapter bound to fla's pure-torch
``naive_recurrent_kda`` and the DSA candidate the Triton op in Triton's interpreter when
``TRITON_INTERPRET=1`` is set, as the test suite sets it, and the interpreter can run with the
installed triton and numpy, else the bf16 torch reference, with the reason under ``notes``) in about
a minute: it checks the script, not the kernels. What would start after a part's budget (80 % of it
inside the part) is skipped and recorded as skipped.

Example::

    bash benchmarks/gpu_check.sh "$OUT"                                # on the GPU: see the script (8 min)
    python benchmarks/gpu_check.py --out $OUT/gpu_check.json           # the same, genolong importable
    python benchmarks/gpu_check.py --small --out /tmp/gpu_check.json    # CPU smoke run

Prints a summary and writes JSON (default ``$OUT/gpu_check.json``, else
``benchmarks/results/gpu_check.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

GiB = 2**30


class Check:
    """The JSON document being filled, written atomically after every update."""

    def __init__(self, path: Path, budget_s: float):
        self.path = path
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.doc: dict[str, Any] = {"errors": {}, "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self, what: str) -> bool:
        """True (and ``what`` recorded as skipped) when the time budget is spent."""
        if self.elapsed() > self.budget_s:
            self.doc["skipped"].append(f"{what}: time budget {self.budget_s:.0f} s spent")
            self.write()
            return True
        return False

    def write(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 2)
        backends = sys.modules.get("genolong.kernels.backends")
        if backends is not None and "backend" in self.doc.get("meta", {}):
            # what the dispatching ops ran so far: kept even if this process is killed later
            self.doc["meta"]["dispatch"] = backends.dispatch_counts()
        # strict JSON: a NaN or infinite figure (a diverged kernel) is written as a string
        write_json(self.path, _finite(self.doc), indent=2, default=str, allow_nan=False)

    def guard(self, key: str, fn: Callable[[], None]) -> None:
        """Run ``fn``; an exception is recorded as ``errors[key]`` (type, message, last frames)."""
        try:
            fn()
        except Exception as exc:  # one failing part must not stop the others
            self.doc["errors"][key] = f"{type(exc).__name__}: {exc}"[:2000]
            self.doc.setdefault("tracebacks", {})[key] = traceback.format_exc()[-4000:]
            print(f"[gpu_check] {key} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.write()


# ------------------------------------------------------------------------------------------------
# helpers


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its name (``"nan"``, ``"inf"``, ``"-inf"``),
    so that the document is strict JSON (``json.dumps(allow_nan=False)``) and still says what ran."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: bool = True) -> dict[str, Any]:
    """Run ``fn`` once to warm up (unless ``warmup`` is False), then ``repeats`` times; median and
    all times in ms, peak device bytes of the timed runs (None off CUDA)."""
    if warmup:
        fn()
    _sync(device)
    _reset_peak(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"ms": round(times[len(times) // 2], 3), "all_ms": [round(t, 3) for t in times], "peak_bytes": _peak(device)}


def causal_random_indices(T: int, topk: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``[1, T, topk]`` int32 key positions: query ``t`` selects ``t - off`` for ``topk`` distinct
    offsets (0 and random others in ``[0, 4 topk)``), ``-1`` where that is before position 0."""
    gen = torch.Generator().manual_seed(seed)
    span = max(4 * topk, topk + 1)
    off = torch.randperm(span - 1, generator=gen)[: topk - 1] + 1
    off = torch.cat([torch.zeros(1, dtype=torch.long), off.sort().values])  # [topk]
    idx = torch.arange(T).unsqueeze(1) - off.unsqueeze(0)  # [T, topk]
    idx = torch.where(idx >= 0, idx, torch.full_like(idx, -1))
    return idx.to(torch.int32).unsqueeze(0).to(device)


def _grads(out: torch.Tensor, dout: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, dout))


def _ratios(ref: list[torch.Tensor], got: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    from genolong.kernels.testing import rms_ratio

    return {name: rms_ratio(r, g) for name, r, g in zip(names, ref, got)}


# ------------------------------------------------------------------------------------------------
# (a) correctness


def _interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run genolong's kernels here, or None.

    Triton 3.6's interpreter converts 1-element arrays with ``int()``, which numpy 2.4 turned into a
    TypeError ("only 0-dimensional arrays can be converted to Python scalars"); with numpy 2.3.5 the
    interpreter tests pass at triton 3.6.0, and triton 3.7 works with numpy 2.4+. The kernels are not
    at fault, and on a GPU the interpreter is not used, so the CPU check says so instead of failing.
    """
    from importlib import metadata

    try:
        triton_v, numpy_v = metadata.version("triton"), metadata.version("numpy")
    except metadata.PackageNotFoundError:
        return None

    def major_minor(v: str) -> tuple[int, int]:
        parts = [int("".join(ch for ch in x if ch.isdigit()) or 0) for x in v.split(".")[:2]]
        return parts[0], parts[1] if len(parts) > 1 else 0

    if major_minor(triton_v) < (3, 7) and major_minor(numpy_v) >= (2, 4):
        return (
            f"triton {triton_v}'s interpreter cannot run with numpy {numpy_v} (int() of a 1-element array; "
            "numpy < 2.4 or triton >= 3.7 needed): the Triton op is not checked on CPU here"
        )
    return None


def check_dsa_correctness(c: Check, a: argparse.Namespace, device: torch.device) -> None:
    from genolong.kernels.dsa import sparse_attention
    from genolong.kernels.dsa.triton_attention import sparse_attention_triton  # what the triton backend routes to
    from genolong.model import PRESETS

    cfg = PRESETS[a.preset]
    T, H, C = a.correct_T, cfg.num_attention_heads, cfg.kv_lora_rank
    topk = cfg.index_topk + cfg.index_kpool - 1
    res: dict[str, Any] = {
        "T": T,
        "heads": H,
        "latent_dim": C,
        "topk": topk,
        "form": "absorbed MLA: v is k (the latent)",
    }
    c.doc.setdefault("correctness", {})["dsa_sparse_attention"] = res
    # the Triton op on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1, as the test
    # suite sets it: the same call at tiny sizes); else the bf16 torch reference (script check only)
    # (in fp16 there: the interpreter's bf16 is broken), else the bf16 torch reference (script check only)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    broken = _interpreter_problem() if interpreted and device.type != "cuda" else None
    half = torch.bfloat16
    if broken:
        interpreted = False
        res["interpreter_skipped"] = broken
        c.doc.setdefault("notes", []).append(f"correctness.dsa: {broken}")
    if device.type == "cuda" or interpreted:
        candidate = sparse_attention_triton
        res["impl"] = "genolong.kernels.dsa.triton_attention.sparse_attention_triton"
        if device.type != "cuda":
            half = torch.float16
            res["impl"] += " in Triton's CPU interpreter, fp16 (script check only)"
    else:
        candidate, res["impl"] = sparse_attention, "torch reference in bf16 (no CUDA: script check only)"
        if broken:
            res["impl"] += "; Triton's interpreter not run (interpreter_skipped)"
    res["half_dtype"] = str(half).removeprefix("torch.")
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = (torch.randn(1, T, H, C, generator=gen) * 0.5).to(device, half)
    latent = torch.randn(1, T, 1, C, generator=gen).to(device, half)
    dout = torch.randn(1, T, H, C, generator=gen).to(device, half)
    idx = causal_random_indices(T, topk, device)
    scale = (cfg.qk_head_dim) ** -0.5

    def run(fn: Callable, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        # fresh leaves each run; the latent is passed as both k and v, as DSAMixer's absorbed form
        # does (sparse_attention(q, latent, latent, ...)): its gradient is dK + dV
        qq = q.detach().to(q_dtype).clone().requires_grad_(True)
        kv = latent.detach().to(kv_dtype or q_dtype).clone().requires_grad_(True)
        o = fn(qq, kv, kv, idx, scale=scale)
        return [o.detach().float()] + [g.float() for g in _grads(o, dout.to(o.dtype), [qq, kv])]

    names = ["o", "dq", "dkv"]
    ref = run(sparse_attention, torch.float32)
    res["rms_ratio"] = _ratios(ref, run(candidate, half), names)
    res["torch_half_rms_ratio"] = _ratios(ref, run(sparse_attention, half), names)
    # bf16-mixed autocast with fp32 master weights: 16-bit queries, the fp32 latent of the RMSNorm
    res["mixed_rms_ratio"] = _ratios(ref, run(candidate, half, torch.float32), names)
    res["finite"] = all(bool(torch.isfinite(x).all()) for x in ref)
    print(
        f"[gpu_check] DSA sparse attention T={T} (v is k, {res['half_dtype']}): {res['rms_ratio']}; 16-bit q + fp32 latent: "
        f"{res['mixed_rms_ratio']}",
        flush=True,
    )


def check_kda_correctness(c: Check, a: argparse.Namespace, device: torch.device) -> None:
    from genolong.kernels.kda import chunk_kda
    from genolong.kernels.kda.fla_backend import fla_version, make_fla_chunk_kda
    from genolong.model import PRESETS
    from genolong.model.kda import l2_normalize

    cfg = PRESETS[a.preset]
    T, H, K = a.correct_T, cfg.linear_num_heads, cfg.linear_head_dim
    res: dict[str, Any] = {"T": T, "heads": H, "head_dim": K, "fla_core": fla_version()}
    c.doc.setdefault("correctness", {})["kda_fla"] = res
    if res["fla_core"] is None:
        # never a silent torch fallback: without fla-core this part has nothing to check
        raise RuntimeError(
            "fla-core is not importable here (no fla-core distribution on sys.path): this part checks "
            "fla-core's chunk_kda; put its wheel beside the checkout (bash benchmarks/gpu_wheels.sh, "
            "carry .gpu-wheels) or pip install 'fla-core>=0.5.2'"
        )
    from fla.ops.kda.naive import naive_recurrent_kda  # pure torch (imports fla, hence Triton)

    if device.type == "cuda":
        candidate = make_fla_chunk_kda(kernel_dtype=torch.bfloat16)
        as_layer = make_fla_chunk_kda()  # what the KDA layer runs: float32 q, k, v in the kernel
        res["impl"] = "fla-core chunk_kda via genolong adapter (q, k, v, beta bf16; g, state fp32)"
    else:

        def naive(*, chunk_size: int, **kw: Any) -> Any:  # fla's naive op takes no chunk_size
            return naive_recurrent_kda(**kw)

        candidate = make_fla_chunk_kda(kernel=naive, kernel_dtype=torch.bfloat16)
        as_layer = make_fla_chunk_kda(kernel=naive)
        res["impl"] = "fla adapter bound to fla naive_recurrent_kda (no CUDA: script check only)"
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = l2_normalize(torch.randn(1, T, H, K, generator=gen)).to(device)
    k = l2_normalize(torch.randn(1, T, H, K, generator=gen)).to(device)
    v = torch.randn(1, T, H, K, generator=gen).to(device)
    g = (-5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen) - 3.0)).to(device)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen)).to(device)
    h0 = (0.1 * torch.randn(1, H, K, K, generator=gen)).to(device)
    dout = torch.randn(1, T, H, K, generator=gen).to(device)
    dht = torch.randn(1, H, K, K, generator=gen).to(device)
    # bf16-rounded inputs for every run, so the ratios measure the kernels, not the input rounding
    q, k, v, beta = (x.to(torch.bfloat16).float() for x in (q, k, v, beta))

    def run(fn: Callable, dtype: torch.dtype) -> list[torch.Tensor]:
        xs = [x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
        gg, bb, hh = (
            x.detach().to(dt).clone().requires_grad_(True)
            for x, dt in ((g, torch.float32), (beta, dtype), (h0, torch.float32))
        )
        o, ht = fn(*xs, gg, bb, initial_state=hh, output_final_state=True)
        loss = (o.float() * dout).sum() + (ht.float() * dht).sum()
        grads = torch.autograd.grad(loss, [*xs, gg, bb, hh])
        return [o.detach().float(), ht.detach().float()] + [x.float() for x in grads]

    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    ref = run(chunk_kda, torch.float32)
    res["rms_ratio"] = _ratios(ref, run(candidate, torch.bfloat16), names)
    res["torch_bf16_rms_ratio"] = _ratios(ref, run(chunk_kda, torch.bfloat16), names)
    print(f"[gpu_check] KDA fla T={T}: {res['rms_ratio']}", flush=True)
    c.write()
    # the KDA layer hands the op float32 q, k, v, g, beta: the same kernel on float32 inputs
    res["fp32_inputs_rms_ratio"] = _ratios(ref, run(as_layer, torch.float32), names)
    print(f"[gpu_check] KDA fla (fp32 inputs, as the layer calls it) T={T}: {res['fp32_inputs_rms_ratio']}", flush=True)
    c.write()
    # forward+backward time of one call (bf16 candidate vs the float32 torch reference)
    res["fwd_bwd_ms"] = {
        "candidate_bf16": _timed(lambda: run(candidate, torch.bfloat16), device, 2)["ms"],
        "candidate_fp32": _timed(lambda: run(as_layer, torch.float32), device, 2)["ms"],
        "torch_fp32": _timed(lambda: run(chunk_kda, torch.float32), device, 1)["ms"],
    }

    # the gated op: gate and beta from their raw inputs, in fla's kernel (the layer's lower-bound gate)
    from genolong.kernels.kda.fla_backend import make_fla_chunk_kda_gated, reference_chunk_kda_gated

    gres: dict[str, Any] = {"T": T, "lower_bound": -5.0}
    c.doc["correctness"]["kda_fla_gated"] = gres
    if device.type == "cuda":
        gated = make_fla_chunk_kda_gated(kernel_dtype=torch.bfloat16)
        gres["impl"] = "fla-core chunk_kda, use_gate_in_kernel + use_beta_sigmoid_in_kernel + safe_gate"
    else:
        from fla.ops.kda.gate import naive_kda_lowerbound_gate

        def naive_gated(
            *,
            chunk_size: int,
            use_gate_in_kernel: bool,
            use_beta_sigmoid_in_kernel: bool,
            A_log: torch.Tensor,
            dt_bias: torch.Tensor,
            lower_bound: float,
            safe_gate: bool,
            **kw: Any,
        ) -> Any:
            kw["g"] = naive_kda_lowerbound_gate(kw["g"], A_log, dt_bias, lower_bound)
            kw["beta"] = torch.sigmoid(kw["beta"])
            return naive_recurrent_kda(**kw)

        gated = make_fla_chunk_kda_gated(kernel=naive_gated, kernel_dtype=torch.bfloat16)
        gres["impl"] = "gated fla adapter bound to fla's naive gate + naive_recurrent_kda (no CUDA: script check only)"
    g_raw = torch.randn(1, T, H, K, generator=gen).to(device)
    beta_logits = torch.randn(1, T, H, generator=gen).to(device)
    A_log = torch.zeros(H, device=device)
    dt_bias = (0.1 * torch.randn(H * K, generator=gen)).to(device)

    def run_gated(fn: Callable, dtype: torch.dtype) -> list[torch.Tensor]:
        xs = [x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
        rest = [x.detach().clone().requires_grad_(True) for x in (g_raw, beta_logits, A_log, dt_bias, h0)]
        o, ht = fn(*xs, *rest[:4], lower_bound=-5.0, initial_state=rest[4], output_final_state=True)
        loss = (o.float() * dout).sum() + (ht.float() * dht).sum()
        grads = torch.autograd.grad(loss, [*xs, *rest])
        return [o.detach().float(), ht.detach().float()] + [x.float() for x in grads]

    gnames = ["o", "ht", "dq", "dk", "dv", "dg_raw", "dbeta_logits", "dA_log", "ddt_bias", "dh0"]
    gref = run_gated(reference_chunk_kda_gated, torch.float32)
    gres["rms_ratio"] = _ratios(gref, run_gated(gated, torch.bfloat16), gnames)
    gres["fwd_bwd_ms"] = {"candidate_bf16": _timed(lambda: run_gated(gated, torch.bfloat16), device, 2)["ms"]}
    print(f"[gpu_check] KDA fla gated T={T}: {gres['rms_ratio']}", flush=True)


# ------------------------------------------------------------------------------------------------
# (b) DSA layer vs dense causal SDPA


def bench_dsa_vs_sdpa(c: Check, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    from genolong.model import PRESETS, DSAMixer
    from genolong.model.config import INDEXED_ATTENTION

    cfg = PRESETS[a.preset].replace(kernel_backend=a.backend)
    if not a.small:
        cfg = cfg.replace(index_topk=2048)
    layer_idx = next(
        i
        for i, (lt, it) in enumerate(zip(cfg.layer_types, cfg.indexer_types))
        if lt == INDEXED_ATTENTION and it == "full"
    )
    torch.manual_seed(0)
    with torch.device(device):
        mixer = DSAMixer(cfg, layer_idx).to(dtype)
    rows: list[dict[str, Any]] = []
    c.doc["dsa_vs_sdpa"] = {
        "preset": a.preset,
        "layer": layer_idx,
        "topk": cfg.index_topk,
        "backend": mixer.kernels.name,
        "dtype": str(dtype),
        "rows": rows,
    }
    H, D = cfg.num_attention_heads, cfg.qk_nope_head_dim
    for T in a.dsa_lengths:
        if c.over_budget(f"dsa_vs_sdpa T={T}"):
            return
        row: dict[str, Any] = {"T": T}
        rows.append(row)

        def dsa_step() -> None:
            x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
            out, _ = mixer(x)
            out.backward(torch.ones_like(out))

        def sdpa_step() -> None:
            q, k, v = (torch.randn(1, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        for name, fn in (("dsa", dsa_step), ("sdpa", sdpa_step)):
            try:
                row[name] = _timed(fn, device, a.repeats)
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            c.write()
        if "ms" in row.get("dsa", {}) and "ms" in row.get("sdpa", {}):
            row["sdpa_over_dsa"] = round(row["sdpa"]["ms"] / row["dsa"]["ms"], 3)
        print(f"[gpu_check] DSA vs SDPA T={T}: {row}", flush=True)
        c.write()


# ------------------------------------------------------------------------------------------------
# (c) the 1b preset: tokens/s and peak memory


def bench_model(c: Check, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    from genolong.model import PRESETS, GenoLM
    from genolong.parallel import parallelize

    if a.model_preset not in PRESETS:
        raise KeyError(f"preset {a.model_preset!r} not in genolong.model.PRESETS ({', '.join(PRESETS)})")
    cfg = PRESETS[a.model_preset].replace(kernel_backend=a.backend)
    rows: list[dict[str, Any]] = []
    c.doc["model"] = {
        "preset": a.model_preset,
        "backend": a.backend,
        "dtype": str(dtype),
        "recompute": "full",
        "rows": rows,
    }
    for offload in (True, False):  # the target configuration (recompute + offload) first
        if c.over_budget(f"model offload={offload}"):
            return
        torch.manual_seed(0)
        with torch.device(device):
            model = GenoLM(cfg).to(dtype)
        model = parallelize(model, recompute="full", offload=offload)
        c.doc["model"]["parameters"] = sum(p.numel() for p in model.parameters())
        try:
            # one short warm-up step per model (Triton autotuning, allocator, pinned host pool);
            # the long steps are timed once each, cold for their length
            warm = torch.randint(1, 5, (1, min(a.model_lengths[0], 4096)), generator=torch.Generator().manual_seed(0))
            nll, weight = model.loss(warm.to(device))
            (nll / weight).backward()
            model.zero_grad(set_to_none=True)
            for T in a.model_lengths:
                if c.over_budget(f"model T={T} offload={offload}"):
                    return
                row: dict[str, Any] = {"T": T, "offload": offload}
                rows.append(row)
                tokens = torch.randint(1, 5, (1, T), generator=torch.Generator().manual_seed(T)).to(device)

                def step() -> None:
                    model.zero_grad(set_to_none=True)
                    nll, weight = model.loss(tokens)
                    (nll / weight).backward()
                    row["loss"] = float((nll / weight).detach())

                try:
                    timing = _timed(step, device, 1, warmup=False)
                    row.update(
                        seconds=timing["ms"] / 1e3,
                        tokens_per_s=round(T / (timing["ms"] / 1e3), 1),
                        peak_bytes=timing["peak_bytes"],
                        peak_gib=None if timing["peak_bytes"] is None else round(timing["peak_bytes"] / GiB, 2),
                    )
                except Exception as exc:  # e.g. out of memory at 128k without offload
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                print(f"[gpu_check] model {a.model_preset} T={T} offload={offload}: {row}", flush=True)
                c.write()
        finally:
            model = None  # type: ignore[assignment]  # free it before the next configuration
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# The parts, in the order they run: genolong's own DSA first, then the model, the fla-core KDA part
# last (fla-org/flash-linear-attention#734 reports a kernel crash on H100 with triton 3.6.0; in a
# process of its own, a crash or a sticky CUDA error there cannot spoil the others' figures).
PART_ORDER = ("dsa_correctness", "dsa", "model", "kda")
PART_KEYS = {"dsa_correctness": "correctness.dsa", "dsa": "dsa_vs_sdpa", "model": "model", "kda": "correctness.kda"}
PART_ALIASES = {"correctness": ("dsa_correctness", "kda")}
# Wall-clock seconds of each part's process on an H100/H200 at full sizes, start-up (torch import,
# CUDA context), Triton compilation and fla's autotuning included: 60 + 90 + 150 + 120 = 420 s, the
# default --budget-s; gpu_check.sh allows 470 s for the Python run and spends ~10 s around it
# (nvidia-smi, unpacking the wheels), so the whole check ends within 8 minutes. A part's process is
# killed at its budget; inside it, no new measurement starts after 80 % of it (SOFT_FRACTION).
PART_BUDGET_S = {"dsa_correctness": 60.0, "dsa": 90.0, "model": 150.0, "kda": 120.0}
SMALL_PART_BUDGET_S = 240.0  # --small on a busy 2-core CPU: a hang guard, not a target
SOFT_FRACTION = 0.8


def _parts(text: str) -> list[str]:
    """``--parts`` as part names in run order (``correctness`` stands for both correctness parts)."""
    wanted: set[str] = set()
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name not in PART_ORDER and name not in PART_ALIASES:
            raise argparse.ArgumentTypeError(
                f"unknown part {name!r}; choose from {', '.join((*PART_ORDER, *PART_ALIASES))}"
            )
        wanted.update(PART_ALIASES.get(name, (name,)))
    return [name for name in PART_ORDER if name in wanted]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default=None, help="JSON path (default $OUT/gpu_check.json or benchmarks/results)")
    p.add_argument("--out", dest="out_opt", default=None, help="JSON path (same as the positional argument)")
    p.add_argument(
        "--small", "--dry-run", action="store_true", help="tiny sizes on any device (script check, < 1 min on CPU)"
    )
    p.add_argument("--backend", default="auto", help="kernel backend for parts dsa and model (default auto)")
    p.add_argument(
        "--parts",
        type=_parts,
        default=list(PART_ORDER),
        help=f"comma list of {', '.join(PART_ORDER)} (correctness: both correctness parts); "
        "they always run in that order",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="total seconds; each part gets its own budget within it (default 420)",
    )
    p.add_argument(
        "--part-budgets",
        default="",
        help="per-part budgets in seconds, e.g. 'model=200,kda=90' (default "
        + ", ".join(f"{k}={v:.0f}" for k, v in PART_BUDGET_S.items())
        + f"; small: {SMALL_PART_BUDGET_S:.0f} each)",
    )
    p.add_argument(
        "--in-process", action="store_true", help="run the parts in this process (default: one process per part)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one part, run by the parent process
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per DSA/SDPA point (default 3; small 1)")
    p.add_argument(
        "--correct-T", type=int, default=None, help="length of the correctness parts (default 32768; small 200)"
    )
    p.add_argument("--dsa-lengths", type=_lengths, default=None, help="part dsa lengths (default 32768,131072)")
    p.add_argument("--model-lengths", type=_lengths, default=None, help="part model lengths (default 32768,131072)")
    p.add_argument("--model-preset", default=None, help="part model preset (default 1b; small: tiny)")
    p.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="parts dsa and model (default auto: bf16 on CUDA, fp32 elsewhere)",
    )
    a = p.parse_args(argv)
    small = a.small
    a.preset = "tiny" if small else "1b"
    a.model_preset = a.model_preset or a.preset
    a.repeats = a.repeats or (1 if small else 3)
    a.correct_T = a.correct_T or (200 if small else 32768)
    a.dsa_lengths = a.dsa_lengths or ([256, 512] if small else [32768, 131072])
    a.model_lengths = a.model_lengths or ([128, 256] if small else [32768, 131072])
    out = a.out_opt or a.out
    if out is None:
        out = (
            Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else HERE / "results" / "gpu_check.json"
        )
    a.out = Path(out)
    budgets = dict.fromkeys(PART_ORDER, SMALL_PART_BUDGET_S) if small else dict(PART_BUDGET_S)
    for item in (x for x in a.part_budgets.split(",") if x):
        name, _, value = item.partition("=")
        if name not in budgets:
            p.error(f"--part-budgets: unknown part {name!r}; choose from {', '.join(PART_ORDER)}")
        budgets[name] = float(value)
    a.part_budget_s = budgets
    return a


def _versions() -> dict[str, Any]:
    """Versions of what the check runs on, read without initialising CUDA (distribution metadata
    where there is one): python, torch (and its CUDA), triton, fla-core, numpy, transformers."""
    from importlib import metadata

    from genolong.kernels.kda.fla_backend import fla_version

    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": dist("triton"),
        "fla_core": fla_version(),
        "numpy": dist("numpy"),
        "transformers": dist("transformers"),
        "einops": dist("einops"),
    }


def _device_meta(cuda: bool) -> dict[str, Any]:
    """The device a part ran on (its name, memory and compute capability on CUDA)."""
    if not cuda:
        return {"device": "cpu", "device_name": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(0)
    return {
        "device": "cuda",
        "device_name": torch.cuda.get_device_name(0),
        "device_memory_gib": round(props.total_memory / GiB, 1),
        "capability": f"sm_{props.major}{props.minor}",
    }


def _run_parts_here(c: Check, a: argparse.Namespace, parts: list[str]) -> None:
    """Run ``parts`` in this process, each guarded (``--in-process``, and a child's one part)."""
    cuda = torch.cuda.is_available() and not a.small
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(a.dtype, torch.bfloat16 if cuda else torch.float32)
    if not cuda:
        a.backend = "torch"  # the CPU check runs the reference backend
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    from genolong.kernels.backends import get_backend

    meta = c.doc.setdefault("meta", {})
    meta.update(_device_meta(cuda), small=a.small)
    try:
        backend = get_backend(a.backend)
        meta["backend"] = a.backend = backend.name
        meta["backend_impls"] = dict(backend.impls)
    except Exception as exc:
        c.doc["errors"]["backend"] = f"{type(exc).__name__}: {exc}"
        meta["backend"] = a.backend = "torch"
        meta["backend_impls"] = dict(get_backend("torch").impls)
    c.write()
    run = {
        "dsa_correctness": lambda: check_dsa_correctness(c, a, device),
        "kda": lambda: check_kda_correctness(c, a, device),
        "dsa": lambda: bench_dsa_vs_sdpa(c, a, device, dtype),
        "model": lambda: bench_model(c, a, device, dtype),
    }
    for part in parts:
        c.guard(PART_KEYS[part], run[part])  # writes the document, with the dispatch counts so far


def _describe_exit(rc: int | None, timed_out: bool, budget_s: float) -> str:
    if timed_out:
        return f"killed at its {budget_s:.0f} s budget"
    if rc is not None and rc < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _run_child(cmd: list[str], budget_s: float) -> tuple[int | None, bool, str, float]:
    """Run one part's process, its output passed through line by line, killed at ``budget_s``.
    Returns (exit code, timed out, its last output lines, seconds)."""
    import collections
    import subprocess
    import threading

    t0 = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=15)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    return proc.returncode, timed_out, "\n".join(tail), time.perf_counter() - t0


def _child_command(a: argparse.Namespace, part: str, out: Path, soft_budget_s: float) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        part,
        "--out",
        str(out),
        "--budget-s",
        f"{soft_budget_s:.1f}",
        "--backend",
        a.backend,
        "--repeats",
        str(a.repeats),
        "--correct-T",
        str(a.correct_T),
        "--dsa-lengths",
        ",".join(map(str, a.dsa_lengths)),
        "--model-lengths",
        ",".join(map(str, a.model_lengths)),
        "--model-preset",
        a.model_preset,
        "--dtype",
        a.dtype,
    ]
    return cmd + (["--small"] if a.small else [])


def _merge_part(c: Check, part: str, child: dict[str, Any]) -> dict[str, Any]:
    """Fold one part's document into the check's; returns the part's own meta."""
    for key, value in child.items():
        if key == "correctness":
            c.doc.setdefault("correctness", {}).update(value)
        elif key == "errors":
            c.doc["errors"].update(value)
        elif key == "tracebacks":
            c.doc.setdefault("tracebacks", {}).update(value)
        elif key == "skipped":
            c.doc["skipped"].extend(value)
        elif key not in ("meta", "elapsed_s", "done"):
            c.doc[key] = value
    return child.get("meta", {})


def run_isolated(c: Check, a: argparse.Namespace) -> None:
    """Each part in a process of its own, in :data:`PART_ORDER`, within its budget; the JSON is
    rewritten after every part (and the part's own JSON after each of its measurements)."""
    parts_doc: dict[str, Any] = c.doc.setdefault("parts", {})
    for part in a.parts:
        key = PART_KEYS[part]
        remaining = a.budget_s - c.elapsed()
        budget = min(a.part_budget_s[part], remaining)
        if remaining < 5:  # not even a start-up's worth left
            c.doc["skipped"].append(f"{key}: time budget {a.budget_s:.0f} s spent")
            parts_doc[part] = {"status": "skipped", "budget_s": 0}
            c.write()
            continue
        part_out = c.path.with_name(f"{c.path.stem}.{part}.json")
        part_out.unlink(missing_ok=True)
        print(f"[gpu_check] part {part} ({key}): budget {budget:.0f} s", flush=True)
        rc, timed_out, tail, seconds = _run_child(_child_command(a, part, part_out, SOFT_FRACTION * budget), budget)
        record: dict[str, Any] = {"budget_s": round(budget, 1), "seconds": round(seconds, 1), "exit": rc}
        child: dict[str, Any] = {}
        if part_out.exists():
            import json

            try:
                child = json.loads(part_out.read_text())
            except ValueError:
                child = {}
        meta = _merge_part(c, part, child)
        # the backend's fields only where a backend runs the ops (the correctness parts name their op in "impl")
        fields = ("device", "device_name") + (
            ("backend", "backend_impls", "dispatch") if part in ("dsa", "model") else ()
        )
        record.update({k: meta[k] for k in fields if k in meta})
        ok = rc == 0 and not timed_out and child.get("done") is True
        record["status"] = "ok" if ok and key not in c.doc["errors"] else ("error" if ok else "crashed")
        if not ok:
            how = _describe_exit(rc, timed_out, budget)
            c.doc["errors"].setdefault(key, f"part process {how} after {seconds:.0f} s; last output:\n{tail}"[-2000:])
            if timed_out:
                record["status"] = "timed out"
        parts_doc[part] = record
        lifted = ("device", "device_name", "device_memory_gib", "capability")
        for field_ in lifted + (("backend", "backend_impls") if part in ("dsa", "model") else ()):
            if field_ in meta:
                c.doc["meta"].setdefault(field_, meta[field_])
        c.write()


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    c = Check(a.out, a.budget_s)
    import genolong

    c.doc["meta"] = {
        **environment("date"),
        "command": " ".join([sys.executable, *sys.argv]),
        "small": a.small,
        "genolong": getattr(genolong, "__version__", None),
        "genolong_from": str(Path(genolong.__file__).parent),
        **_versions(),
        "requested_backend": a.backend,
        "isolated": not (a.in_process or a.child),
        "parts": a.parts,
        "part_budget_s": a.part_budget_s,
    }
    c.write()
    if a.child:
        _run_parts_here(c, a, [a.child])
    elif a.in_process:
        _run_parts_here(c, a, a.parts)
    else:
        print(f"[gpu_check] {c.doc['meta']}", flush=True)
        run_isolated(c, a)
    c.doc["done"] = True
    c.write()
    if not a.child:
        print(
            f"[gpu_check] wrote {a.out} in {c.elapsed():.1f} s; errors: {list(c.doc['errors']) or 'none'}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

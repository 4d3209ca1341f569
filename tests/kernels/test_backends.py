"""Kernel backend choice (torch / fla / triton / auto), the fla-core KDA adapter, and the GPU check script.

fla's Triton kernels cannot run on a CPU machine, so the adapter's conversions (dtypes, state,
scale, chunk size, return conventions) are checked with the adapter bound to fla's pure-torch
``naive_recurrent_kda`` / ``naive_chunk_kda`` through a shim that also checks every keyword the
adapter passes against the real ``fla.ops.kda.chunk_kda`` signature and the dtypes fla requires.
"""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import fla.ops.kda as fla_kda  # a test dependency (pyproject [test]); imports Triton, runs on CPU
import pytest
import torch
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from genolong.errors import InputError
from genolong.kernels import backends
from genolong.kernels.backends import available_backends, get_backend, resolve_auto
from genolong.kernels.kda import chunk_kda, fla_backend
from genolong.kernels.kda.fla_backend import (
    check_fla_version,
    kda_gate,
    load_fla_kernel,
    make_fla_chunk_kda,
    make_fla_chunk_kda_gated,
    reference_chunk_kda_gated,
)
from genolong.kernels.testing import rms_ratio
from tests.helpers import assert_bitwise_equal

# same ops on the same values compared bit for bit (the gate, the CPU fall-through of the GPU
# backends): one torch thread, so a reduction is never split differently (issue 13)
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
TRITON_MODULE = "genolong.kernels.dsa.triton_attention"
TOPK_MODULE = "genolong.kernels.dsa.triton_topk"
KPOOL_MODULE = "genolong.kernels.dsa.triton_kpool"
FLA_PARAMS = inspect.signature(fla_kda.chunk_kda).parameters


class _Shim:
    """A fla-style kernel that runs one of fla's naive ops and records what the adapter passed."""

    def __init__(self, naive: Any, takes_chunk_size: bool):
        self.naive, self.takes_chunk_size = naive, takes_chunk_size
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kw: Any) -> Any:
        # every keyword must be one fla's chunk_kda takes (chunk_size, A_log and dt_bias go
        # through its **kwargs)
        assert set(kw) <= set(FLA_PARAMS) | {"chunk_size", "A_log", "dt_bias"}, set(kw) - set(FLA_PARAMS)
        assert kw["chunk_size"] in fla_backend.FLA_CHUNK_SIZES
        assert kw["g"].dtype == torch.float32
        assert kw["q"].dtype == kw["k"].dtype == kw["v"].dtype
        assert all(kw[n].is_contiguous() for n in ("q", "k", "v", "g", "beta"))
        if kw["initial_state"] is not None:  # fla asserts a float32 state
            assert kw["initial_state"].dtype == torch.float32
        self.calls.append({n: (x.dtype if isinstance(x, torch.Tensor) else x) for n, x in kw.items()})
        if not self.takes_chunk_size:
            kw.pop("chunk_size")
        if kw.pop("use_gate_in_kernel", False):
            # what fla's kernel does in-kernel, by fla's own torch gate references
            A_log, dt_bias, lower_bound = kw.pop("A_log"), kw.pop("dt_bias"), kw.pop("lower_bound")
            assert kw.pop("safe_gate") == (lower_bound is not None)
            if lower_bound is None:
                kw["g"] = naive_kda_gate(kw["g"], A_log, dt_bias)
            else:
                kw["g"] = naive_kda_lowerbound_gate(kw["g"], A_log, dt_bias, lower_bound)
        if kw.pop("use_beta_sigmoid_in_kernel", False):
            kw["beta"] = torch.sigmoid(kw["beta"])
        return self.naive(**kw)


def _inputs(
    B: int, T: int, H: int, K: int, V: int, seed: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) - 2.0)  # the lower-bound gate
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = 0.5 * torch.randn(B, H, K, V, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [h0]


def _run(fn: Any, xs: list[torch.Tensor], dout: torch.Tensor, dht: torch.Tensor, **kw: Any) -> list[torch.Tensor]:
    """Outputs and gradients (w.r.t. q, k, v, g, beta, h0) of a KDA op with ``chunk_kda``'s signature."""
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    loss = (o.float() * dout).sum() + (ht * dht).sum()
    return [o.detach(), ht.detach()] + list(torch.autograd.grad(loss, leaves))


NAMES = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


@pytest.mark.parametrize("T, V, chunk_size, scale", [(63, 16, 64, None), (150, 24, 16, 0.3)])
def test_fla_adapter_matches_torch_chunk_kda(T: int, V: int, chunk_size: int, scale: float | None) -> None:
    """Forward and backward of the adapter over fla's naive recurrent op equal genolong's chunk_kda
    (fp32, odd lengths, V != K, an initial state and the final state, default and explicit scale,
    a chunk size fla lacks (16 -> 64))."""
    B, H, K = 2, 3, 16
    xs = _inputs(B, T, H, K, V, seed=T)
    gen = torch.Generator().manual_seed(1)
    dout, dht = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    shim = _Shim(naive_recurrent_kda, takes_chunk_size=False)
    adapter = make_fla_chunk_kda(kernel=shim)
    ref = _run(chunk_kda, xs, dout, dht, scale=scale, chunk_size=chunk_size)
    got = _run(adapter, xs, dout, dht, scale=scale, chunk_size=chunk_size)
    ratios = {n: rms_ratio(r, x) for n, r, x in zip(NAMES, ref, got)}
    assert max(ratios.values()) < 1e-5, ratios
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    (call,) = shim.calls
    assert call["scale"] == (K**-0.5 if scale is None else scale)
    assert call["chunk_size"] == 64 and call["output_final_state"] is True
    # the adapter does not ask fla for in-kernel gate / beta / l2norm: the layer applied them
    assert not any(call.get(n) for n in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "use_qk_l2norm_in_kernel"))


def test_fla_adapter_chunk_form_and_no_state() -> None:
    """The adapter over fla's naive *chunk* op (T a multiple of 64, no initial state, chunk 32)."""
    B, T, H, K, V = 1, 128, 2, 16, 16
    q, k, v, g, beta, _ = _inputs(B, T, H, K, V, seed=3)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    shim = _Shim(naive_chunk_kda, takes_chunk_size=True)
    o, ht = make_fla_chunk_kda(kernel=shim)(*leaves, chunk_size=32)
    assert ht is None and shim.calls[0]["chunk_size"] == 32 and shim.calls[0]["initial_state"] is None
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    ref, _ = chunk_kda(*ref_leaves)
    dout = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((o * dout).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * dout).sum(), ref_leaves)
    assert rms_ratio(ref, o) < 1e-5
    for name, r, x in zip(["dq", "dk", "dv", "dg", "dbeta"], ref_grads, grads):
        assert rms_ratio(r, x) < 1e-5, name


def test_fla_adapter_dtypes_and_edges() -> None:
    """bf16 inputs: the kernel gets one q/k/v dtype, float32 g and state; o comes back in v's dtype
    and the state in float32; kernel_dtype overrides; T = 0 never calls the kernel; float64 and
    a head dim fla lacks are refused with one line."""
    B, T, H, K, V = 1, 33, 2, 16, 8
    q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, seed=5)
    shim = _Shim(naive_recurrent_kda, takes_chunk_size=False)
    adapter = make_fla_chunk_kda(kernel=shim)
    o, ht = adapter(
        q.bfloat16(),
        k.bfloat16(),
        v.bfloat16(),
        g,
        beta.bfloat16(),
        initial_state=h0.bfloat16(),
        output_final_state=True,
    )
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert (
        shim.calls[-1]["q"] == shim.calls[-1]["v"] == torch.bfloat16
        and shim.calls[-1]["initial_state"] == torch.float32
    )
    ref, ref_ht = chunk_kda(
        q.bfloat16(),
        k.bfloat16(),
        v.bfloat16(),
        g,
        beta.bfloat16(),
        initial_state=h0.bfloat16(),
        output_final_state=True,
    )
    assert rms_ratio(ref, o) < 1e-2 and rms_ratio(ref_ht, ht) < 1e-5
    o16, _ = make_fla_chunk_kda(kernel=shim, kernel_dtype=torch.bfloat16)(q, k, v, g, beta)
    assert (
        shim.calls[-1]["q"] == torch.bfloat16
        and shim.calls[-1]["beta"] == torch.bfloat16
        and o16.dtype == torch.float32
    )
    n_calls = len(shim.calls)
    o0, ht0 = adapter(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], initial_state=h0, output_final_state=True)
    assert len(shim.calls) == n_calls and o0.shape == (B, 0, H, V) and torch.equal(ht0, h0)  # exact: 0 + h0
    with pytest.raises(InputError, match="no float64 kernels") as err:
        adapter(q.double(), k.double(), v.double(), g.double(), beta.double())
    assert "\n" not in str(err.value)
    big = torch.zeros(1, 4, 1, 300)
    with pytest.raises(InputError, match="key head dims up to 256"):
        adapter(big, big, big, big, torch.zeros(1, 4, 1))
    with pytest.raises(ValueError, match="chunk_size"):
        adapter(q, k, v, g, beta, chunk_size=48)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fla_gated_adapter_gate_and_beta_in_kernel(lower_bound: float | None) -> None:
    """The gated adapter (fla computes the gate and beta in the kernel) equals the torch reference,
    forward and backward, including the gradients of A_log and dt_bias (fp32, T = 77)."""
    B, T, H, K, V = 2, 77, 2, 8, 12
    q, k, v, _, _, h0 = _inputs(B, T, H, K, V, seed=11)
    gen = torch.Generator().manual_seed(12)
    g_raw, beta_logits = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, generator=gen)
    A_log = (torch.rand(H, generator=gen) * 2.0).log1p() if lower_bound is None else torch.zeros(H)
    dt_bias = 0.1 * torch.randn(H * K, generator=gen)
    dout, dht = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    shim = _Shim(naive_recurrent_kda, takes_chunk_size=False)

    def run(fn: Any) -> list[torch.Tensor]:
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g_raw, beta_logits, A_log, dt_bias, h0)]
        o, ht = fn(*leaves[:7], lower_bound=lower_bound, initial_state=leaves[7], output_final_state=True)
        loss = (o * dout).sum() + (ht * dht).sum()
        return [o.detach(), ht.detach()] + list(torch.autograd.grad(loss, leaves))

    ref, got = run(reference_chunk_kda_gated), run(make_fla_chunk_kda_gated(kernel=shim))
    names = ["o", "ht", "dq", "dk", "dv", "dg_raw", "dbeta_logits", "dA_log", "ddt_bias", "dh0"]
    ratios = {n: rms_ratio(r, x) for n, r, x in zip(names, ref, got)}
    # dA_log and ddt_bias are sums over all B * T tokens of terms that largely cancel: measured
    # against a float64 run, genolong's float32 chunked reference is 7e-6 / 1.6e-5 off here and
    # the adapter over fla's naive op 3e-7 / 1.5e-7, so the bound is float32 rounding
    assert max(r for n, r in ratios.items() if n not in ("dA_log", "ddt_bias")) < 1e-5, ratios
    assert max(ratios["dA_log"], ratios["ddt_bias"]) < 1e-4, ratios
    (call,) = shim.calls
    assert call["use_gate_in_kernel"] and call["use_beta_sigmoid_in_kernel"] and call["beta"] == torch.float32
    with pytest.raises(InputError, match=r"A_log must be \[H\]"):
        make_fla_chunk_kda_gated(kernel=shim)(q, k, v, g_raw, beta_logits, A_log[:1], dt_bias)


def test_fla_adapters_take_bf16_qkv_under_autocast() -> None:
    """In a bf16-mixed forward (autocast on for the tensors' device) both adapters hand fla bf16
    q, k, v (its fast path; the KDA layer passes fp32), the gate, A_log, dt_bias, the beta logits
    and the state in fp32, and return o in v's dtype; outside autocast fp32 stays fp32. The
    result is the fp32 reference's up to the bf16 rounding of q, k, v (2^-8 per element)."""
    B, T, H, K, V = 1, 40, 2, 16, 8
    q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, seed=21)
    gen = torch.Generator().manual_seed(22)
    g_raw, beta_logits = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, generator=gen)
    A_log, dt_bias = torch.zeros(H), 0.1 * torch.randn(H * K, generator=gen)
    shim = _Shim(naive_recurrent_kda, takes_chunk_size=False)
    plain, gated = make_fla_chunk_kda(kernel=shim), make_fla_chunk_kda_gated(kernel=shim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, ht = plain(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o_gated, _ = gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound=-5.0)
    first, second = shim.calls
    assert first["q"] == first["k"] == first["v"] == first["beta"] == torch.bfloat16
    assert first["g"] == first["initial_state"] == torch.float32
    assert second["q"] == second["k"] == second["v"] == torch.bfloat16
    assert second["g"] == second["beta"] == second["A_log"] == second["dt_bias"] == torch.float32
    assert o.dtype == o_gated.dtype == ht.dtype == torch.float32
    ref, ref_ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rms_ratio(ref, o) < 1e-2 and rms_ratio(ref_ht, ht) < 1e-2
    ref_gated, _ = reference_chunk_kda_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound=-5.0)
    assert rms_ratio(ref_gated, o_gated) < 1e-2
    plain(q, k, v, g, beta)
    assert shim.calls[-1]["q"] == torch.float32  # no autocast: the inputs' own dtype


def test_kda_gate_is_the_layer_gate() -> None:
    """kda_gate(raw projection) equals the KDA layer's ForgetGate bit for bit, with and without a lower bound."""
    from genolong.model import PRESETS
    from genolong.model.kda import ForgetGate

    for lower_bound in (-5.0, None):
        config = PRESETS["tiny"].replace(linear_lower_bound=lower_bound)
        torch.manual_seed(0)
        gate = ForgetGate(config)
        x = torch.randn(2, 9, config.hidden_size)
        raw = gate.f_b_proj(gate.f_a_proj(x)).view(2, 9, gate.num_heads, gate.head_dim)
        assert_bitwise_equal(
            kda_gate(raw, gate.A_log, gate.dt_bias, lower_bound),
            gate(x),
            f"kda_gate against ForgetGate (lower bound {lower_bound})",
        )  # same ops, same bits


def test_adapters_pass_fla_argument_checks() -> None:
    """Bound to fla's real ``chunk_kda``, both adapters get through fla's Python-level checks
    (shapes, float32 state, chunk size, A_log / lower_bound / safe_gate rules): the call fails
    only inside Triton, which has no driver for CPU tensors."""
    import traceback

    q, k, v, g, beta, h0 = _inputs(1, 70, 2, 16, 16, seed=0)
    calls = [
        lambda: make_fla_chunk_kda(kernel=fla_kda.chunk_kda)(
            q, k, v, g, beta.bfloat16(), initial_state=h0.bfloat16(), output_final_state=True, chunk_size=16
        ),
        lambda: make_fla_chunk_kda_gated(kernel=fla_kda.chunk_kda)(
            q, k, v, g, beta, torch.zeros(2), torch.zeros(32), lower_bound=-5.0, initial_state=h0
        ),
        lambda: make_fla_chunk_kda_gated(kernel=fla_kda.chunk_kda)(q, k, v, g, beta, torch.zeros(2), torch.zeros(32)),
    ]
    for call in calls:
        with pytest.raises(Exception) as err:
            call()
        frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(err.value.__traceback__)]
        assert any("/triton/" in f for f in frames), (type(err.value).__name__, str(err.value)[:200], frames[-3:])


def test_fla_version_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla-core >= 0.5.2 is enforced (its CP backward was wrong before); the installed one passes."""
    for ok in ("0.5.2", "0.6.0", "0.5.2.dev3+g1a2b", "1.0"):
        check_fla_version(ok)
    for old in ("0.5.1", "0.4.9", "0.5.1.post1"):
        with pytest.raises(InputError, match=r"fla-core>=0\.5\.2"):
            check_fla_version(old)
    kernel = load_fla_kernel()
    assert kernel is fla_kda.chunk_kda
    # the default kernel refuses CPU tensors with a clear line instead of a Triton driver error
    q, k, v, g, beta, _ = _inputs(1, 5, 1, 8, 8, seed=0)
    with pytest.raises(InputError, match="CUDA tensors only"):
        make_fla_chunk_kda()(q, k, v, g, beta)
    monkeypatch.setattr(fla_backend, "fla_version", lambda: "0.5.1")
    with pytest.raises(InputError, match="too old"):
        load_fla_kernel()
    monkeypatch.setattr(fla_backend, "fla_version", lambda: None)
    with pytest.raises(ImportError, match="fla-core is not installed"):
        load_fla_kernel()


# ------------------------------------------------------------------------------------------------
# the registry


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No backend loaded yet (so loading and its log line happen inside the test)."""
    monkeypatch.setattr(backends, "_LOADED", {})


def _fake_triton_module(calls: list[dict[str, Any]]) -> types.ModuleType:
    module = types.ModuleType(TRITON_MODULE)

    def sparse_attention_triton(q, k, v, indices, scale=None):
        calls.append({"scale": scale})
        return q.new_zeros(q.shape[:3] + (v.shape[-1],))

    module.sparse_attention_triton = sparse_attention_triton  # type: ignore[attr-defined]
    return module


def _fake_topk_module(calls: list[dict[str, Any]]) -> types.ModuleType:
    module = types.ModuleType(TOPK_MODULE)

    def kpool_topk_triton(q_idx, k_pool, w_idx, topk, pool_size, **kwargs):
        calls.append({"topk": topk})
        return q_idx.new_zeros(q_idx.shape[:2] + (topk,), dtype=torch.long)

    module.kpool_topk_triton = kpool_topk_triton  # type: ignore[attr-defined]
    return module


def test_registry_names_and_auto_on_cpu(fresh_registry: None, caplog: pytest.LogCaptureFixture) -> None:
    """All four names are registered; on this CPU machine auto is torch, logged once with both
    names; the GPU backends refuse to load without CUDA, in one line."""
    assert set(available_backends()) >= {"torch", "fla", "triton", "auto"}
    with caplog.at_level(logging.INFO, logger="genolong"):
        backend = get_backend("auto")
        assert get_backend("auto") is backend
    assert not torch.cuda.is_available()
    assert resolve_auto() == "torch" and backend.name == "torch" and backend is get_backend("torch")
    assert caplog.text.count("kernel backend 'auto' resolved to 'torch'") == 1
    for name in ("fla", "triton"):
        with pytest.raises(InputError, match=f"kernel backend '{name}' needs CUDA") as err:
            get_backend(name)
        assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="unknown kernel backend 'cuda-magic'"):
        get_backend("cuda-magic")


def test_auto_resolves_to_gpu_backends(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With CUDA reported and the packages importable, auto picks triton (DSA from the Triton
    module, KDA from fla); without the Triton module it refuses in one line naming the fix (fla
    still loads when asked for by name). CPU tensors still run the torch reference ops in the GPU
    backends."""
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, TRITON_MODULE, _fake_triton_module(calls))
    monkeypatch.setitem(sys.modules, TOPK_MODULE, _fake_topk_module(calls))
    kpool = types.ModuleType(KPOOL_MODULE)
    kpool.kpool_keys_triton = kpool.kpool_indexer_kl_loss_triton = lambda *a, **k: calls.append({})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, KPOOL_MODULE, kpool)
    with caplog.at_level(logging.INFO, logger="genolong"):
        auto = get_backend("auto")
    assert auto.name == "triton" and "resolved to 'triton'" in caplog.text
    assert "fla-core Triton chunk_kda" in auto.description and "Triton DSA kernels" in auto.description
    torch_ops = get_backend("torch")
    assert auto.recurrent_kda is torch_ops.recurrent_kda and auto.kpool_topk is not torch_ops.kpool_topk
    assert (
        auto.kpool_keys is not torch_ops.kpool_keys
        and auto.kpool_indexer_kl_loss is not torch_ops.kpool_indexer_kl_loss
    )
    k_idx = torch.randn(1, 10, 4)
    ape = torch.zeros(4, 4)
    assert_bitwise_equal(auto.kpool_keys(k_idx, k_idx, ape), torch_ops.kpool_keys(k_idx, k_idx, ape), "kpool_keys")
    qi, kp = torch.randn(1, 16, 2, 4), torch.randn(1, 4, 4)
    assert torch.equal(auto.kpool_topk(qi, kp, None, 8, 4), torch_ops.kpool_topk(qi, kp, None, 8, 4))  # exact: indices
    # CPU tensors: the dispatching ops fall through to the torch reference
    q, k, v, g, beta, _ = _inputs(1, 20, 2, 8, 8, seed=9)
    assert_bitwise_equal(auto.chunk_kda(q, k, v, g, beta)[0], chunk_kda(q, k, v, g, beta)[0], "chunk_kda")
    qa, ka = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 1, 4)
    idx = torch.arange(6).view(1, 6, 1).expand(1, 6, 2).contiguous()
    assert_bitwise_equal(
        auto.sparse_attention(qa, ka, ka, idx), torch_ops.sparse_attention(qa, ka, ka, idx), "sparse_attention"
    )
    assert calls == []

    monkeypatch.setattr(backends, "_LOADED", {})
    monkeypatch.setitem(sys.modules, TRITON_MODULE, None)  # the Triton module cannot be imported
    with pytest.raises(InputError, match=r"triton_attention.*pip install 'genolong\[gpu\]'") as err:
        get_backend("auto")
    assert "\n" not in str(err.value)
    fla_ops = get_backend("fla")
    assert fla_ops.sparse_attention is torch_ops.sparse_attention and fla_ops.chunk_kda is not torch_ops.chunk_kda


def test_gpu_backend_load_failures_are_one_line(fresh_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton module that fails to import (missing, or a multi-line driver error) makes 'triton'
    fail with one InputError line naming the cause; triton without fla uses the torch KDA."""
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, TRITON_MODULE, None)
    with pytest.raises(InputError, match=r"kernel backend 'triton' cannot load here \(.*triton_attention") as err:
        get_backend("triton")
    assert "\n" not in str(err.value)

    class Broken(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("0 active drivers ([]). There should only be one.\nsecond line")

    monkeypatch.setitem(sys.modules, TRITON_MODULE, Broken(TRITON_MODULE))
    with pytest.raises(InputError, match="RuntimeError: 0 active drivers") as err:
        get_backend("triton")
    assert "\n" not in str(err.value) and "second line" not in str(err.value)

    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, TRITON_MODULE, _fake_triton_module(calls))
    monkeypatch.setattr(fla_backend, "fla_version", lambda: "0.5.0")  # too old: KDA falls back
    backend = get_backend("triton")
    assert backend.chunk_kda is get_backend("torch").chunk_kda and "fla-core unavailable" in backend.description
    # the backend is called 'triton', but what runs KDA is recorded as the torch reference
    assert backend.impls["chunk_kda"] == backend.impls["chunk_kda_gated"] == "torch"
    assert backend.impls["sparse_attention"] == backend.impls["kpool_topk"] == "genolong-triton"
    assert set(backend.impls) == set(backends.OPS) and set(get_backend("torch").impls.values()) == {"torch"}


def test_triton_sparse_attention_has_the_reference_signature() -> None:
    """The backend hands the Triton kernel to the layers as is: it must take exactly the torch
    reference's arguments (q_offset for context parallelism, query_block, scale)."""
    import inspect

    from genolong.kernels.dsa import sparse_attention
    from genolong.kernels.dsa.triton_attention import sparse_attention_triton

    assert inspect.signature(sparse_attention_triton) == inspect.signature(sparse_attention)


def test_on_cuda_dispatch() -> None:
    """The dispatching op sends CUDA tensors to the fast op and others to the reference."""

    class FakeCuda:
        is_cuda = True

    before = backends.dispatch_counts().get("probe_op", {})
    op = backends._on_cuda(lambda x: "fast", lambda x: "reference", "probe_op", "genolong-triton")
    assert op(FakeCuda()) == "fast" and op(torch.zeros(1)) == "reference" and op(x=torch.zeros(1)) == "reference"
    # each call is counted under what ran it
    after = backends.dispatch_counts()["probe_op"]
    assert after["genolong-triton"] - before.get("genolong-triton", 0) == 1
    assert after["torch"] - before.get("torch", 0) == 2


# ------------------------------------------------------------------------------------------------
# the GPU check script, at tiny sizes on CPU


def _fake_wheel(folder: Path, dist: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel (a zip file: one module and its dist-info)."""
    import zipfile

    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{module}.py", "VALUE = 1\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def test_gpu_check_small_runs_on_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.sh`` in CPU mode (``gpu_check.py --small``, one process per part) runs
    every part and writes the JSON fields, importing genolong from the checkout through its
    temporary symlinked package (not this session's install), with the wheels folder's wheels
    unzipped unless installed, and removes its temporary folder."""
    import os

    out_dir, wheels, scratch = tmp_path / "out", tmp_path / "wheels", tmp_path / "tmp"
    wheels.mkdir()
    scratch.mkdir()
    _fake_wheel(wheels, "einops", "0.0.1", "einops_fake")  # installed here: skipped
    _fake_wheel(wheels, "genolong_probe_dist", "1.0", "genolong_probe_mod")  # not installed: unzipped
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHON": sys.executable,
        "GPU_WHEELS": str(wheels),
        "TMPDIR": str(scratch),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out_dir)],
        # a hang guard, not a speed check: the run took over 120 s on a 2-core machine
        # busy with two other test suites (2026-12-03), so the guard leaves room
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    log = proc.stdout
    assert f"python: {sys.executable} ($PYTHON; torch sees CPU)" in log and "CPU mode, --small" in log
    assert "wheel einops-0.0.1-py3-none-any.whl: skipped, einops" in log
    assert "wheel genolong_probe_dist-1.0-py3-none-any.whl: unpacked" in log
    (where,) = [line for line in log.splitlines() if line.startswith("genolong from ")]
    # genolong from the temporary package; the checkout's kernels/ is no top-level package there
    # (a top-level `kernels` is the PyPI distribution where one is installed, else None)
    assert "/src/genolong ; top-level kernels: " in where and str(ROOT / "kernels") not in where, where
    assert list(scratch.iterdir()) == []  # the temporary folder is gone
    out = out_dir / "gpu_check.json"
    assert {p.name for p in out_dir.iterdir()} >= {
        "gpu_check.json",
        "gpu_check.log",
        "nvidia-smi.txt",
        "gpu_check.dsa_correctness.json",
        "gpu_check.kda.json",
    }

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    doc = json.loads(out.read_text(), parse_constant=no_constant)  # strict JSON: no NaN / Infinity
    assert doc["done"] is True and doc["errors"] == {} and doc["skipped"] == []
    meta = doc["meta"]
    assert meta["small"] is True and meta["backend"] == "torch" and meta["device"] == "cpu" and meta["isolated"] is True
    # genolong from the script's symlinked package, whatever this session installed
    assert meta["genolong_from"].endswith("/src/genolong") and not meta["genolong_from"].startswith(str(ROOT))
    import importlib.metadata as md

    assert (meta["torch"], meta["triton"], meta["fla_core"], meta["numpy"]) == (
        torch.__version__,
        md.version("triton"),
        md.version("fla-core"),
        md.version("numpy"),
    )
    # one process per part, in order, the fla-core part last; what ran each op is recorded
    assert list(doc["parts"]) == ["dsa_correctness", "dsa", "model", "kda"]
    assert all(part["status"] == "ok" and part["exit"] == 0 for part in doc["parts"].values()), doc["parts"]
    assert set(doc["parts"]["model"]["backend_impls"].values()) == {"torch"}
    dsa = doc["correctness"]["dsa_sparse_attention"]
    kda = doc["correctness"]["kda_fla"]
    # the DSA part runs the Triton op (in the interpreter: this session sets TRITON_INTERPRET=1)
    # in the model's absorbed form, the latent passed as both k and v (its gradient is dK + dV)
    assert (
        dsa["impl"].startswith("genolong.kernels.dsa.triton_attention.sparse_attention_triton")
        and "interpreter" in dsa["impl"]
    )
    assert set(dsa["rms_ratio"]) == set(dsa["mixed_rms_ratio"]) == {"o", "dq", "dkv"}
    assert all(0 <= r < 0.02 for r in dsa["mixed_rms_ratio"].values()) and dsa["mixed_rms_ratio"]["o"] > 0
    assert set(kda["rms_ratio"]) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    gated = doc["correctness"]["kda_fla_gated"]["rms_ratio"]
    assert set(gated) == {"o", "ht", "dq", "dk", "dv", "dg_raw", "dbeta_logits", "dA_log", "ddt_bias", "dh0"}
    assert all(r < 0.02 for r in gated.values()) and gated["o"] > 0, gated
    assert kda["fwd_bwd_ms"]["candidate_bf16"] > 0 and kda["fwd_bwd_ms"]["torch_fp32"] > 0
    assert max(kda["fp32_inputs_rms_ratio"].values()) < 1e-5, kda["fp32_inputs_rms_ratio"]
    # bf16 against float32: small but not zero (the comparison really ran on rounded inputs)
    for ratios in (dsa["rms_ratio"], kda["rms_ratio"], kda["torch_bf16_rms_ratio"]):
        assert all(0 <= r < 0.02 for r in ratios.values()) and ratios["o"] > 0, ratios
    rows = doc["dsa_vs_sdpa"]["rows"]
    assert [r["T"] for r in rows] == [256, 512]
    assert all(r["dsa"]["ms"] > 0 and r["sdpa"]["ms"] > 0 and r["sdpa_over_dsa"] > 0 for r in rows)
    model = doc["model"]
    assert model["preset"] == "tiny" and model["recompute"] == "full" and model["parameters"] > 0
    assert [(r["T"], r["offload"]) for r in model["rows"]] == [(128, True), (256, True), (128, False), (256, False)]
    for row in model["rows"]:
        assert row["tokens_per_s"] > 0 and 1.0 < row["loss"] < 3.0, row
    # offload changes memory, not the result
    by = {(r["T"], r["offload"]): r["loss"] for r in model["rows"]}
    assert by[(256, False)] == pytest.approx(by[(256, True)], rel=1e-6)


def test_gpu_check_guards_and_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing part is recorded under ``errors`` and the other parts still run; work past the
    time budget is recorded as skipped (in-process, tiny sizes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    threads = torch.get_num_threads()
    try:
        out = tmp_path / "guard.json"
        gpu_check.main(
            [
                "--small",
                "--in-process",
                "--parts",
                "model,dsa",
                "--model-preset",
                "no-such-preset",
                "--dsa-lengths",
                "64",
                "--out",
                str(out),
            ]
        )
        doc = json.loads(out.read_text())
        assert doc["done"] is True and list(doc["errors"]) == ["model"] and "no-such-preset" in doc["errors"]["model"]
        assert [r["T"] for r in doc["dsa_vs_sdpa"]["rows"]] == [64] and doc["dsa_vs_sdpa"]["rows"][0]["dsa"]["ms"] > 0
        out2 = tmp_path / "budget.json"
        gpu_check.main(
            [
                "--small",
                "--in-process",
                "--parts",
                "dsa",
                "--dsa-lengths",
                "64,128",
                "--budget-s",
                "0",
                "--out",
                str(out2),
            ]
        )
        doc2 = json.loads(out2.read_text())
        assert doc2["errors"] == {} and doc2["dsa_vs_sdpa"]["rows"] == []
        assert doc2["skipped"] == ["dsa_vs_sdpa T=64: time budget 0 s spent"]
        # no fla-core: the KDA part is an error, never a run of the torch reference in its place
        monkeypatch.setattr(fla_backend, "fla_version", lambda: None)
        out3 = tmp_path / "no-fla.json"
        gpu_check.main(["--small", "--in-process", "--parts", "kda", "--out", str(out3)])
        doc3 = json.loads(out3.read_text())
        assert (
            list(doc3["errors"]) == ["correctness.kda"]
            and "fla-core is not importable" in doc3["errors"]["correctness.kda"]
        )
        assert "rms_ratio" not in doc3["correctness"]["kda_fla"] and doc3["correctness"]["kda_fla"]["fla_core"] is None
    finally:
        torch.set_num_threads(threads)


def _load_gpu_check() -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_part_processes_crash_and_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part runs in a process of its own, in order (the fla-core part last): a part that dies
    (here by SIGSEGV, after writing some figures), one killed at its own budget and one that exits
    1 without output are recorded under ``errors`` with how they ended and their last output; the
    figures a dead part had written are kept and the next parts still run (fake part processes)."""
    gpu_check = _load_gpu_check()
    behaviour = {
        # writes a first figure, then dies as a kernel crash would
        "dsa_correctness": "write({'correctness': {'dsa_sparse_attention': {'T': 7}}}, done=False)\n"
        "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
        "dsa": "print('compiling...', flush=True); import time; time.sleep(60)",  # past its 2 s budget
        "model": "write({'model': {'rows': [{'T': 128}]}, 'meta': {'device': 'cpu', 'device_name': 'fake',"
        " 'backend': 'torch', 'backend_impls': {'chunk_kda': 'torch'}, 'dispatch': {}}})",
        "kda": "print('fla-core: CUDA error: an illegal memory access'); raise SystemExit(1)",
    }
    started: list[str] = []

    def fake_command(a: Any, part: str, out: Path, soft_budget_s: float) -> list[str]:
        started.append(part)
        prelude = (
            "import json, sys\n"
            "def write(doc, done=True):\n"
            "    doc = {'errors': {}, 'skipped': [], **doc, **({'done': True} if done else {})}\n"
            "    open(sys.argv[1], 'w').write(json.dumps(doc))\n"
        )
        return [sys.executable, "-c", prelude + behaviour[part], str(out)]

    monkeypatch.setattr(gpu_check, "_child_command", fake_command)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--small", "--part-budgets", "dsa=2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert started == ["dsa_correctness", "dsa", "model", "kda"]
    parts = doc["parts"]
    assert [parts[p]["status"] for p in started] == ["crashed", "timed out", "ok", "crashed"]
    errors = doc["errors"]
    assert set(errors) == {"correctness.dsa", "dsa_vs_sdpa", "correctness.kda"}
    assert errors["correctness.dsa"].startswith("part process killed by SIGSEGV")
    assert (
        errors["dsa_vs_sdpa"].startswith("part process killed at its 2 s budget")
        and "compiling..." in errors["dsa_vs_sdpa"]
    )
    assert (
        errors["correctness.kda"].startswith("part process exit code 1")
        and "illegal memory access" in errors["correctness.kda"]
    )
    assert doc["correctness"]["dsa_sparse_attention"] == {"T": 7}  # what the dead part had written
    assert doc["model"]["rows"] == [{"T": 128}] and parts["model"]["backend_impls"] == {"chunk_kda": "torch"}
    assert parts["dsa"]["budget_s"] == 2 and parts["dsa"]["seconds"] < 30 and doc["done"] is True


def test_gpu_check_parts_and_interpreter_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--parts`` runs in the fixed order whatever the order asked (``correctness`` is both
    correctness parts; an unknown name is an error); Triton's interpreter is not run on CPU with
    triton < 3.7 and numpy >= 2.4 (triton 3.6's interpreter fails there, not the kernels)."""
    import importlib.metadata

    gpu_check = _load_gpu_check()
    assert gpu_check.parse(["--parts", "kda,model,dsa"]).parts == ["dsa", "model", "kda"]
    assert gpu_check.parse(["--parts", "correctness"]).parts == ["dsa_correctness", "kda"]
    with pytest.raises(SystemExit):
        gpu_check.parse(["--parts", "dsa,nope"])
    assert gpu_check.parse(["--part-budgets", "model=200"]).part_budget_s["model"] == 200
    assert sum(gpu_check.PART_BUDGET_S.values()) == gpu_check.parse([]).budget_s == 420  # under 8 minutes
    for versions, broken in (
        (("3.6.0", "2.5.5"), True),
        (("3.6.0", "2.3.5"), False),
        (("3.7.1", "2.5.5"), False),
        (("3.6.0", "2.4.0rc1"), True),
    ):
        pair = dict(zip(("triton", "numpy"), versions))
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=pair: v[name])
        assert (gpu_check._interpreter_problem() is not None) == broken, versions

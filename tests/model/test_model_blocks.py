"""MoE, mHC, norms and the SwiGLU MLP against transformers' GLM-5.3-Flash modules.

transformers builds its modules with seeded random weights in a subprocess that hides fla (its
KDA path would pick fla's Triton kernel on CPU), runs forward and backward, and saves weights,
inputs, outputs and gradients; genolong's modules load the same weights by name and must agree.
"""

from __future__ import annotations

import json

import pytest
import torch

from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS, ModelConfig
from genolong.model.layers import GatedRMSNorm, RMSNorm, SwiGLU
from genolong.model.mhc import HyperConnection, collapse_streams, expand_streams, merge_streams
from genolong.model.moe import MoE
from tests.helpers import run_transformers

_CONFIGS = {
    "tiny": PRESETS["tiny"].replace(n_routed_experts=8, num_experts_per_tok=3, swiglu_limit=0.05),
    "grouped": PRESETS["tiny"].replace(
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=False
    ),
}

_HF_SCRIPT = r"""
import sys, json
import torch
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next import modeling_glm5_next as m
out_path, configs = sys.argv[1], json.loads(sys.stdin.read())
torch.manual_seed(0)
result = {}
for name, raw in configs.items():
    c = Glm5NextTextConfig(**raw)
    h = c.hidden_size
    modules = {
        "moe": m.Glm5NextTextMoE(c),
        "mlp": m.Glm5NextTextMLP(c),
        "hc": m.Glm5NextTextHyperConnection(c),
        "norm": m.Glm5NextTextRMSNorm(h, eps=c.rms_norm_eps),
        "gated": m.Glm5NextTextRMSNormGated(h, eps=c.rms_norm_eps),
    }
    entry = {}
    for key, module in modules.items():
        module = module.double()
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.5)
            for b in module.buffers():
                b.normal_(0, 0.1)
        shape = (2, 37, c.hc_mult, h) if key == "hc" else (2, 37, h)
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        extra = torch.randn(2, 37, h, dtype=torch.float64, requires_grad=True) if key == "gated" else None
        out = module(x, extra) if key == "gated" else module(x)
        outs = out if isinstance(out, tuple) else (out,)
        probes = [torch.randn_like(o) for o in outs]
        loss = sum((o * p).sum() for o, p in zip(outs, probes))
        loss.backward()
        entry[key] = {
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "x": x.detach(), "extra": None if extra is None else extra.detach(),
            "outs": [o.detach() for o in outs], "probes": probes,
            "grad_x": x.grad, "grad_extra": None if extra is None else extra.grad,
            "grads": {k: p.grad.detach() for k, p in module.named_parameters()},
        }
    result[name] = entry
torch.save(result, out_path)
print("ok")
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("hf") / "blocks.pt"
    configs = {name: config.to_hf_dict() for name, config in _CONFIGS.items()}
    run_transformers(_HF_SCRIPT, str(path), stdin=json.dumps(configs))
    return torch.load(path, weights_only=True)


def _ours(key: str, config: ModelConfig, chunk_tokens: int | None) -> torch.nn.Module:
    h = config.hidden_size
    return {
        "moe": lambda: MoE(config, chunk_tokens=chunk_tokens),
        "mlp": lambda: SwiGLU(h, config.intermediate_size, config.swiglu_limit),
        "hc": lambda: HyperConnection(config),
        "norm": lambda: RMSNorm(h, eps=config.rms_norm_eps),
        "gated": lambda: GatedRMSNorm(h, eps=config.rms_norm_eps),
    }[key]()


@pytest.mark.parametrize("config_name", list(_CONFIGS))
@pytest.mark.parametrize(
    ("key", "chunk_tokens"), [("moe", None), ("moe", 10), ("mlp", None), ("hc", None), ("norm", None), ("gated", None)]
)
def test_block_matches_transformers(reference: dict, config_name: str, key: str, chunk_tokens: int | None) -> None:
    ref = reference[config_name][key]
    # Everything runs in float64 except the router, which both implementations compute in fp32 by
    # design; in token chunks its weight gradient is summed in another order: fp32-level agreement.
    tolerance = 1e-12 if chunk_tokens is None else 1e-6
    module = _ours(key, _CONFIGS[config_name], chunk_tokens).double()
    module.load_state_dict(ref["state"], strict=True)  # same parameter names as the checkpoint
    x = ref["x"].clone().requires_grad_(True)
    extra = None if ref["extra"] is None else ref["extra"].clone().requires_grad_(True)
    out = module(x, extra) if key == "gated" else module(x)
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == len(ref["outs"])
    for got, want in zip(outs, ref["outs"]):
        assert rms_ratio(want, got) < tolerance
    sum((o * p).sum() for o, p in zip(outs, ref["probes"])).backward()
    assert rms_ratio(ref["grad_x"], x.grad) < tolerance
    if extra is not None:
        assert rms_ratio(ref["grad_extra"], extra.grad) < tolerance
    for name, param in module.named_parameters():
        assert rms_ratio(ref["grads"][name], param.grad) < tolerance, name


def test_moe_records_load_and_chunks_do_not_change_results() -> None:
    torch.manual_seed(1)
    config = _CONFIGS["tiny"]
    whole, chunked = MoE(config), MoE(config, chunk_tokens=7)
    chunked.load_state_dict(whole.state_dict())
    x = torch.randn(3, 50, config.hidden_size)
    # other matmul shapes per chunk, so other fp32 summation orders (9e-10 here, outputs up to 0.016)
    torch.testing.assert_close(whole(x), chunked(x), rtol=0, atol=1e-6)
    assert int(whole.last_load.sum()) == 3 * 50 * config.num_experts_per_tok
    # exact: int64 token counts (the same routing: no two expert scores within rounding here)
    assert torch.equal(whole.last_load, chunked.last_load)


def test_streams_expand_merge_collapse() -> None:
    torch.manual_seed(2)
    x = torch.randn(2, 5, 8)
    streams = expand_streams(x, 4)
    # exact: the mean of 4 equal fp32 values rounds back to the value (so do 2; 3 or 8 copies do not)
    assert streams.shape == (2, 5, 4, 8) and torch.equal(collapse_streams(streams), x)
    identity = torch.eye(4).expand(2, 5, 4, 4)
    merged = merge_streams(torch.zeros(2, 5, 4), identity, torch.randn(2, 5, 8), streams)
    assert torch.allclose(merged, streams)

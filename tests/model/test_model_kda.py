"""The KDA mixer against transformers' Glm5NextTextLinearAttention (fp32, forward and every gradient)."""

from __future__ import annotations

import json

import pytest
import torch

from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS
from genolong.model.kda import KDAMixer, ShortConv
from tests.helpers import run_transformers

_CONFIGS = {
    "lower-bound": PRESETS["tiny"],
    "softplus": PRESETS["tiny"].replace(linear_lower_bound=None),
}
_LENGTHS = (63, 130)

_HF_SCRIPT = r"""
import sys, json
import torch
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next import modeling_glm5_next as m
out_path, configs, lengths = sys.argv[1], *json.loads(sys.stdin.read())
torch.manual_seed(0)
result = {}
for name, raw in configs.items():
    c = Glm5NextTextConfig(**raw)
    module = m.Glm5NextTextLinearAttention(c, layer_idx=0)
    with torch.no_grad():
        for pname, p in module.named_parameters():
            p.normal_(0, 0.3 if "A_log" not in pname else 0.5)
    entry = {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "runs": []}
    for t in lengths:
        x = torch.randn(2, t, c.hidden_size, requires_grad=True)
        out = module(x)
        probe = torch.randn_like(out)
        module.zero_grad()
        (out * probe).sum().backward()
        entry["runs"].append({"x": x.detach(), "out": out.detach(), "probe": probe, "grad_x": x.grad,
                              "grads": {k: p.grad.detach().clone() for k, p in module.named_parameters()}})
    result[name] = entry
torch.save(result, out_path)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("hf") / "kda.pt"
    payload = [{n: c.to_hf_dict() for n, c in _CONFIGS.items()}, list(_LENGTHS)]
    run_transformers(_HF_SCRIPT, str(path), stdin=json.dumps(payload))
    return torch.load(path, weights_only=True)


def _run(mixer: KDAMixer, data: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    mixer = mixer.to(dtype)
    x = data["x"].clone().to(dtype).requires_grad_(True)
    out = mixer(x)
    (out * data["probe"].to(dtype)).sum().backward()
    return {"out": out.detach(), "x": x.grad, **{k: p.grad for k, p in mixer.named_parameters()}}


@pytest.mark.parametrize("name", list(_CONFIGS))
@pytest.mark.parametrize("run", range(len(_LENGTHS)))
def test_kda_mixer_matches_transformers(reference: dict, name: str, run: int) -> None:
    """Same weights (loaded by checkpoint name), same input: outputs agree to 1e-5 in fp32.

    transformers computes the KDA core in fp32 even in a float64 module, and its fp32 gradients
    differ from a float64 computation by up to ~3e-5 (RMS ratio) on these inputs, so gradients
    are judged against float64 truth (genolong in float64): both fp32 implementations must agree
    with it to 1e-4, the fp32 rounding level of a reduction over the sequence. Any systematic
    difference, a bug, would be orders of magnitude larger.
    """
    ref = reference[name]
    data = ref["runs"][run]
    hf = {"out": data["out"], "x": data["grad_x"], **data["grads"]}
    results = {}
    for dtype in (torch.float32, torch.float64):
        mixer = KDAMixer(_CONFIGS[name])
        mixer.load_state_dict(ref["state"], strict=True)
        results[dtype] = _run(mixer, data, dtype)
    ours, truth = results[torch.float32], results[torch.float64]
    assert rms_ratio(hf["out"], ours["out"]) < 1e-5
    assert set(hf) == set(ours)
    for key in hf:
        assert rms_ratio(truth[key], hf[key]) < 1e-4, key
        assert rms_ratio(truth[key], ours[key]) < 1e-4, key


def test_short_conv_equals_depthwise_conv1d() -> None:
    torch.manual_seed(3)
    conv = ShortConv(6, 4)
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    want = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x.transpose(1, 2), conv.weight.double(), padding=3, groups=6)[:, :, :11]
    ).transpose(1, 2)
    got = conv(x)
    assert torch.allclose(got, want.to(got.dtype), atol=1e-6)

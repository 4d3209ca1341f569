"""GenoLM against transformers' Glm5NextTextModel + LM head: a KDA-only model and the whole tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from genolong.kernels.testing import rms_ratio
from genolong.data.alphabet import encode
from genolong.model import PRESETS
from genolong.model.lm import GenoLM

from .helpers import run_transformers

_CONFIGS = {
    "kda-moe": PRESETS["tiny"].replace(num_hidden_layers=4, pattern="K", indexer_types=("full",) * 4),
    # the whole tiny preset: KKDDKKKD with a shared indexer at layer 3; 16 index heads make exact
    # ties in the pool top-k (which the two implementations break differently) unlikely
    "tiny": PRESETS["tiny"].replace(index_n_heads=16, index_topk=32, index_kpool=4),
}
_T = 75

_HF_SCRIPT = r"""
import sys, json
import torch
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next import modeling_glm5_next as m
out_path, configs, t = sys.argv[1], *json.loads(sys.stdin.read())
torch.manual_seed(0)
result = {}
for name, raw in configs.items():
    c = Glm5NextTextConfig(**raw)
    model = m.Glm5NextTextModel(c)
    head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
    with torch.no_grad():
        for pname, p in [*model.named_parameters(), ("lm_head.weight", head.weight)]:
            p.normal_(0, 0.2)
        for b in model.buffers():
            b.normal_(0, 0.05)
        model.embed_tokens.weight[c.pad_token_id].zero_()
    ids = torch.randint(1, 6, (2, t))
    hidden = model(input_ids=ids, use_cache=False).last_hidden_state
    logits = head(hidden)
    probe = torch.randn_like(logits)
    (logits * probe).sum().backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = head.weight.detach().clone()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    grads["lm_head.weight"] = head.weight.grad.detach().clone()
    result[name] = {"state": state, "ids": ids, "logits": logits.detach(), "probe": probe, "grads": grads}
torch.save(result, out_path)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("hf") / "lm.pt"
    payload = [{n: c.to_hf_dict() for n, c in _CONFIGS.items()}, _T]
    run_transformers(_HF_SCRIPT, str(path), stdin=json.dumps(payload))
    return torch.load(path, weights_only=True)


def _run(model: GenoLM, data: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = model.to(dtype)
    logits = model.logits(model(data["ids"]))
    (logits * data["probe"].to(dtype)).sum().backward()
    return {"logits": logits.detach(), **{k: p.grad for k, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_genolm_matches_transformers(reference: dict, name: str) -> None:
    """Same weights by checkpoint name: logits agree to 1e-5 in fp32; every gradient agrees with
    float64 truth to 1e-4, for both implementations (transformers' KDA core is fp32; see
    tests/test_model_kda.py)."""
    ref = reference[name]
    results = {}
    for dtype in (torch.float32, torch.float64):
        model = GenoLM(_CONFIGS[name])
        model.load_state_dict(ref["state"], strict=True)
        results[dtype] = _run(model, ref, dtype)
    ours, truth = results[torch.float32], results[torch.float64]
    assert rms_ratio(ref["logits"], ours["logits"]) < 1e-5
    hf_grads = ref["grads"]
    assert set(hf_grads) == set(ours) - {"logits"}
    for key, hf_grad in hf_grads.items():
        assert rms_ratio(truth[key], hf_grad) < 1e-4, key
        assert rms_ratio(truth[key], ours[key]) < 1e-4, key


def test_causality_and_loss_masks() -> None:
    torch.manual_seed(4)
    model = GenoLM(_CONFIGS["kda-moe"])
    tokens = torch.from_numpy(encode("ACGTNacgtnACGTACGTAC")).long()[None].repeat(2, 1)
    changed = tokens.clone()
    changed[:, 12:] = 1
    a, b = model(tokens & 7), model(changed & 7)
    assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])
    total, count = model.loss(tokens)
    assert float(count) == 2 * 17  # 19 targets per row, minus the N at position 4 and the n at 9

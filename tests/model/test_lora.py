"""LoRA on GenoLM (genolong.model.lora): the base exactly at B = 0, merge, what trains, the adapter files.

The independent check against peft and transformers is tests/model/test_lora_peft.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from genolong.errors import InputError
from genolong.model.config import PRESETS
from genolong.model.lm import GenoLM
from genolong.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ExpertAdapters,
    LoraLinear,
    LoraSettings,
    adapter_parameters,
    apply_lora,
    has_lora,
    load_adapter,
    lora_modules,
    merge_lora,
    save_adapter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: every kind of linear layer GenoLM has: KDA and MLA projections, the DSA indexer's, the shared
#: experts, the dense MLPs, plus the routed experts and a module trained in full
EVERYTHING = LoraSettings(
    rank=4,
    alpha=8.0,
    targets=("layers.*.self_attn.*", "layers.*.mlp.shared_experts.*", "layers.0.mlp.*"),
    routed_experts=True,
    modules_to_save=("norm",),
)


def _base() -> GenoLM:
    torch.manual_seed(0)
    return GenoLM(PRESETS["tiny"]).eval()


def _randomise(model: GenoLM, std: float = 0.05) -> None:
    """Non-zero B everywhere (and a changed saved module), as after training."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=generator) * std)


def _ids(t: int = 77) -> torch.Tensor:
    return torch.randint(0, 4, (2, t), generator=torch.Generator().manual_seed(2))


def test_zero_b_is_the_base_bitwise() -> None:
    """At initialisation (B = 0) the adapted model computes the base's hidden states and loss bit
    for bit: each update is an exact 0 added (odd T = 77, every linear kind and the routed experts)."""
    base = _base()
    model = copy.deepcopy(base)
    wrapped = apply_lora(model, EVERYTHING)
    experts = [m for m in model.modules() if isinstance(m, ExpertAdapters)]
    assert len(experts) == 7 and len(lora_modules(model)) == len(wrapped) - 7  # tiny: 7 MoE layers
    ids = _ids()
    assert torch.equal(model(ids), base(ids))
    assert torch.equal(model.loss(ids)[0], base.loss(ids)[0])
    # the absorbed-MLA path reads kv_b_proj.weight: the effective weight is W itself at B = 0
    kv_b = model.get_submodule("layers.2.self_attn.kv_b_proj")
    assert isinstance(kv_b, LoraLinear) and torch.equal(kv_b.weight, kv_b.base.weight)


def test_init_is_peft_s() -> None:
    """A Kaiming-uniform with a = sqrt(5) (bound 1 / sqrt(in)), B zeros, scaling alpha / r."""
    model = _base()
    apply_lora(model, LoraSettings(rank=8, alpha=16.0, targets=("layers.0.self_attn.q_proj",)))
    layer = model.get_submodule("layers.0.self_attn.q_proj")
    bound = 1 / layer.in_features**0.5
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.abs().max() > 0.5 * bound
    assert torch.count_nonzero(layer.lora_B.weight) == 0
    assert layer.scaling == 2.0


def test_only_adapters_train() -> None:
    """Every base parameter is frozen and gets no gradient; the adapters and modules_to_save do
    (the indexer's adapters only through the indexer KL, as its base weights: the top-k is not
    differentiable)."""
    model = _base()
    apply_lora(model, EVERYTHING)
    _randomise(model)
    trained = adapter_parameters(model)
    assert "norm.weight" in trained and "layers.1.mlp.experts.lora.lora_A.gate_up_proj.weight" in trained
    model.train()
    indexers = [m for m in model.modules() if getattr(m, "indexer", None) is not None]
    for mixer in indexers:
        mixer.indexer_kl = True  # as GenoLMModule sets it: the loss then trains the indexers
    nll, weight = model.loss(_ids())
    kl = torch.stack([m.last_indexer_kl for m in indexers]).mean()
    (nll / weight + kl).backward()
    for name, p in model.named_parameters():
        if name in trained:
            assert p.requires_grad and p.grad is not None and torch.count_nonzero(p.grad) > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_merge_equals_the_adapter_model() -> None:
    """merge_lora folds W + (alpha / r) B A (float32) into plain layers: the same logits to fp32
    rounding (the merged product is summed in another order than base(x) + B(A(x)))."""
    model = _base()
    apply_lora(model, EVERYTHING)
    _randomise(model)
    ids = _ids()
    expected = model.logits(model(ids))
    merged = merge_lora(copy.deepcopy(model))
    assert not has_lora(merged) and not lora_modules(merged)
    assert not any(isinstance(m, ExpertAdapters) for m in merged.modules())
    assert set(merged.state_dict()) == set(_base().state_dict())
    got = merged.logits(merged(ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, _base().logits(_base()(ids)), rtol=1e-3, atol=1e-3)  # the adapters did change it


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    """save_adapter -> load_adapter onto a fresh base: the same tensors and logits; the files are
    PEFT's, with genolong's checksum manifest beside them."""
    model = _base()
    apply_lora(model, EVERYTHING)
    _randomise(model)
    out = save_adapter(model, tmp_path / "adapter", base_model_name_or_path="base")
    assert {p.name for p in out.iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "checksums.json"}
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert "model.language_model.layers.0.self_attn.forget_gate.f_a_proj" in config["target_modules"]
    assert config["target_parameters"][:2] == [
        "model.language_model.layers.1.mlp.experts.gate_up_proj",
        "model.language_model.layers.1.mlp.experts.down_proj",
    ]
    fresh = _base()
    settings = load_adapter(fresh, out)
    assert settings.rank == 4 and settings.routed_experts
    assert adapter_parameters(fresh).keys() == adapter_parameters(model).keys()
    for name, p in adapter_parameters(model).items():
        assert torch.equal(adapter_parameters(fresh)[name], p), name
    ids = _ids()
    assert torch.equal(fresh(ids), model(ids))
    # the routed experts' factors, held stacked by expert (A [E, r, in], B [E, out, r]), are
    # written in PEFT's fused layout: A's rows e * r .. e * r + r and B's columns k * E + e are expert e's
    adapters = model.get_submodule("layers.1.mlp.experts.lora")
    a, b = adapters.lora_A["down_proj"].weight, adapters.lora_B["down_proj"].weight
    written = load_file(out / ADAPTER_WEIGHTS)
    key = "base_model.model.model.language_model.layers.1.mlp.experts.lora_{}.weight"  # down_proj: the outer wrapper
    e, r = a.shape[0], a.shape[1]
    for expert in range(e):
        assert torch.equal(written[key.format("A")][expert * r : (expert + 1) * r], a[expert])  # exact: copies
        assert torch.equal(written[key.format("B")][:, expert::e], b[expert])  # exact: copies
    # saving again replaces the directory whole
    save_adapter(model, out)
    assert (out / ADAPTER_WEIGHTS).is_file()


def test_bad_targets_and_adapters(tmp_path: Path) -> None:
    model = _base()
    with pytest.raises(InputError, match=r"model\.lora\.targets: 'layers\.\*\.self_atn\.\*' matches no linear layer"):
        apply_lora(model, LoraSettings(targets=("layers.*.self_atn.*",)))
    with pytest.raises(InputError, match=r"modules_to_save: 'nrom' matches no module"):
        apply_lora(_base(), LoraSettings(targets=("layers.*.self_attn.q_proj",), modules_to_save=("nrom",)))
    apply_lora(model, LoraSettings(rank=2, targets=("layers.*.self_attn.q_proj",)))
    with pytest.raises(InputError, match="already has LoRA adapters"):
        apply_lora(model, LoraSettings(targets=("layers.*.self_attn.q_proj",)))
    adapter = save_adapter(model, tmp_path / "a")

    with pytest.raises(InputError, match=r"--adapter .*missing: no such directory"):
        load_adapter(_base(), tmp_path / "missing")
    with pytest.raises(InputError, match=rf"no {ADAPTER_CONFIG} in it"):
        load_adapter(_base(), tmp_path)
    # an adapter for another geometry: the shapes do not fit
    other = GenoLM(PRESETS["tiny"].replace(hidden_size=96))
    with pytest.raises(
        InputError, match=r"has shape \(2, 64\), this base needs \(2, 96\); the adapter was trained on another model"
    ):
        load_adapter(other, adapter)
    # a module this base lacks
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    bad = tmp_path / "b"
    bad.mkdir()
    (bad / ADAPTER_WEIGHTS).write_bytes((adapter / ADAPTER_WEIGHTS).read_bytes())
    (bad / ADAPTER_CONFIG).write_text(
        json.dumps({**config, "target_modules": ["model.language_model.layers.99.self_attn.q_proj"]})
    )
    with pytest.raises(
        InputError, match=r"adapts 'layers\.99\.self_attn\.q_proj', which this base model does not have"
    ):
        load_adapter(_base(), bad)
    (bad / ADAPTER_CONFIG).write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(InputError, match="a 'IA3' adapter; genolong reads LoRA adapters"):
        load_adapter(_base(), bad)
    (bad / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(InputError, match="uses use_dora"):
        load_adapter(_base(), bad)
    # a damaged weights file (no manifest here, so safetensors' own check names it)
    (bad / ADAPTER_CONFIG).write_text(json.dumps(config))
    (bad / ADAPTER_WEIGHTS).write_bytes((adapter / ADAPTER_WEIGHTS).read_bytes()[:100])
    with pytest.raises(InputError, match=rf"{ADAPTER_WEIGHTS}"):
        load_adapter(_base(), bad)

"""genolong's adapters against an independent implementation: peft on transformers' GLM-5.3-Flash.

Both ways: an adapter genolong wrote, read by ``peft.PeftModel.from_pretrained`` over
transformers' ``Glm5NextForConditionalGeneration`` (and genolong's merged export read by
transformers), and an adapter peft wrote, read by :func:`genolong.model.lora.load_adapter`.
transformers and peft run in a child process where fla cannot be imported (tests/helpers.py),
so transformers takes its torch fallbacks, as in tests/model/test_model_lm.py.

Tolerance 1e-5 relative (fp32): the two implementations compute the same sums in other orders
(transformers' KDA core, its MoE dispatch, and peft folding the experts' update into their
weights where genolong adds it per expert), as in tests/model/test_model_lm.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from genolong.model.config import PRESETS
from genolong.model.lm import GenoLM
from genolong.model.lora import LoraSettings, adapter_parameters, apply_lora, load_adapter, merge_lora, save_adapter
from tests.helpers import run_transformers

pytestmark = pytest.mark.usefixtures("one_thread")

#: KDA, MLA and indexer projections, shared experts, routed experts, and the final norm in full
SETTINGS = LoraSettings(
    rank=4,
    alpha=8.0,
    targets=("layers.*.self_attn.*", "layers.*.mlp.shared_experts.*"),
    routed_experts=True,
    modules_to_save=("norm",),
)

# argv: base dir, adapter dir, merged export dir (or "-"), ids.pt, out.pt
_PEFT_READS = """
import torch
from peft import PeftModel
from transformers.models.glm5_next import modeling_glm5_next as m
base, adapter, merged, ids_file, out_file = sys.argv[1:]
ids = torch.load(ids_file)
model = m.Glm5NextForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
peft_model = PeftModel.from_pretrained(model, adapter).eval()
with torch.no_grad():
    out = {"peft": peft_model(input_ids=ids).logits}
    if merged != "-":
        out["merged"] = m.Glm5NextForConditionalGeneration.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
torch.save(out, out_file)
"""

# argv: base dir, adapter out dir, ids.pt, out.pt: peft's own adapter with random B, and its logits
_PEFT_WRITES = """
import torch
from peft import LoraConfig, get_peft_model
from transformers.models.glm5_next import modeling_glm5_next as m
base, adapter, ids_file, out_file = sys.argv[1:]
torch.manual_seed(3)
model = m.Glm5NextForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
config = LoraConfig(r=4, lora_alpha=16, task_type="CAUSAL_LM",
                    target_modules=["q_proj", "kv_b_proj", "o_proj", "f_b_proj", "wk"],
                    target_parameters=["model.language_model.layers.1.mlp.experts.gate_up_proj",
                                       "model.language_model.layers.1.mlp.experts.down_proj"])
peft_model = get_peft_model(model, config)
with torch.no_grad():
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.normal_(std=0.05)
peft_model.save_pretrained(adapter)
with torch.no_grad():
    torch.save({"peft": peft_model.eval()(input_ids=torch.load(ids_file)).logits}, out_file)
"""


def _base(tmp_path: Path) -> tuple[GenoLM, Path]:
    torch.manual_seed(0)
    model = GenoLM(PRESETS["tiny"]).eval()
    return model, model.save_pretrained(tmp_path / "base")


def _ids(tmp_path: Path) -> tuple[torch.Tensor, Path]:
    ids = torch.randint(1, 6, (2, 45), generator=torch.Generator().manual_seed(4))
    torch.save(ids, tmp_path / "ids.pt")
    return ids, tmp_path / "ids.pt"


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, rtol=0, atol=1e-5)


def test_peft_reads_genolongs_adapter(tmp_path: Path) -> None:
    """genolong's adapter under peft over transformers = genolong's adapter model = transformers
    reading genolong's merged export, to 1e-5 of the logits' scale."""
    base, base_dir = _base(tmp_path)
    model = copy.deepcopy(base)
    apply_lora(model, SETTINGS)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    merged = merge_lora(copy.deepcopy(model)).save_pretrained(tmp_path / "export")
    ids, ids_file = _ids(tmp_path)
    with torch.no_grad():
        ours = model.logits(model(ids))
        plain = base.logits(base(ids))
    run_transformers(_PEFT_READS, str(base_dir), str(adapter), str(merged), str(ids_file), str(tmp_path / "out.pt"))
    theirs = torch.load(tmp_path / "out.pt")
    _close(theirs["peft"], ours)
    _close(theirs["merged"], ours)
    assert (ours - plain).abs().max() > 100 * 1e-5 * plain.abs().max()  # the adapters matter at this scale


def test_genolong_reads_peft_s_adapter(tmp_path: Path) -> None:
    """An adapter written by peft itself (module-name suffixes as targets, routed experts by
    target_parameters) loaded by load_adapter gives peft's logits."""
    _, base_dir = _base(tmp_path)
    ids, ids_file = _ids(tmp_path)
    run_transformers(_PEFT_WRITES, str(base_dir), str(tmp_path / "peft"), str(ids_file), str(tmp_path / "out.pt"))
    model = GenoLM.from_pretrained(base_dir).eval()
    settings = load_adapter(model, tmp_path / "peft")
    assert settings.rank == 4 and settings.alpha == 16 and settings.routed_experts
    assert "layers.3.self_attn.kv_b_proj" in settings.targets and "layers.2.self_attn.indexer.wk" in settings.targets
    with torch.no_grad():
        ours = model.logits(model(ids))
    _close(ours, torch.load(tmp_path / "out.pt")["peft"])

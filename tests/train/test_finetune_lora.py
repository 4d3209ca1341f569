"""Frozen weights and LoRA in training, one process: frozen parameters cost only their storage
(bf16 in a bf16-mixed run, no gradient, no optimiser state) and leave the loss and the trained
gradients as they were; LoRA runs (tiny preset, short windows) start at the base's loss, change
only the adapters, write adapter/ and export/, and compose with recompute, offload and resume."""

from __future__ import annotations

import fnmatch
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open

from genolong.config import load_recipe
from genolong.config.schema import LoraSection
from genolong.evaluation.checkpoint import load_eval_model
from genolong.kernels.testing import rms_ratio
from genolong.model import PRESETS, GenoLM
from genolong.model.lora import adapter_parameters, apply_lora, has_lora, load_adapter, lora_modules
from genolong.model.moe import Experts
from genolong.parallel import parallelize
from genolong.train import GenoLMModule, OptimSettings, read_step_log
from genolong.train.callbacks import held_bytes
from genolong.train.finetune import FinetuneResult, _full_model, _merged_export, run
from genolong.train.module import cast_frozen_parameters, low_precision_parameters
from tests.helpers import assert_bitwise_equal

# bitwise comparisons of losses and gradients: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")

# tiny's geometry cut to three layers (KDA + dense, DSA + MoE, DSA + MoE, the indexer included):
# every kind of block, at a quarter of the cost
_CONFIG = PRESETS["tiny"].replace(num_hidden_layers=3, pattern="KDD", mlp_layer_types=("dense", "sparse", "sparse"))
# everything but layer 1 (a DSA block with its MoE, router and indexer)
_ALL_BUT_LAYER_1 = ("embed_tokens.*", "lm_head.*", "norm.*", "layers.0.*", "layers.2.*")


def _module(freeze: Sequence[str] = (), frozen_dtype: torch.dtype | None = None, **kwargs) -> GenoLMModule:
    """A configured module over the 3-layer model, the same weights every time (seed 0)."""

    def build() -> GenoLM:
        torch.manual_seed(0)
        return GenoLM(_CONFIG)

    module = GenoLMModule(build, OptimSettings(max_steps=10), freeze=freeze, frozen_dtype=frozen_dtype, **kwargs)
    module.configure_model()
    return module


def _tokens(length: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, 5, (1, length), generator=generator)


def _loss_and_grads(module: GenoLMModule, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss (NLL mean + indexer KL) of one batch and the gradients it gives."""
    with pytest.warns(UserWarning, match="self.log"):  # no trainer: Lightning warns that nothing is logged
        loss = module.training_step({"tokens": tokens}, 0)
    assert loss is not None
    loss.backward()
    assert module.model is not None
    return loss.detach(), {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}


def test_freezing_all_but_one_block_keeps_the_loss_and_its_gradients() -> None:
    """Issue 26's exactness check: every parameter frozen but layer 1's; the loss and layer 1's
    gradients equal those of full training (fp32, CPU), and nothing else gets a gradient."""
    tokens = _tokens()
    full, full_grads = _loss_and_grads(_module(), tokens)
    frozen_module = _module(freeze=_ALL_BUT_LAYER_1)
    frozen, grads = _loss_and_grads(frozen_module, tokens)
    assert_bitwise_equal(frozen, full, "loss with all but layer 1 frozen")
    assert frozen_module.model is not None
    trained = {n for n, p in frozen_module.model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("layers.1.") for n in trained)
    assert set(grads) == trained  # the frozen parameters got no gradient at all
    # the same backward ops over the same values: bitwise (one thread)
    assert_bitwise_equal(grads, {n: full_grads[n] for n in trained}, "layer 1's gradients")


def test_low_precision_rule() -> None:
    """Which parameters a frozen bf16-mixed run may hold in bf16: linear and expert matrices, not
    the embedding, norms, router, convolution, KDA gate, mHC or indexer pooling parameters."""
    model = GenoLM(_CONFIG)
    low = set(low_precision_parameters(model))
    linear = {
        f"{m}.{n}"
        for m, mod in model.named_modules()
        if isinstance(mod, (torch.nn.Linear, Experts))
        for n, _ in mod.named_parameters(recurse=False)
    }
    assert low == linear
    for name in (
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.experts.gate_up_proj",
        "layers.1.mlp.experts.down_proj",
        "layers.1.self_attn.kv_b_proj.weight",
        "lm_head.weight",
        "layers.1.mlp.shared_experts.down_proj.weight",
    ):
        assert name in low, name
    for name in (
        "embed_tokens.weight",
        "norm.weight",
        "layers.1.mlp.gate.weight",
        "layers.0.self_attn.conv1d.weight",
        "layers.0.self_attn.forget_gate.A_log",
        "layers.0.self_attn.forget_gate.dt_bias",
        "layers.0.attn_hc.base",
        "layers.0.attn_hc.scale",
        "layers.0.attn_hc.fn",
        "layers.1.self_attn.indexer.index_kpool_compress_gate",
        "layers.0.input_layernorm.weight",
    ):
        assert name not in low, name


def test_frozen_bf16_storage_leaves_the_autocast_step_unchanged() -> None:
    """In a bf16-mixed step (autocast) the frozen weights stored in bf16 give the same loss and
    trained gradients, bit for bit, as fp32 masters that autocast casts; frozen parameters are
    bf16 where the rule allows, trained ones fp32, and :func:`held_bytes` counts that."""
    freeze = (
        "embed_tokens.*",
        "lm_head.*",
        "norm.*",
        "layers.*.mlp.*",
        "layers.*.attn_hc.*",
        "layers.*.ffn_hc.*",
        "layers.*.input_layernorm.*",
        "layers.*.post_attention_layernorm.*",
    )  # the quickstart's: attention trains
    tokens = _tokens()
    master = _module(freeze=freeze)
    stored = _module(freeze=freeze, frozen_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_master, grads_master = _loss_and_grads(master, tokens)
        loss_stored, grads_stored = _loss_and_grads(stored, tokens)
    assert_bitwise_equal(loss_stored, loss_master, "bf16-mixed loss with bf16 frozen weights")
    assert_bitwise_equal(grads_stored, grads_master, "bf16-mixed trained gradients with bf16 frozen weights")
    assert stored.model is not None and master.model is not None
    low = set(low_precision_parameters(stored.model))
    expected = {"trained": 0, "frozen": 0, "trained_n": 0, "frozen_n": 0}
    for name, param in stored.model.named_parameters():
        if param.requires_grad:
            assert param.dtype == torch.float32, name
            expected["trained"] += 4 * param.numel()
            expected["trained_n"] += param.numel()
        else:
            assert param.dtype == (torch.bfloat16 if name in low else torch.float32), name
            expected["frozen"] += (2 if name in low else 4) * param.numel()
            expected["frozen_n"] += param.numel()
    params = dict(stored.model.named_parameters())
    assert params["layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16  # frozen, a matmul's: bf16
    assert params["layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # trained: fp32
    assert params["embed_tokens.weight"].dtype == torch.float32  # frozen, a lookup: fp32
    held = held_bytes(stored.model)
    assert held["memory/trained_parameter_bytes"] == expected["trained"] == held["memory/gradient_bytes"]
    assert held["memory/frozen_parameter_bytes"] == expected["frozen"]
    assert held["memory/parameter_bytes"] == expected["trained"] + expected["frozen"]
    assert held["params/trained"] == expected["trained_n"] and held["params/frozen"] == expected["frozen_n"]
    assert held["memory/optimizer_bytes"] == 0
    # the same model held in fp32: the frozen bytes are larger by 2 per cast element
    cast = sum(p.numel() for n, p in master.model.named_parameters() if n in low and not p.requires_grad)
    assert held_bytes(master.model)["memory/frozen_parameter_bytes"] == expected["frozen"] + 2 * cast
    # the optimiser holds the trained parameters only: AdamW's two fp32 moments and a 0-d step each
    optimizer = torch.optim.AdamW([p for p in stored.model.parameters() if p.requires_grad])
    optimizer.step()
    n_trained = sum(1 for p in stored.model.parameters() if p.requires_grad)
    assert held_bytes(stored.model, [optimizer])["memory/optimizer_bytes"] == 2 * expected["trained"] + 4 * n_trained
    # trained parameters are never cast, and a second cast changes nothing
    assert cast_frozen_parameters(stored.model, torch.bfloat16) == 0


# -- LoRA: the module -------------------------------------------------------------------------------
_LORA = LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0)


def _lora_module(**techniques: Any) -> GenoLMModule:
    """The 3-layer model with adapters on every attention linear, B made non-zero (as after some
    training: with B = 0 no gradient reaches A, and recompute would be checked on half of them)."""
    module = _module(
        lora=_LORA, parallelize=(lambda model, mesh: parallelize(model, **techniques)) if techniques else None
    )
    assert module.model is not None
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for lora in lora_modules(module.model).values():
            lora.lora_B.weight.copy_(0.01 * torch.randn(lora.lora_B.weight.shape, generator=generator))
    return module


def test_lora_step_zero_is_the_base() -> None:
    """Adapters with B = 0 (as initialised): the loss equals the base model's bitwise, only the
    adapters are trainable, and with B = 0 only the B matrices get a (non-zero) gradient."""
    tokens = _tokens()
    base, _ = _loss_and_grads(_module(), tokens)
    module = _module(lora=_LORA)
    loss, grads = _loss_and_grads(module, tokens)
    assert_bitwise_equal(loss, base, "the step-0 loss of a LoRA model")
    assert module.model is not None
    adapters = set(adapter_parameters(module.model))
    assert {n for n, p in module.model.named_parameters() if p.requires_grad} == adapters
    assert set(module.lora_modules) == set(lora_modules(module.model)) and module.lora_modules
    assert set(grads) <= adapters
    assert all(float(g.abs().max()) > 0 for n, g in grads.items() if ".lora_B." in n)
    assert all(float(g.abs().max()) == 0 for n, g in grads.items() if ".lora_A." in n)  # exact: B = 0 in the chain rule


def test_lora_turns_the_routing_bias_update_off(caplog: pytest.LogCaptureFixture) -> None:
    """Under LoRA the routing biases are base state: the module says once that their update is
    off, and a step's balancing leaves them as they are (without LoRA it moves them)."""
    with caplog.at_level(logging.INFO, logger="genolong"):
        module = _module(lora=_LORA)
    assert [r.getMessage() for r in caplog.records if "routing-bias update" in r.getMessage()] == [
        "genolong: the MoE routing-bias update (train.moe_bias_update_rate 0.001) is off under model.lora: "
        "the routing biases are base state, and the adapter must describe the whole change"
    ]
    plain = _module()
    for m in (module, plain):
        _loss_and_grads(m, _tokens())
        m._balance_experts()
    assert plain.model is not None and module.model is not None
    before = _module().model.state_dict()  # type: ignore[union-attr]
    bias = "layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(module.model.state_dict()[bias], before[bias])  # exact: untouched
    assert not torch.equal(plain.model.state_dict()[bias], before[bias])


_TECHNIQUES: dict[str, dict[str, Any]] = {
    "selective": {"recompute": "selective", "recompute_modules": ("kda", "dsa")},
    "selective-attn": {"recompute": "selective"},
    "full": {"recompute": "full"},
    "offload": {"offload": True, "offload_min_bytes": 0},
    "full+offload": {"recompute": "full", "offload": True, "offload_min_bytes": 0},
}


def test_lora_under_every_recompute_mode_and_offload() -> None:
    """With adapters on every attention linear: selective, full, offload give the loss and the
    adapter gradients of no recompute bitwise (tests/parallel/test_memory.py's exact techniques);
    ``chunked`` (segmented attention halves, in 128-token chunks of 192 tokens) within fp32
    rounding, the bound of tests/parallel/test_recompute_chunked.py."""
    tokens = _tokens(192)
    none, none_grads = _loss_and_grads(_lora_module(), tokens)
    assert len(none_grads) == 2 * len(lora_modules(_lora_module().model))  # type: ignore[arg-type]
    for name, techniques in _TECHNIQUES.items():
        loss, grads = _loss_and_grads(_lora_module(**techniques), tokens)
        assert_bitwise_equal(loss, none, f"LoRA loss under {name}")
        assert_bitwise_equal(grads, none_grads, f"LoRA gradients under {name}")
    loss, grads = _loss_and_grads(_lora_module(recompute="chunked", recompute_chunk_tokens=128), tokens)
    wide_module = _lora_module()
    assert wide_module.model is not None
    wide_module.model.double()
    _, wide = _loss_and_grads(wide_module, tokens)
    # the segmented halves change the float summation order (tests/parallel/test_recompute_chunked.py)
    torch.testing.assert_close(loss, none, rtol=1e-6, atol=0.0)
    assert grads.keys() == none_grads.keys()
    for n, g in none_grads.items():
        error, rounding = rms_ratio(g, grads[n]), rms_ratio(wide[n], g)
        assert error < max(2e-6, 2 * rounding), (n, error, rounding)


def test_merged_export_keeps_the_update_of_a_bf16_base() -> None:
    """A bf16-mixed LoRA run holds the adapted base weights in bf16 (linear layers and routed
    experts): the export merges them in fp32 (a bf16 sum would round the small update away), from
    a copy that leaves the live model as it was."""
    section = LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0, routed_experts=True)
    module = _module(lora=section)
    assert module.model is not None
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in adapter_parameters(module.model).items():
            if ".lora_B." in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    cast_frozen_parameters(module.model, torch.bfloat16)
    lora = lora_modules(module.model)["layers.1.self_attn.kv_b_proj"]
    experts = module.model.get_submodule("layers.1.mlp.experts")
    assert (
        lora.base.weight.dtype == experts.down_proj.dtype == torch.bfloat16
        and lora.lora_A.weight.dtype == torch.float32
    )
    with torch.no_grad():
        expected = {
            "layers.1.self_attn.kv_b_proj.weight": lora.base.weight.double() + lora.delta_weight().double(),
            "layers.1.mlp.experts.down_proj": torch.stack(
                [
                    experts.down_proj[e].double() + experts.lora.delta("down_proj", e).double()
                    for e in range(experts.down_proj.shape[0])
                ]
            ),
        }
    assert all(
        float((w - p.double()).abs().max()) > 0
        for w, p in zip(expected.values(), (lora.base.weight, experts.down_proj))
    )
    copy = _full_model(module.model, section)
    assert copy is not None
    merged = dict(_merged_export(copy).named_parameters())
    assert not has_lora(copy)
    for name, want in expected.items():
        assert merged[name].dtype == torch.float32, name
        torch.testing.assert_close(merged[name].double(), want, rtol=1e-6, atol=1e-7)  # fp32 rounding of the sum
    # the live model is untouched: still adapted, its bases still the bf16 ones
    assert (
        lora_modules(module.model)["layers.1.self_attn.kv_b_proj"] is lora and lora.base.weight.dtype == torch.bfloat16
    )
    assert experts.down_proj.dtype == torch.bfloat16 and has_lora(module.model)


# -- LoRA: whole runs (Lightning, in this process) -------------------------------------------------
_STEPS = 4


def _recipe(path: Path, store: Path, root: Path, **sections: dict[str, Any]) -> Path:
    """A tiny LoRA recipe on the sample store: 64-token windows, 4 steps, a checkpoint every 2
    steps (both kept), outputs under ``root``; ``sections`` update it."""
    recipe: dict[str, Any] = {
        "name": root.name,
        "seed": 3,
        "model": {"preset": "tiny", "lora": {"targets": ["layers.*.self_attn.*"], "rank": 4, "alpha": 8.0}},
        "data": {"store": str(store), "context": 64},
        "train": {"max_steps": _STEPS, "lr": 2.0e-3, "warmup_steps": 0, "moe_bias_update_rate": 0.01},
        "eval": {"every_n_steps": 0},
        "checkpoint": {"dir": str(root / "checkpoints"), "every_n_steps": 2, "keep_last": 2},
        "logging": {"dir": str(root / "logs"), "progress_bar": False, "tensorboard": False, "csv": False},
        "parallel": {"accelerator": "cpu"},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    path.write_text(yaml.safe_dump(recipe))
    return path


def _run(recipe: Path | Any, resume: bool = False) -> FinetuneResult:
    """``genolong finetune`` in this process on one torch thread: Lightning's launcher sets
    ``torch.set_num_threads(cores)`` (and OMP_NUM_THREADS) unless OMP_NUM_THREADS is set, and the
    runs' losses are compared bit for bit."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            return run(load_recipe(recipe) if isinstance(recipe, Path) else recipe, resume=resume)
        finally:
            torch.set_num_threads(threads)


def _fresh(seed: int = 3, lora: LoraSection | None = None) -> GenoLM:
    """The model a run of the recipe starts from (finetune's _build_model, then apply_lora)."""
    torch.manual_seed(seed)
    model = GenoLM(PRESETS["tiny"], moe_chunk_tokens=4096)
    if lora is not None:
        apply_lora(model, lora)
    return model


@pytest.fixture(scope="module")
def lora_run(sample_store: Path, tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> tuple[Path, Path]:
    """A 4-step LoRA run: (its recipe, its root runs/lora/)."""
    base = tmp_path_factory.mktemp("lora_run")
    root = base / "runs" / "lora"
    recipe = _recipe(base / "lora.yaml", sample_store, root)
    result = _run(recipe)
    assert result.global_step == _STEPS and result.adapter == root / "adapter" and result.export == root / "export"
    return recipe, root


def test_lora_run_trains_the_adapters_only(lora_run: tuple[Path, Path]) -> None:
    """After training, every base tensor (the routing biases included: their update is off under
    LoRA) equals the starting model's bitwise, and every adapter moved."""
    _, root = lora_run
    state = torch.load(root / "checkpoints" / f"step{_STEPS:07d}.ckpt", weights_only=True)["state_dict"]
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    model = _fresh(lora=LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0))
    start = model.state_dict()
    assert state.keys() == start.keys()
    base = [n for n in start if ".lora_" not in n]
    adapters = [n for n in start if ".lora_" in n]
    assert any("e_score_correction_bias" in n for n in base) and len(adapters) == 2 * len(lora_modules(model)) > 0
    assert_bitwise_equal({n: state[n] for n in base}, {n: start[n] for n in base}, "base tensors after LoRA training")
    unchanged = [n for n in adapters if torch.equal(state[n], start[n])]
    assert not unchanged, f"adapters that did not train: {unchanged}"


def test_lora_run_writes_the_adapter_and_the_merged_export(lora_run: tuple[Path, Path]) -> None:
    """adapter/ in the PEFT layout and export/ a plain model: the export, loaded as a plain GenoLM,
    gives the logits of the base with the adapter loaded (to fp32 rounding: the merged weight
    W + s B A is rounded once where the adapter model adds two products), and the adapter holds
    the last checkpoint's adapters exactly."""
    _, root = lora_run
    assert sorted(p.name for p in (root / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "checksums.json",
    ]
    with safe_open(str(root / "adapter" / "adapter_model.safetensors"), framework="pt") as f:  # PEFT's key names
        assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in set(f.keys())
    merged = GenoLM.from_pretrained(root / "export")
    assert not has_lora(merged)
    adapted = _fresh()
    section = load_adapter(adapted, root / "adapter")
    assert section.rank == 4 and section.alpha == 8.0
    state = torch.load(root / "checkpoints" / f"step{_STEPS:07d}.ckpt", weights_only=True)["state_dict"]
    for name, param in adapter_parameters(adapted).items():
        assert torch.equal(param, state[f"model.{name}"]), name  # exact: the same tensors
    tokens = _tokens(128)
    with torch.no_grad():
        want, got = adapted(tokens), merged(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 rounding of the merge (see docstring)
    assert not torch.equal(want, _fresh()(tokens).detach())  # and the adapters changed the model


def test_lora_resume_past_a_damaged_checkpoint_is_exact(
    lora_run: tuple[Path, Path], sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped after its step-4 checkpoint was damaged (truncated): --resume says so, goes
    back to step 2, and steps 3 and 4 repeat the uninterrupted run's losses bit for bit, ending
    at the same adapters (the kill itself: tests/train/test_finetune.py's SIGKILL test; the checkpoint
    holds the whole model, as without LoRA)."""
    _, straight = lora_run
    root = tmp_path / "runs" / "lora"
    shutil.copytree(straight / "checkpoints", root / "checkpoints")
    newest = root / "checkpoints" / f"step{_STEPS:07d}.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    recipe = load_recipe(_recipe(tmp_path / "lora.yaml", sample_store, root))
    capsys.readouterr()
    result = _run(recipe, resume=True)
    assert f"step{_STEPS:07d}.ckpt is damaged (truncated" in capsys.readouterr().err
    assert result.resumed_from == root / "checkpoints" / "step0000002.ckpt" and result.global_step == _STEPS
    a, b = read_step_log(straight / "logs" / "steps.jsonl"), read_step_log(root / "logs" / "steps.jsonl")
    assert sorted(b) == [3, 4]
    for step in (3, 4):  # one thread, the same arithmetic: bitwise
        assert b[step]["train/loss"] == a[step]["train/loss"], (step, a[step]["train/loss"], b[step]["train/loss"])
    want, got = _fresh(), _fresh()
    load_adapter(want, straight / "adapter")
    load_adapter(got, root / "adapter")
    assert_bitwise_equal(adapter_parameters(got), adapter_parameters(want), "adapters of the resumed run")


def test_lora_run_logs_what_it_holds(lora_run: tuple[Path, Path]) -> None:
    """The logged parameter, gradient and optimiser bytes of a LoRA run: what its checkpoint
    holds (counted from the checkpoint's tensors, not by the logging code)."""
    _, root = lora_run
    checkpoint = torch.load(root / "checkpoints" / f"step{_STEPS:07d}.ckpt", weights_only=True)
    state = {n.removeprefix("model."): t for n, t in checkpoint["state_dict"].items()}
    params = dict(_fresh(lora=LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0)).named_parameters())
    trained = [n for n in params if ".lora_" in n]
    nbytes = {
        kind: sum(state[n].numel() * state[n].element_size() for n in names)
        for kind, names in (("trained", trained), ("frozen", [n for n in params if n not in trained]))
    }
    moments = [t for s in checkpoint["optimizer_states"][0]["state"].values() for t in s.values()]
    record = read_step_log(root / "logs" / "steps.jsonl")[_STEPS]
    assert record["memory/trained_parameter_bytes"] == nbytes["trained"] == record["memory/gradient_bytes"]
    assert record["memory/frozen_parameter_bytes"] == nbytes["frozen"]
    assert record["memory/parameter_bytes"] == nbytes["trained"] + nbytes["frozen"]
    assert (
        record["memory/optimizer_bytes"]
        == sum(t.numel() * t.element_size() for t in moments)
        == 2 * nbytes["trained"] + 4 * len(trained)
    )
    assert record["params/trained"] == sum(params[n].numel() for n in trained)
    assert (
        record["params/frozen"] == sum(p.numel() for n, p in params.items() if n not in trained) == 507332
    )  # the tiny base


def test_bf16_mixed_freeze_run_holds_frozen_weights_in_bf16(sample_store: Path, tmp_path: Path) -> None:
    """A bf16-mixed run with model.freeze: its checkpoint holds the frozen linear and expert
    matrices in bf16 and everything trained in fp32, and the logged bytes are the checkpoint's."""
    root = tmp_path / "runs" / "bf16"
    freeze = ["embed_tokens.*", "layers.*.mlp.*"]
    recipe = _recipe(
        tmp_path / "bf16.yaml",
        sample_store,
        root,
        model={"lora": None, "freeze": freeze},
        train={"max_steps": 2, "precision": "bf16-mixed"},
        checkpoint={"every_n_steps": 2, "export_safetensors": False},
    )
    _run(recipe)
    checkpoint = torch.load(root / "checkpoints" / "step0000002.ckpt", weights_only=True)
    state = {n.removeprefix("model."): t for n, t in checkpoint["state_dict"].items()}
    fresh = _fresh()
    low = set(low_precision_parameters(fresh))
    frozen = {n for n, _ in fresh.named_parameters() if any(fnmatch.fnmatchcase(n, g) for g in freeze)}
    trained = {n for n, _ in fresh.named_parameters()} - frozen
    for name in frozen:
        assert state[name].dtype == (torch.bfloat16 if name in low else torch.float32), name
    assert all(state[n].dtype == torch.float32 for n in trained)
    assert (
        state["layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
        and state["embed_tokens.weight"].dtype == torch.float32
    )
    record = read_step_log(root / "logs" / "steps.jsonl")[2]
    nbytes = {
        kind: sum(state[n].numel() * state[n].element_size() for n in names)
        for kind, names in (("trained", trained), ("frozen", frozen))
    }
    assert record["memory/trained_parameter_bytes"] == nbytes["trained"] == record["memory/gradient_bytes"]
    assert record["memory/frozen_parameter_bytes"] == nbytes["frozen"]
    moments = [t for s in checkpoint["optimizer_states"][0]["state"].values() for t in s.values()]
    assert (
        record["memory/optimizer_bytes"]
        == sum(t.numel() * t.element_size() for t in moments)
        == 2 * nbytes["trained"] + 4 * len(trained)
    )
    assert record["params/frozen"] == sum(state[n].numel() for n in frozen)


def test_a_lora_runs_checkpoint_scores_as_its_export(lora_run: tuple[Path, Path]) -> None:
    """``genolong evaluate runs/NAME/checkpoints/step*.ckpt`` of a LoRA run: the checkpoint holds the
    adapted model's names, so the loader applies the recipe's adapters before reading it and merges
    them after; at the last step that is the run's export/ bitwise (the same fp32 merge)."""
    _, root = lora_run
    scored, _ = load_eval_model(root / "checkpoints" / f"step{_STEPS:07d}.ckpt")
    assert not has_lora(scored)
    exported = GenoLM.from_pretrained(root / "export").state_dict()
    assert_bitwise_equal(scored.state_dict(), exported, "the LoRA checkpoint's merged model vs export/")


def test_several_processes_refuse_a_lora_runs_sharded_checkpoint(
    lora_run: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The multi-process scoring loader shards a plain model; a LoRA run's sharded checkpoint holds
    adapters beside the base, so it is refused in one line that names the ways to score it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from genolong.errors import InputError
    from genolong.evaluation import distributed

    _, root = lora_run
    recipe = torch.load(root / "checkpoints" / f"step{_STEPS:07d}.ckpt", weights_only=True)["genolong"]["recipe"]
    sharded = tmp_path / "step0000004.ckpt"  # the layout of a multi-process run's DCP checkpoint directory
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming one process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": {"model.norm.weight": torch.ones(4)}}, checkpoint_id=sharded, no_dist=True)
    torch.save({"genolong": {"recipe": recipe}}, sharded / "meta.pt")
    monkeypatch.setattr(distributed.ScoringGroup, "distributed", property(lambda self: True))
    with pytest.raises(InputError, match=r"LoRA run's checkpoint .* --adapter runs/NAME/adapter"):
        distributed.load_scoring_model(sharded, distributed.ScoringGroup())

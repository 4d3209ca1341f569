"""The GLM-5.3-Flash checkpoint format: round trips, sharding, dtypes, and every bad checkpoint.

(genolong vs transformers through checkpoint files, both ways, is in tests/model/test_model_lm.py.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from genolong.errors import InputError
from genolong.kernels.backends import available_backends, get_backend
from genolong.model import PRESETS, GenoLM
from genolong.model.hf import FP32_TENSORS, checkpoint_layout

_CONFIG = PRESETS["tiny"].replace(
    num_hidden_layers=4,
    pattern="KKDD",
    indexer_types=("full", "full", "full", "shared"),
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
)


@pytest.fixture()
def model() -> GenoLM:
    torch.manual_seed(3)
    model = GenoLM(_CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for b in model.buffers():
            b.normal_(0, 0.05)
    return model


def _keys(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def _assert_same(a: GenoLM, b: GenoLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key  # exact: weights written and read back, not computed


def test_round_trip_sharded(model: GenoLM, tmp_path: Path) -> None:
    """Original-format names (per expert, split convolutions, hc_* and forget-gate renames), many
    shards with an index, and an exact round trip."""
    out = model.save_pretrained(tmp_path / "ckpt", max_shard_bytes=50_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    keys = _keys(out)
    prefix = "model.language_model.layers."
    assert keys[prefix + "1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert keys[prefix + "1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert keys[prefix + "0.self_attn.v_conv1d.weight"] == (64, 1, 4)
    assert prefix + "0.hc_attn_fn" in keys and prefix + "0.self_attn.A_log" in keys and "lm_head.weight" in keys
    assert not any("gate_up_proj" in k or "forget_gate" in k or ".conv1d." in k for k in keys)
    assert sum(torch.Size(s).numel() for s in keys.values()) == sum(p.numel() for p in model.state_dict().values())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "glm5_next" and config["text_config"]["num_hidden_layers"] == 4
    _assert_same(model, GenoLM.from_pretrained(out))


def test_expert_and_conv_slices_land_in_place(model: GenoLM, tmp_path: Path) -> None:
    out = model.save_pretrained(tmp_path / "ckpt")
    tensors = load_file(out / "model.safetensors")
    experts = model.layers[1].mlp.experts
    half = experts.gate_up_proj.shape[1] // 2
    # exact: a saved slice
    assert torch.equal(
        tensors["model.language_model.layers.1.mlp.experts.2.up_proj.weight"], experts.gate_up_proj[2, half:]
    )
    conv = model.layers[0].self_attn.conv1d.weight
    # exact: a saved slice
    assert torch.equal(tensors["model.language_model.layers.0.self_attn.k_conv1d.weight"], conv[64:128])


def test_fused_names_load_too(model: GenoLM, tmp_path: Path) -> None:
    """transformers' save_original_format=False writes its in-memory (fused) names: also read."""
    directory = tmp_path / "fused"
    directory.mkdir()
    state = {
        ("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k): v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    _assert_same(model, GenoLM.from_pretrained(directory))


def test_bf16_export_keeps_fp32_tensors(model: GenoLM, tmp_path: Path) -> None:
    out = model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    tensors = load_file(out / "model.safetensors")
    kept = {k for k in tensors if FP32_TENSORS.search(k)}
    assert kept and all(tensors[k].dtype == torch.float32 for k in kept)
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k not in kept)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = GenoLM.from_pretrained(out, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    # exact: the same elementwise rounding to bf16, saved and read back
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_save_replaces_a_checkpoint_atomically(model: GenoLM, tmp_path: Path) -> None:
    out = model.save_pretrained(tmp_path / "ckpt", max_shard_bytes=50_000)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(out)  # one file now: the old shards must be gone
    assert sorted(p.name for p in out.iterdir()) == ["checksums.json", "config.json", "model.safetensors"]
    _assert_same(model, GenoLM.from_pretrained(out))
    # a failure half-way leaves the previous checkpoint and no temporary directory
    with pytest.raises(FileNotFoundError):
        model.save_pretrained(out, copy_files=[tmp_path / "no-such-tokenizer.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_same(model, GenoLM.from_pretrained(out))


def test_refuses_to_replace_a_non_checkpoint(model: GenoLM, tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a checkpoint directory"):
        model.save_pretrained(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_copy_files_travel(model: GenoLM, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    out = model.save_pretrained(tmp_path / "ckpt", copy_files=[tokenizer])
    assert (out / "tokenizer.json").read_text() == "{}"


# -- bad checkpoints -------------------------------------------------------------------------------
@pytest.fixture()
def sharded(model: GenoLM, tmp_path: Path) -> Path:
    """A sharded checkpoint as downloaded: no genolong checksum manifest, so that the tests below
    edit its shards and reach the loader's own checks (tests/train/test_damaged_files.py checks the manifest)."""
    out = model.save_pretrained(tmp_path / "ckpt", max_shard_bytes=50_000)
    (out / "checksums.json").unlink()
    return out


def test_missing_shard(sharded: Path) -> None:
    victim = sorted(sharded.glob("model-*.safetensors"))[2]
    victim.unlink()
    with pytest.raises(InputError, match=f"shard {victim.name} listed in model.safetensors.index.json is missing"):
        GenoLM.from_pretrained(sharded)


def test_no_weights(tmp_path: Path) -> None:
    _CONFIG.save_pretrained(tmp_path)
    with pytest.raises(InputError, match="has neither model.safetensors.index.json nor model.safetensors"):
        GenoLM.from_pretrained(tmp_path)


def _rewrite(directory: Path, change) -> None:
    """Apply ``change(tensors)`` to the shard holding layer 1's q_proj and fix the index."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.language_model.layers.1.self_attn.q_proj.weight"
    file = directory / index["weight_map"][name]
    tensors = load_file(file)
    change(tensors, name)
    save_file(tensors, file, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file.name}
    index["weight_map"].update(dict.fromkeys(tensors, file.name))
    index_path.write_text(json.dumps(index))


def test_shape_mismatch_names_the_tensor(sharded: Path) -> None:
    _rewrite(sharded, lambda t, name: t.__setitem__(name, torch.zeros(32, 64)))
    with pytest.raises(
        InputError,
        match=r"layers\.1\.self_attn\.q_proj\.weight in model-\d+-of-\d+\.safetensors has shape \[32, 64\] but .* expects \[64, 64\]",
    ):
        GenoLM.from_pretrained(sharded)


def test_missing_tensor(sharded: Path) -> None:
    _rewrite(sharded, lambda t, name: t.pop(name))
    with pytest.raises(
        InputError, match=r"lacks 1 tensor\(s\) the model needs, first layers\.1\.self_attn\.q_proj\.weight"
    ):
        GenoLM.from_pretrained(sharded)


def test_unexpected_tensor(sharded: Path) -> None:
    _rewrite(
        sharded,
        lambda t, name: t.__setitem__("model.language_model.layers.1.self_attn.q_proj.weight_scale_inv", torch.ones(2)),
    )
    with pytest.raises(InputError, match=r"q_proj\.weight_scale_inv .* has no place in GenoLM"):
        GenoLM.from_pretrained(sharded)


def test_unsupported_architecture(sharded: Path) -> None:
    config = json.loads((sharded / "config.json").read_text())
    config["model_type"] = "llama"
    (sharded / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="unsupported architecture: model_type 'llama'"):
        GenoLM.from_pretrained(sharded)


def test_config_of_another_shape(sharded: Path) -> None:
    config = json.loads((sharded / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 16
    (sharded / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"mlp\.experts\.0\.gate_proj\.weight in .* has shape \[32, 64\] but .* expects \[16, 64\]"
    ):
        GenoLM.from_pretrained(sharded)


def test_layout_covers_every_element(model: GenoLM) -> None:
    """Each GenoLM tensor is covered exactly once by the checkpoint layout."""
    state = model.state_dict()
    covered = {k: torch.zeros_like(v, dtype=torch.int32) for k, v in state.items()}
    for entry in checkpoint_layout(model):
        assert tuple(covered[entry.target][entry.index].shape) == entry.shape, entry
        covered[entry.target][entry.index] += 1
    assert all(bool((c == 1).all()) for c in covered.values())


# -- kernel backends -------------------------------------------------------------------------------
def test_backend_registry(caplog: pytest.LogCaptureFixture) -> None:
    assert "torch" in available_backends()
    backend = get_backend("torch")
    assert get_backend("torch") is backend
    with pytest.raises(InputError, match="unknown kernel backend 'cuda-magic'; this build has torch"):
        get_backend("cuda-magic")
    with pytest.raises(InputError, match="kernel_backend 'cuda-magic' is not available"):
        _CONFIG.replace(kernel_backend="cuda-magic")
    assert "kernel_backend" not in _CONFIG.to_hf_dict()
    model = GenoLM(_CONFIG)
    assert model.layers[0].self_attn.kernels is backend and model.layers[2].self_attn.kernels is backend


def test_backend_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from genolong.kernels import backends

    backends._LOADED.pop("torch", None)
    with caplog.at_level(logging.INFO, logger="genolong"):
        GenoLM(_CONFIG)
        GenoLM(_CONFIG)
    assert caplog.text.count("kernel backend 'torch'") == 1

"""The sharded loader (genolong.parallel.load) measured against the world size.

A wide reduced model (:func:`wide_config`: 64 routed experts, 4 layers, a 41 MB bf16 checkpoint;
the experts are 92% of it, as the real model's are 97%) is loaded on 1, 2 and 4 gloo ranks (ep 2
on 2 and 4: experts over the EP group, rows over the FSDP ranks left): every rank's resident-set
peak while loading grows by at most its share of the bf16 weights x 1.25 plus the largest single
checkpoint tensor, and the bytes it reads from the safetensors files are at most its share x 1.25
plus the replicated tensors. Today's path (the whole model in fp32 on every rank, then sharded)
grows by 2 x the whole bf16 checkpoint on every rank: 8 x the bound's share term at 4 ranks,
16 x... so the bounds tell the two apart at every world size above 1 (41 MB: big enough that the
fixed costs of a load, some 100 KB of Python objects, are under the 25% slack at 4 ranks, 2.6 MB).

Each rank also checks the values: its shards equal the same rows of the whole checkpoint read by
:meth:`GenoLM.from_pretrained`. The checkpoint errors (a tensor of another shape, a missing one, an
extra one) are one line naming the tensor.
"""

from __future__ import annotations

import gc
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from genolong.config import ParallelSection
from genolong.errors import InputError
from genolong.model import PRESETS, GenoLM
from genolong.model.config import ModelConfig
from genolong.parallel import parallelize
from genolong.parallel.load import SafetensorsFile, fill_from_safetensors, local_box, materialize
from genolong.parallel.mesh import build_mesh
from tests.helpers import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


def wide_config() -> ModelConfig:
    """64 routed experts, hidden 256, 4 layers (KDA, DSA, KDA, DSA; MoE in the last 3): 20.6M
    parameters, a 41 MB bf16 checkpoint, 92% of it routed experts."""
    return replace(
        PRESETS["tiny"],
        hidden_size=256,
        moe_intermediate_size=128,
        n_routed_experts=64,
        num_hidden_layers=4,
        layer_types=("linear_attention", "indexed_attention", "linear_attention", "indexed_attention"),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        indexer_types=("full",) * 4,
    )


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide model's seeded weights, saved in bf16 (as a released base is)."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("wide") / "base"
    GenoLM(wide_config()).save_pretrained(out, dtype=torch.bfloat16, max_shard_bytes=8 * 10**6)
    return out


def _status(field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _load_rank(rank: int, world: int, checkpoint: str, ep: int, out: str) -> None:
    """One rank: the meta model sharded (ep, FSDP2 over all ranks), then loaded in bf16 while its
    resident-set peak is watched; writes its figures to ``out/rank{rank}.json``."""
    directory = Path(checkpoint)
    config = ModelConfig.from_pretrained(directory)
    mesh = (
        build_mesh(ParallelSection(accelerator="cpu", devices=world, dp_shard=world, ep=ep), world_size=world)
        if world > 1
        else None
    )
    with torch.device("meta"):
        model = GenoLM(config)
    for param in model.parameters():  # every weight in bf16: a frozen base's storage
        param.data = param.data.to(torch.bfloat16)
    if mesh is not None:
        parallelize(model, mesh=mesh, ep=ep)
    headers = [SafetensorsFile(f) for f in sorted(directory.glob("*.safetensors"))]
    largest = max(f.header[n]["data_offsets"][1] - f.header[n]["data_offsets"][0] for f in headers for n in f.header)
    for f in headers:
        f.close()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    before = _status("VmRSS")
    materialize(model, "cpu")
    counter = fill_from_safetensors(model, directory)
    peak = _status("VmHWM")
    state = model.state_dict()
    local = {n: t.to_local() if hasattr(t, "to_local") else t for n, t in state.items()}
    share = sum(t.numel() * t.element_size() for t in local.values())
    # the values: this rank's rows of the whole checkpoint
    whole = GenoLM.from_pretrained(directory, dtype=torch.bfloat16).state_dict()
    for name, tensor in state.items():
        offset, shape = local_box(tensor)
        want = whole[name][tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        assert torch.equal(local[name], want.to(local[name].dtype)), name  # exact: the same bf16 values copied
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "increase": peak - before,
                "share": share,
                "largest": largest,
                "read": counter.bytes,
                "replicated": counter.replicated,
            }
        )
    )
    if world > 1:
        dist.barrier()


def _measure(world: int, ep: int, checkpoint: Path, tmp_path: Path) -> list[dict[str, int]]:
    if world == 1:
        _load_rank(0, 1, str(checkpoint), ep, str(tmp_path))
    else:
        run_ranks(_load_rank, world, tmp_path, str(checkpoint), ep, str(tmp_path), timeout=240.0)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.distributed
@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2), (4, 2)])
def test_each_rank_reads_and_holds_its_share(world: int, ep: int, wide_checkpoint: Path, tmp_path: Path) -> None:
    """Peak RSS increase <= share x 1.25 + the largest tensor; bytes read <= share x 1.25 +
    replicated; the shares sum to the checkpoint (each row read once, whatever the world)."""
    total = sum(f.stat().st_size for f in wide_checkpoint.glob("*.safetensors"))
    ranks = _measure(world, ep, wide_checkpoint, tmp_path)
    for rank, r in enumerate(ranks):
        assert r["increase"] <= 1.25 * r["share"] + r["largest"], (rank, r)
        assert r["read"] <= 1.25 * r["share"] + r["replicated"], (rank, r)
        # the share shrinks with the world (today's path holds the whole fp32 model: 2 x total)
        assert r["share"] <= 1.1 * total / world, (rank, r, total)
    assert sum(r["read"] - r["replicated"] for r in ranks) + ranks[0]["replicated"] <= total


def _base(tmp_path: Path, config: ModelConfig) -> Path:
    torch.manual_seed(0)
    return GenoLM(config).save_pretrained(tmp_path / "base", dtype=torch.bfloat16)


def _meta(config: ModelConfig) -> GenoLM:
    with torch.device("meta"):
        model = GenoLM(config)
    materialize(model, "cpu")
    return model


def test_one_process_load_equals_from_pretrained_and_casts_as_the_run_does(tmp_path: Path) -> None:
    """Without a mesh the loader gives from_pretrained's model bitwise (fp32), and a parameter held
    in bf16 gets the checkpoint's value rounded once, as cast_frozen_parameters rounds it."""
    config = PRESETS["tiny"]
    base = _base(tmp_path, config)
    want = GenoLM.from_pretrained(base).state_dict()
    model = _meta(config)
    fill_from_safetensors(model, base)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name  # exact: both copy the stored values
    with torch.device("meta"):
        low = GenoLM(config)
    low.layers[1].mlp.experts.gate_up_proj.data = low.layers[1].mlp.experts.gate_up_proj.data.to(torch.bfloat16)
    materialize(low, "cpu")
    fill_from_safetensors(low, base)
    got = low.layers[1].mlp.experts.gate_up_proj
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want["layers.1.mlp.experts.gate_up_proj"].to(torch.bfloat16))  # exact: one rounding each


@pytest.mark.parametrize(
    "damage, named",
    [
        ("shape", "model.language_model.layers.0.self_attn.q_proj.weight"),
        ("missing", "model.language_model.layers.0.self_attn.q_proj.weight"),
        ("extra", "model.language_model.layers.0.self_attn.surplus.weight"),
    ],
)
def test_a_checkpoint_that_disagrees_with_the_model_is_one_line_naming_the_tensor(
    tmp_path: Path, damage: str, named: str
) -> None:
    config = PRESETS["tiny"]
    base = _base(tmp_path, config)
    file = base / "model.safetensors"
    tensors = load_file(file)
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    if damage == "shape":
        tensors[key] = tensors[key][:-1]
    elif damage == "missing":
        del tensors[key]
    else:
        tensors[named] = torch.zeros(2)
    (base / "checksums.json").unlink()  # the manifest would name the file as changed first
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(InputError) as error:
        fill_from_safetensors(_meta(config), base)
    message = str(error.value)
    assert named in message and "\n" not in message, message


def test_the_modules_meta_build_equals_todays_model_with_lora_and_bf16_frozen_weights(tmp_path: Path) -> None:
    """GenoLMModule.configure_model with a meta-device build and the sharded loader (one process):
    the same model as today's path (from_pretrained in fp32, LoRA drawn on it from the same seed,
    the frozen base cast to bf16), bitwise: LoRA's adapters drawn on the meta base are kept aside
    while the model is on meta and put back."""
    from functools import partial

    from genolong.config.schema import LoraSection
    from genolong.model.lora import apply_lora
    from genolong.train.module import GenoLMModule, OptimSettings, cast_frozen_parameters

    config = PRESETS["tiny"]
    base = _base(tmp_path, config)
    lora = LoraSection(targets=("layers.*.self_attn.*",), rank=4, alpha=8.0, routed_experts=True)
    torch.manual_seed(3)
    want = GenoLM.from_pretrained(base)
    apply_lora(want, lora)
    cast_frozen_parameters(want, torch.bfloat16)

    def build() -> GenoLM:
        torch.manual_seed(3)
        with torch.device("meta"):
            return GenoLM(config)

    def load(model: GenoLM, kept: dict, device: torch.device) -> None:
        materialize(model, device, kept)
        fill_from_safetensors(model, base)

    module = GenoLMModule(
        build_model=build, optim=OptimSettings(), lora=lora, frozen_dtype=torch.bfloat16, load_weights=partial(load)
    )
    module.configure_model()
    got = module.model.state_dict()
    assert got.keys() == want.state_dict().keys()
    for name, tensor in want.state_dict().items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (
            name
        )  # exact: the same draws and copies

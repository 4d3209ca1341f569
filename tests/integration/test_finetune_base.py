"""`genolong finetune` from a base checkpoint under torchrun (2 gloo ranks, ep 2, FSDP2, bf16-mixed),
attention-only as recipes/1m-node.yaml: what each worker loads and what a checkpoint holds.

One fresh run of 4 steps (checkpoints at 2 and 4), then ``--resume`` from the step-2 checkpoint
alone in another directory:

- each worker's resident-set peak while loading grows by at most its local tensors x 1.25 + the
  largest checkpoint tensor, and it reads at most its share (the sharded loader's own figures,
  ``GENOLONG_LOAD_REPORT``); the resumed workers read less (the trained weights come from the
  checkpoint);
- a save holds the trained parameters and their AdamW state: at most 1.2 x 12 B per trained
  parameter (the frozen weights, 77% of the model, are read from the base again), and the
  planner's figure is its tensors' bytes (to AdamW's step counters); the checkpoint names its
  base (path + digest);
- the resumed steps 3-4 equal the uninterrupted run's losses bitwise (one thread, the same layout);
- a resume against another base is refused in one line; the checkpoint scores in one process with
  the base's frozen weights, and on two ranks (sharded loader + DCP) as in one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from genolong.config import load_recipe
from genolong.evaluation.score import load_eval_model
from genolong.model import GenoLM
from genolong.plan import plan
from genolong.quickstart import bundled_base
from genolong.train import read_step_log
from tests.helpers import run_ranks
from tests.integration.test_finetune_distributed import _finetune

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: recipes/1m-node.yaml's frozen parts: everything but the attention layers trains nothing
_FREEZE = [
    "embed_tokens.*",
    "lm_head.*",
    "norm.*",
    "layers.*.mlp.*",
    "layers.*.attn_hc.*",
    "layers.*.ffn_hc.*",
    "layers.*.input_layernorm.*",
    "layers.*.post_attention_layernorm.*",
]


def _recipe(tmp_path: Path, store: Path, name: str, base: Path) -> Path:
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"checkpoint": str(base), "freeze": _FREEZE},
        "data": {"store": str(store), "context": 128},
        "train": {"max_steps": 4, "lr": 1.0e-3, "warmup_steps": 0, "precision": "bf16-mixed"},
        "eval": {"every_n_steps": 0},
        "checkpoint": {
            "dir": str(tmp_path / "runs" / name / "checkpoints"),
            "every_n_steps": 2,
            "keep_last": 2,
            "export_safetensors": False,
        },
        "logging": {
            "dir": str(tmp_path / "runs" / name / "logs"),
            "progress_bar": False,
            "tensorboard": False,
            "csv": False,
        },
        "parallel": {"accelerator": "cpu", "devices": 2, "dp_shard": 2, "ep": 2},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _reports(directory: Path) -> list[dict[str, int]]:
    return [json.loads((directory / f"load-rank{r}.json").read_text()) for r in range(2)]


def test_a_run_from_a_base_loads_its_share_saves_what_trains_and_resumes_exactly(
    sample_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = bundled_base()
    recipe = _recipe(tmp_path, sample_store, "attn", base)
    monkeypatch.setenv("GENOLONG_LOAD_REPORT", str(tmp_path / "fresh"))
    _finetune(recipe, torchrun=2)
    checkpoints = tmp_path / "runs" / "attn" / "checkpoints"
    # the resumed run: the step-2 checkpoint alone, in its own directory
    resumed = tmp_path / "again"
    resumed.mkdir()
    again = _recipe(resumed, sample_store, "attn", base)
    shutil.copytree(checkpoints / "step0000002.ckpt", resumed / "runs" / "attn" / "checkpoints" / "step0000002.ckpt")
    monkeypatch.setenv("GENOLONG_LOAD_REPORT", str(tmp_path / "resume"))
    _finetune(again, "--resume", torchrun=2)

    # what each worker held and read while loading
    fresh, resume = _reports(tmp_path / "fresh"), _reports(tmp_path / "resume")
    for rank, (f, r) in enumerate(zip(fresh, resume)):
        for figures in (f, r):
            assert figures["increase"] <= 1.25 * figures["share"] + figures["largest"], (rank, figures)
            assert figures["read"] <= 1.25 * figures["share"] + figures["replicated"], (rank, figures)
        assert r["read"] < f["read"], (rank, f, r)  # the trained weights come from the checkpoint on resume
    model_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    assert max(f["read"] for f in fresh) < 0.6 * model_bytes  # each rank about half of the base

    # a save holds what training changes
    parsed = load_recipe(recipe)
    with torch.device("meta"):
        model = GenoLM(parsed.model_config())
    from genolong.train.module import freeze_parameters

    freeze_parameters(model, _FREEZE)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 3 * trained  # a save with them would be 1.55 x the bound below
    step = checkpoints / "step0000004.ckpt"
    saved = sum(p.stat().st_size for p in step.glob("*.distcp"))
    assert saved <= 1.2 * 12 * trained, (saved, trained)
    # the planner counts the tensors' bytes: those DCP's metadata lists (the files add its per-chunk headers)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    listed = FileSystemReader(step).read_metadata().state_dict_metadata.values()
    tensors = sum(m.size.numel() * m.properties.dtype.itemsize for m in listed if isinstance(m, TensorStorageMetadata))
    planned = plan(parsed, gpus=2).checkpoint_bytes
    assert tensors <= saved and abs(planned - tensors) <= 0.001 * tensors, (
        planned,
        tensors,
        saved,
    )  # AdamW's step counters aside
    meta = torch.load(step / "meta.pt", weights_only=True)["genolong"]
    assert meta["base"]["path"] == str(base) and meta["base"]["digest"].startswith("manifest:")

    # the resumed steps equal the uninterrupted run's
    a = read_step_log(tmp_path / "runs" / "attn" / "logs" / "steps.jsonl")
    b = read_step_log(resumed / "runs" / "attn" / "logs" / "steps.jsonl")
    assert sorted(b) == [3, 4]
    for s in (3, 4):  # one thread (OMP_NUM_THREADS=1), the same mesh: bitwise
        assert b[s]["train/loss"] == a[s]["train/loss"], (s, a[s]["train/loss"], b[s]["train/loss"])

    # the checkpoint scores in one process: the frozen weights are the base's, the attention trained
    scored, _ = load_eval_model(step)
    whole = GenoLM.from_pretrained(base).state_dict()
    state = scored.state_dict()
    names = dict(model.named_parameters())
    assert all(
        torch.equal(state[n], whole[n]) for n, p in names.items() if not p.requires_grad
    )  # exact: bf16 base values
    assert any(
        not torch.equal(state[n], whole[n]) for n, p in names.items() if p.requires_grad
    )  # exact: a change either way
    run_ranks(_score_on_two_ranks, 2, tmp_path, str(step), timeout=300.0)  # and on two ranks, sharded


def _score_on_two_ranks(rank: int, world: int, checkpoint: str) -> None:
    """One rank of a 2-process scoring job (ep 2, FSDP2) reading a checkpoint of a run from a base:
    its model equals the one-process loader's whole model, tensor by tensor."""
    from genolong.config import ParallelSection
    from genolong.evaluation.distributed import ScoringGroup, load_scoring_model
    from genolong.parallel.mesh import build_mesh

    parallel = ParallelSection(accelerator="cpu", devices=world, dp_shard=world, ep=2)
    model, _ = load_scoring_model(checkpoint, ScoringGroup(build_mesh(parallel, world_size=world), parallel))
    whole = load_eval_model(checkpoint)[0].state_dict()
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        assert torch.equal(full, whole[name]), name  # exact: the same stored values, gathered


def test_resume_against_another_base_is_one_line(sample_store: Path, tmp_path: Path) -> None:
    """--resume reads the frozen weights from the recipe's base: a base other than the one the
    checkpoint recorded (its digest) is refused before anything loads."""
    from genolong.errors import InputError
    from genolong.train.base import check_same_base as _check_same_base

    step = tmp_path / "step0000002.ckpt"
    step.mkdir()
    torch.save({"genolong": {"base": {"path": "/a/base", "digest": "manifest:1234"}}}, step / "meta.pt")
    _check_same_base(step, {"path": "/a/base", "digest": "manifest:1234"})
    with pytest.raises(
        InputError, match=r"--resume: step0000002.ckpt holds only what training changed on the base /a/base"
    ) as error:
        _check_same_base(step, {"path": "/b/base", "digest": "manifest:9999"})
    assert "\n" not in str(error.value)

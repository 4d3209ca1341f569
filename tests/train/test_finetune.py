"""genolong finetune: a run end to end, exact resume after SIGKILL, atomic checkpoints, guards."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from genolong.data.store import GenomeStore
from genolong.evaluation.score import evaluate, load_eval_model
from genolong.model import GenoLM
from genolong.train import GenoLMModule, NonFiniteLossError, OptimSettings, freeze_parameters, read_step_log
from genolong.train.finetune import AtomicModelParallelStrategy, latest_checkpoint
from tests.helpers import assert_bitwise_equal

# the resume test evaluates both runs' exports here and compares the scores bit for bit: one
# torch thread (issue 13); the runs themselves are children with OMP_NUM_THREADS=1 (_finetune)
pytestmark = pytest.mark.usefixtures("one_thread")

_STEPS = 8


def _recipe(tmp_path: Path, store: Path, name: str, **sections: dict) -> Path:
    """A tiny-model recipe on the sample store, outputs under ``tmp_path/runs/name``."""
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 256},
        "train": {
            "max_steps": _STEPS,
            "lr": 2.0e-3,
            "warmup_steps": 2,
            "moe_balance_loss_weight": 0.1,
            "moe_bias_update": "proportional",
            "moe_bias_update_rate": 0.01,
        },
        "eval": {"every_n_steps": 4, "max_tiles": 1},
        "checkpoint": {"dir": str(tmp_path / "runs" / name / "checkpoints"), "every_n_steps": 2, "keep_last": 2},
        "logging": {"dir": str(tmp_path / "runs" / name / "logs"), "progress_bar": False, "tensorboard": False},
        "parallel": {"accelerator": "cpu"},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _finetune(recipe: Path, *args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "genolong.cli", "finetune", str(recipe), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def straight(sample_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 8-step run (``runs/straight`` beside its recipe; returns the recipe), made
    once for the module: the reference of the kill-and-resume test, and the run whose checkpoints a
    fresh start of the same recipe must refuse to overwrite."""
    root = tmp_path_factory.mktemp("straight")
    recipe = _recipe(root, sample_store, "straight")
    out = _wait(_finetune(recipe, cwd=root))
    assert f"straight: {_STEPS} steps" in out
    return recipe


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_losses(straight: Path, sample_store: Path, tmp_path: Path) -> None:
    """An uninterrupted run and a run killed with SIGKILL after its step-4 checkpoint, then
    resumed with --resume: steps 5..8 have identical losses (CPU, deterministic)."""
    killed = _recipe(tmp_path, sample_store, "killed")

    proc = _finetune(killed, cwd=tmp_path)
    steps_log = tmp_path / "runs" / "killed" / "logs" / "steps.jsonl"
    ckpt_dir = tmp_path / "runs" / "killed" / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        done = read_step_log(steps_log) if steps_log.exists() else {}
        if (ckpt_dir / "step0000004.ckpt").exists() and max(done, default=0) >= 5:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(read_step_log(steps_log))
    assert 5 <= killed_at < _STEPS
    resumed_from = latest_checkpoint(ckpt_dir)
    assert resumed_from is not None and not list(ckpt_dir.glob("*.tmp"))

    _wait(_finetune(killed, "--resume", cwd=tmp_path))
    a = read_step_log(straight.parent / "runs" / "straight" / "logs" / "steps.jsonl")
    b = read_step_log(steps_log)
    assert sorted(a) == sorted(b) == list(range(1, _STEPS + 1))
    first = int(resumed_from.stem.removeprefix("step")) + 1
    assert first <= killed_at  # some steps were redone after the kill
    routing = [
        f"moe/layer{i}/{what}"
        for i in range(1, 8)
        for what in ("load_max_over_mean", "dead_fraction", "router_entropy")
    ]
    routing += ["train/moe_balance_loss", "train/moe_dead_experts", "train/moe_load_max_over_mean"]
    for step in range(1, _STEPS + 1):  # both runs single-threaded (OMP_NUM_THREADS=1): bitwise
        assert b[step]["train/loss"] == a[step]["train/loss"], (step, a[step]["train/loss"], b[step]["train/loss"])
        # the routing statistics of every MoE layer (tiny: layers 1-7), the same after the resume
        # (the routing biases are in the checkpoint)
        for key in routing:
            assert b[step][key] == a[step][key], (step, key, a[step][key], b[step][key])
    assert 0.9 < a[_STEPS]["train/moe_balance_loss"] < 2.0  # sum_i f_i P_i: 1.0 at uniform routing
    # the exported models are identical too
    sa = GenoLM.from_pretrained(straight.parent / "runs" / "straight" / "export").state_dict()
    sb = GenoLM.from_pretrained(tmp_path / "runs" / "killed" / "export").state_dict()
    assert_bitwise_equal(sb, sa, "the killed-and-resumed run's export")
    # checkpoints hold plain data only
    checkpoint = torch.load(resumed_from, weights_only=True)
    assert checkpoint["genolong"]["recipe"]["name"] == "killed" and "GenomeDataModule" in checkpoint
    # evaluating the killed-and-resumed run gives the same tables as evaluating the uninterrupted one
    split = GenomeStore.open(sample_store).split("eval")
    results = []
    for name, root in (("straight", straight.parent), ("killed", tmp_path)):
        model, vocab = load_eval_model(root / "runs" / name)  # a run directory: its export/
        assert vocab is None
        results.append(
            evaluate(model, split, tmp_path / f"eval-{name}", 256, max_tiles=3, first_bucket=64, progress=False)
        )
    assert results[0].fingerprint == results[1].fingerprint
    assert_bitwise_equal(results[1].tile_nll, results[0].tile_nll, "tile NLL of the resumed run")
    assert_bitwise_equal(results[1].position_nll, results[0].position_nll, "position NLL of the resumed run")
    # the last Lightning checkpoint (with the recipe inside) loads as the same model as the export
    from_ckpt, _ = load_eval_model(latest_checkpoint(ckpt_dir))
    sc = from_ckpt.state_dict()
    # exact: the same weights, in the checkpoint and in the export
    assert sc.keys() == sb.keys() and all(torch.equal(sc[k], sb[k]) for k in sb)


def test_resume_needs_a_checkpoint_and_fresh_runs_refuse_old_ones(
    straight: Path, sample_store: Path, tmp_path: Path
) -> None:
    recipe = _recipe(
        tmp_path,
        sample_store,
        "once",
        train={"max_steps": 2, "warmup_steps": 0},
        eval={"every_n_steps": 0},
        checkpoint={"every_n_steps": 2, "export_safetensors": False},
    )
    proc = _finetune(recipe, "--resume", cwd=tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "--resume: nothing to resume in" in err and len(err.strip().splitlines()) == 1
    # a fresh start of a recipe whose run already wrote checkpoints (the module's straight run): refused,
    # and nothing of that run touched
    run_dir = straight.parent / "runs" / "straight"
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    proc = _finetune(straight, cwd=straight.parent)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "already holds checkpoints (step0000008.ckpt); pass --resume" in err, err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_store_of_another_alphabet(sample_store: Path, tmp_path: Path) -> None:
    import shutil

    store = tmp_path / "store"
    shutil.copytree(sample_store, store)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["alphabet"] = {**manifest["alphabet"], "1": "U"}
    (store / "manifest.json").write_text(json.dumps(manifest))
    recipe = _recipe(tmp_path, store, "rna")
    proc = _finetune(recipe, cwd=tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "encodes bases as" in err and "re-create the store with `genolong prepare`" in err


def test_checkpoint_write_failure_keeps_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full half-way through a checkpoint: the exception surfaces, the previous checkpoint is
    intact and loadable, and nothing is left under a checkpoint name."""
    import lightning.fabric.plugins.io.torch_io as torch_io

    strategy = AtomicModelParallelStrategy(save_distributed_checkpoint=False)
    first = tmp_path / "step0000002.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 2}, first)
    before = first.read_bytes()

    def disk_full(checkpoint: dict, path: str | Path) -> None:
        Path(path).write_bytes(b"\x00" * 100)  # a partial write ...
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full

    monkeypatch.setattr(torch_io, "_atomic_save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        strategy.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 4}, tmp_path / "step0000004.ckpt")
    # the failed step-4 checkpoint left neither a file nor a checksum manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0000002.ckpt", "step0000002.ckpt.checksums.json"]
    assert first.read_bytes() == before
    assert latest_checkpoint(tmp_path) == first
    assert torch.equal(torch.load(first, weights_only=True)["state_dict"]["w"], torch.ones(3))  # exact: read back


def _module(**kwargs) -> GenoLMModule:
    from genolong.model import PRESETS

    config = PRESETS["tiny"].replace(num_hidden_layers=2, pattern="KD", mlp_layer_types=("dense", "sparse"))
    module = GenoLMModule(lambda: GenoLM(config), OptimSettings(max_steps=10), **kwargs)
    module.configure_model()
    return module


def test_nonfinite_guard_skips_then_stops() -> None:
    module = _module(max_consecutive_nonfinite=3)
    assert module.model is not None
    with torch.no_grad():
        module.model.lm_head.weight.fill_(float("nan"))
    batch = {"tokens": torch.randint(1, 5, (1, 64))}
    assert module.training_step(batch, 0) is None and module.training_step(batch, 1) is None
    with pytest.raises(NonFiniteLossError, match="3 steps in a row had a non-finite loss .* lower train.lr"):
        module.training_step(batch, 2)


def test_nonfinite_gradient_is_skipped() -> None:
    module = _module(max_consecutive_nonfinite=2)
    params = list(module.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    params[0].grad[0] = float("inf")
    module.on_before_optimizer_step(None)  # type: ignore[arg-type]
    assert all(p.grad is None for p in params) and module.nonfinite_steps == 1
    for p in params:
        p.grad = torch.zeros_like(p)
    module.on_before_optimizer_step(None)  # type: ignore[arg-type]
    assert module.consecutive_nonfinite == 0 and params[0].grad is not None


def test_freeze() -> None:
    module = _module(freeze=("embed_tokens.*", "layers.*.mlp.*"))
    assert module.model is not None
    frozen = {n for n, p in module.model.named_parameters() if not p.requires_grad}
    assert "embed_tokens.weight" in frozen and "layers.1.mlp.experts.gate_up_proj" in frozen
    assert "lm_head.weight" not in frozen and "layers.0.self_attn.q_proj.weight" not in frozen
    with pytest.raises(Exception, match="freeze pattern 'layer.*' matches no parameter"):
        freeze_parameters(module.model, ["layer.*"])


def test_schedule_warmup_then_cosine() -> None:
    from genolong.train.module import WarmupCosine

    f = WarmupCosine(warmup_steps=4, max_steps=14, min_ratio=0.1)
    assert [round(f(s), 6) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert (
        f(4) == pytest.approx(1.0)
        and f(9) == pytest.approx(0.55)
        and f(14) == pytest.approx(0.1)
        and f(40) == pytest.approx(0.1)
    )

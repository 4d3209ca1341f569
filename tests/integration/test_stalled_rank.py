"""A rank that stops answering (``parallel.timeout_s``): the key reaches every process group, a bad
value is a one-line recipe error, and in a two-process gloo finetune whose rank 1 is stopped
(SIGSTOP) mid-run, rank 0 exits within ``timeout_s`` + 30 s with one line naming rank 1 and the
operation, a non-zero status and no partial checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from genolong.cli import main
from genolong.train.finetune import intact_checkpoint

_TIMEOUT_S = 15.0


def _recipe(tmp_path: Path, store: Path, name: str, parallel: dict, max_steps: int = 400) -> Path:
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 256},
        "train": {"max_steps": max_steps, "lr": 2.0e-3},
        "checkpoint": {
            "dir": str(tmp_path / "runs" / name / "checkpoints"),
            "every_n_steps": 2,
            "keep_last": 2,
            "export_safetensors": False,
        },
        "logging": {"dir": str(tmp_path / "runs" / name / "logs"), "progress_bar": False, "tensorboard": False},
        "parallel": {"accelerator": "cpu", **parallel},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("value", ["0", "-5", "'10'"])
def test_a_timeout_that_is_not_a_positive_number_is_a_one_line_recipe_error(
    value: str, sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _recipe(tmp_path, sample_store, "bad", {"devices": 1})
    assert main(["finetune", str(recipe), "--set", f"parallel.timeout_s={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"parallel.timeout_s = {value}" in err and ("must be > 0" in err or "must be a number" in err), err


def test_the_timeout_reaches_every_process_group(tmp_path: Path) -> None:
    """One gloo process: after build_mesh every group of the job (the default one, given torch's
    30 min, and the mesh's sub-groups) waits at most parallel.timeout_s."""
    code = """
import os, torch, torch.distributed as dist
from genolong.config import ParallelSection
from genolong.parallel.mesh import build_mesh
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
sub = dist.new_group([0])  # made before the mesh, as Lightning's own mesh is: torch's default 30 min
def timeouts():
    return sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in dist.distributed_c10d._world.pg_map})
assert timeouts() == [1800.0], timeouts()
mesh = build_mesh(ParallelSection(accelerator="cpu", ep=1, timeout_s=12.5))
assert len(dist.distributed_c10d._world.pg_map) >= 2
print(timeouts())
"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PORT": str(port)}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[12.5]", run.stdout


def test_the_finetune_strategy_gets_the_timeout(sample_store: Path, tmp_path: Path) -> None:
    from genolong.config import load_recipe
    from genolong.train.finetune import RunPaths, _trainer

    recipe = load_recipe(_recipe(tmp_path, sample_store, "t", {"devices": 1}), ["parallel.timeout_s=42"])
    trainer = _trainer(recipe, RunPaths.of(recipe), [])
    assert trainer.strategy._timeout.total_seconds() == 42.0


def _rank1(parent: int, deadline: float) -> int:
    """The pid of the rank Lightning started beside ``parent`` (its child with LOCAL_RANK=1)."""
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{parent}/task").iterdir():
            for child in (task / "children").read_text().split():
                try:
                    env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"LOCAL_RANK=1" in env:
                    return int(child)
        time.sleep(0.2)
    raise AssertionError("rank 1 never started")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_with_one_line_naming_it(sample_store: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, sample_store, "stall", {"devices": 2, "cp": 1, "timeout_s": _TIMEOUT_S})
    steps = tmp_path / "runs" / "stall" / "logs" / "steps.jsonl"
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    # files, not pipes: the stopped rank holds its copy of them open until it is killed
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:
        job = subprocess.Popen(
            [sys.executable, "-m", "genolong.cli", "finetune", str(recipe)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    rank1 = None
    try:
        deadline = time.monotonic() + 120
        rank1 = _rank1(job.pid, deadline)
        # mid-run: once the step log shows three training steps (a checkpoint was written at step 2)
        while time.monotonic() < deadline and (not steps.exists() or steps.read_text().count('"train/loss"') < 3):
            assert job.poll() is None, stderr.read_text()[-3000:]
            time.sleep(0.1)
        before = stderr.stat().st_size  # what the run printed before (the window summary)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        job.wait(timeout=_TIMEOUT_S + 30)
        took = time.monotonic() - stopped
    finally:
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
            job.wait()
    err = stderr.read_bytes()[before:].decode()
    print(f"rank 0 exited {took:.1f} s after rank 1 stopped (timeout {_TIMEOUT_S:g} s): {err.strip()}")
    assert job.returncode == 2, (job.returncode, err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("genolong finetune: error: rank 1 stopped answering: rank 0 waited 15 s in "), lines[0]
    assert "training step" in lines[0] or "checkpoint" in lines[0], lines[0]
    assert took < _TIMEOUT_S + 30
    # nothing half-written: no temporary checkpoint, every checkpoint left intact
    checkpoints = tmp_path / "runs" / "stall" / "checkpoints"
    assert not list(checkpoints.glob("*.tmp")), list(checkpoints.iterdir())
    names = sorted(p.name for p in checkpoints.glob("step*.ckpt"))
    assert names and intact_checkpoint(checkpoints) == checkpoints / names[-1], names

"""Preemption and time limits (issue 27, item 1): a stop signal ends ``genolong finetune`` at a step
boundary with a checkpoint of that step, one line and exit status 75; the run resumes by itself
(the marker) with the losses and the export of an uninterrupted run; a second signal during the
save changes nothing; SLURM requeue and auto-resume decisions; ``evaluate`` stops at a tile
boundary and resumes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.fabric.plugins.environments import SLURMEnvironment

from genolong.errors import PREEMPTED_EXIT_CODE
from genolong.integrity import check_weights
from genolong.model import PRESETS, GenoLM
from genolong.signals import SignalFlag
from genolong.train import read_step_log
from genolong.train.finetune import latest_checkpoint
from genolong.train.preemption import MARKER, auto_resume_reason, requeue_slurm_job, requeue_wanted
from tests.helpers import assert_bitwise_equal, genolong_frames

pytestmark = pytest.mark.usefixtures("one_thread")

_STEPS = 8

# `genolong finetune` with the checkpoint write slowed down between the data and the rename (the
# manifest step): the test sends its second SIGTERM there, in the middle of the save
_SLOW_SAVE = """
import os, sys, time
from pathlib import Path
import genolong.train.finetune as f
write = f.write_manifest
def slow(tmp, final, **kwargs):
    flags = Path(os.environ["SAVE_FLAGS"])
    (flags / ("saving-" + Path(final).name)).touch()
    time.sleep(2.0)
    write(tmp, final=final, **kwargs)
    (flags / ("saved-" + Path(final).name)).touch()
f.write_manifest = slow
from genolong.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _recipe(tmp_path: Path, store: Path, name: str) -> Path:
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 256},
        "train": {"max_steps": _STEPS, "lr": 2.0e-3, "warmup_steps": 2},
        "eval": {"every_n_steps": 4, "max_tiles": 1},
        "checkpoint": {"dir": str(tmp_path / "runs" / name / "checkpoints"), "every_n_steps": 4, "keep_last": 2},
        "logging": {"dir": str(tmp_path / "runs" / name / "logs"), "progress_bar": False, "tensorboard": False},
        "parallel": {"accelerator": "cpu"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **extra}
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_NTASKS"):
        env.pop(name, None)
    return env


def _finetune(recipe: Path, *args: str, code: str | None = None, **env: str) -> subprocess.Popen:
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "genolong.cli"]
    return subprocess.Popen(
        [*command, "finetune", str(recipe), *args],
        cwd=recipe.parent,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until(proc: subprocess.Popen, ready, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what}: the run ended or timed out first (status {proc.poll()})")


def _assert_same_run(straight: Path, run: Path, what: str) -> None:
    """Every step's training loss of ``run`` equals ``straight``'s (steps 1.._STEPS, exactly), and so
    does its export, bitwise."""
    a = read_step_log(straight / "logs" / "steps.jsonl")
    b = read_step_log(run / "logs" / "steps.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, _STEPS + 1))
    for step in range(1, _STEPS + 1):
        assert b[step]["train/loss"] == a[step]["train/loss"], (step, a[step]["train/loss"], b[step]["train/loss"])
    sa = GenoLM.from_pretrained(straight / "export").state_dict()
    sb = GenoLM.from_pretrained(run / "export").state_dict()
    assert_bitwise_equal(sb, sa, what)


@pytest.mark.slow
def test_sigterm_stops_at_a_step_with_a_checkpoint_and_the_rerun_resumes_exactly(
    sample_store: Path, tmp_path: Path
) -> None:
    """SIGTERM once step 1 is logged: the step in progress finishes, its checkpoint is written
    (a second SIGTERM arrives during that write and changes nothing), one line on stderr, status 75.
    The same command again (no --resume: the marker) resumes; every step's loss and the export equal
    an uninterrupted run's, bitwise (one thread)."""
    straight = _finetune(_recipe(tmp_path, sample_store, "straight"))
    recipe = _recipe(tmp_path, sample_store, "stopped")
    run = tmp_path / "runs" / "stopped"
    flags = tmp_path / "flags"
    flags.mkdir()
    proc = _finetune(recipe, code=_SLOW_SAVE, SAVE_FLAGS=str(flags))
    steps_log = run / "logs" / "steps.jsonl"
    _wait_until(proc, lambda: steps_log.exists() and max(read_step_log(steps_log), default=0) >= 1, "step 1")
    proc.send_signal(signal.SIGTERM)
    _wait_until(proc, lambda: any(flags.glob("saving-*")), "the stop checkpoint's write")
    saving = next(flags.glob("saving-*")).name.removeprefix("saving-")
    assert not (flags / f"saved-{saving}").exists()
    proc.send_signal(signal.SIGTERM)  # in the middle of the save
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == PREEMPTED_EXIT_CODE == 75, err[-3000:]
    reached = max(read_step_log(steps_log))
    assert 1 <= reached < 4, reached  # stopped before the step-4 periodic checkpoint
    checkpoint = run / "checkpoints" / f"step{reached:07d}.ckpt"
    assert saving == checkpoint.name and (flags / f"saved-{saving}").exists()
    assert latest_checkpoint(run / "checkpoints") == checkpoint and not list((run / "checkpoints").glob("*.tmp"))
    check_weights(checkpoint)  # complete: the checksum manifest matches
    # the run's usual start lines (the windows, the kernel backend), then one line for the stop
    lines = err.strip().splitlines()
    assert "Traceback" not in err and sum("stopped" in line for line in lines) == 1, err
    assert lines[-1] == (
        f"genolong finetune: stopped by SIGTERM after step {reached}; checkpoint "
        f"{checkpoint}; running the same command again resumes from it"
    ), err
    assert json.loads((run / MARKER).read_text())["step"] == reached
    assert not (run / "export").exists()

    resumed = _finetune(recipe)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"genolong: resuming from {checkpoint.name}: stopped by a signal after step {reached}" in err
    assert not (run / MARKER).exists()
    out, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    _assert_same_run(tmp_path / "runs" / "straight", run, "the stopped-and-resumed run's export")


def test_signal_flag_notes_and_agrees_in_one_process() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with SignalFlag(["SIGTERM", "SIGUSR1"]) as flag:
        assert flag.agree() == ()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.agree() == (signal.SIGUSR1,) and flag.received == [signal.SIGUSR1]
        assert SignalFlag.names((signal.SIGUSR1, signal.SIGTERM)) == "SIGUSR1 and SIGTERM"
    assert signal.getsignal(signal.SIGUSR1) == before


def test_auto_resume_reason(tmp_path: Path) -> None:
    assert auto_resume_reason(tmp_path, {}) is None
    assert auto_resume_reason(tmp_path, {"SLURM_RESTART_COUNT": "0"}) is None
    assert auto_resume_reason(tmp_path, {"SLURM_RESTART_COUNT": "2"}) == "SLURM job requeued, restart 2"
    # a Ray Train worker (genolong.train.ray_launcher): a restarted worker group resumes
    assert auto_resume_reason(tmp_path, {"GENOLONG_RAY_RESUME": "1"}) == "Ray Train started the workers again"
    (tmp_path / MARKER).write_text(json.dumps({"step": 7}))
    assert auto_resume_reason(tmp_path, {}) == f"stopped by a signal after step 7 ({tmp_path / MARKER})"


def test_requeue_decision_and_scontrol_call(tmp_path: Path) -> None:
    slurm = SLURMEnvironment()
    job = {"SLURM_JOB_ID": "4242"}
    assert requeue_wanted((signal.SIGUSR1,), slurm, job)
    assert not requeue_wanted((signal.SIGTERM,), slurm, job)  # scancel: never requeued
    assert not requeue_wanted((signal.SIGUSR1,), slurm, {})
    assert not requeue_wanted((signal.SIGUSR1,), SLURMEnvironment(auto_requeue=False), job)
    assert requeue_wanted((signal.SIGUSR2,), SLURMEnvironment(requeue_signal=signal.SIGUSR2), job)
    assert requeue_wanted((signal.SIGUSR1,), None, job)  # torchrun inside sbatch
    # scontrol mocked on PATH: it records its arguments
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\nexit ${{SCONTROL_STATUS:-0}}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert requeue_slurm_job({**env, **job}) == "SLURM job 4242 requeued"
    assert (
        requeue_slurm_job({**env, "SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"})
        == "SLURM job 77_3 requeued"
    )
    assert (
        requeue_slurm_job({**env, **job, "SCONTROL_STATUS": "1"})
        == "SLURM job 4242 not requeued (scontrol requeue exited 1)"
    )
    assert (tmp_path / "calls").read_text().splitlines() == ["requeue 4242", "requeue 77_3", "requeue 4242"]
    assert requeue_slurm_job({"PATH": str(tmp_path / "nothing"), **job}).startswith(
        "SLURM job 4242 not requeued (scontrol"
    )


def test_stop_signals_recipe_key(tmp_path: Path) -> None:
    from genolong.config import load_recipe
    from genolong.errors import InputError

    base = {
        "name": "x",
        "model": {"preset": "tiny"},
        "data": {"store": str(tmp_path), "context": 256},
        "train": {"max_steps": 2},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**base, "train": {"max_steps": 2, "stop_signals": ["SIGUSR2"]}}))
    assert load_recipe(path).train.stop_signals == ("SIGUSR2",)
    path.write_text(yaml.safe_dump(base))
    assert load_recipe(path).train.stop_signals == ("SIGTERM", "SIGUSR1")
    path.write_text(yaml.safe_dump({**base, "train": {"max_steps": 2, "stop_signals": ["SIGKILL"]}}))
    with pytest.raises(InputError, match="stop_signals"):
        load_recipe(path)


@pytest.mark.slow
def test_evaluate_stops_at_a_tile_boundary_and_resumes(sample_store: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    args = [
        "evaluate",
        str(tmp_path / "model"),
        "--store",
        str(sample_store),
        "--context",
        "2048",
        "--max-tiles",
        "8",
        "--first-bucket",
        "256",
        "--quiet",
    ]
    command = [
        sys.executable,
        "-c",
        "import sys, torch; torch.set_num_threads(1); from genolong.cli import main; sys.exit(main(sys.argv[1:]))",
    ]
    state = tmp_path / ".stopped.partial" / "state.npz"
    proc = subprocess.Popen(
        [*command, *args, "--out", str(tmp_path / "stopped")], env=_env(), stderr=subprocess.PIPE, text=True
    )
    _wait_until(proc, state.is_file, "the first committed tile", timeout=120)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    with np.load(state) as z:
        done = int(z["next_tile"])
    assert 1 <= done < 8 and not (tmp_path / "stopped").exists()
    lines = err.strip().splitlines()
    assert "Traceback" not in err and sum("stopped" in line for line in lines) == 1, err
    assert lines[-1] == (
        f"genolong evaluate: stopped by SIGTERM after {done} of 8 tiles; they are kept in "
        f"{state.parent}, where the same command resumes"
    ), err
    subprocess.run([*command, *args, "--out", str(tmp_path / "stopped")], env=_env(), check=True)
    subprocess.run([*command, *args, "--out", str(tmp_path / "whole")], env=_env(), check=True)
    meta = [json.loads((tmp_path / d / "meta.json").read_text()) for d in ("stopped", "whole")]
    assert meta[0]["fingerprint"] == meta[1]["fingerprint"] and meta[0]["nll_sum"] == meta[1]["nll_sum"]


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of a child process of ``parent`` whose environment says it is ``rank`` (Lightning's launcher)."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank's process in /proc")
def test_two_ranks_stop_at_the_same_step_when_one_got_the_signal(sample_store: Path, tmp_path: Path) -> None:
    """dp 2 (Lightning starts rank 1): SIGTERM to rank 1 only; both ranks finish the same step, the
    sharded checkpoint of that step is written and intact, rank 0 prints one line, both exit 75."""
    recipe = _recipe(tmp_path, sample_store, "dp2")
    raw = yaml.safe_load(recipe.read_text())
    raw["parallel"].update(devices=2, cp=1)
    raw["eval"]["every_n_steps"] = 0
    recipe.write_text(yaml.safe_dump(raw))
    run = tmp_path / "runs" / "dp2"
    proc = _finetune(recipe)
    steps_log = run / "logs" / "steps.jsonl"
    _wait_until(proc, lambda: steps_log.exists() and max(read_step_log(steps_log), default=0) >= 1, "step 1")
    rank1 = _rank_pid(proc.pid, 1)
    assert rank1 is not None
    os.kill(rank1, signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    reached = max(read_step_log(steps_log))
    assert 1 <= reached < 4
    checkpoint = run / "checkpoints" / f"step{reached:07d}.ckpt"
    assert latest_checkpoint(run / "checkpoints") == checkpoint and checkpoint.is_dir()
    check_weights(checkpoint)
    assert "Traceback" not in err and sum("stopped by SIGTERM" in line for line in err.splitlines()) == 1, err
    assert err.strip().splitlines()[-1].startswith(f"genolong finetune: stopped by SIGTERM after step {reached}; ")


def _torchrun(recipe: Path) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 -m genolong.cli finetune RECIPE`` (``torchrun`` is
    ``python -m torch.distributed.run``); its pid is the agent's, the parent of the two workers."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "genolong.cli",
        "finetune",
        str(recipe),
    ]
    return subprocess.Popen(
        command, cwd=recipe.parent, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# torchrun's own status when its agent was signalled: the agent forwards the signal to the workers,
# waits for them (up to its --shutdown-timeout), then re-raises its SignalException, whatever the
# workers' status (75 each): documented in docs/scale-out.md ("Preemption and time limits")
_TORCHRUN_SIGNALLED_EXIT_CODE = 1


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_dp2_agent_sigterm_stops_with_a_checkpoint_and_the_same_command_resumes_exactly(
    sample_store: Path, tmp_path: Path
) -> None:
    """torchrun dp 2 as a cluster stops it: SIGTERM to the torchrun agent (SLURM's and Kubernetes'
    target) once step 1 is logged. The agent forwards it to both workers; they finish the same step,
    write its sharded checkpoint (intact), rank 0 prints one line, and torchrun exits 1 (its own
    status, not 0). The same torchrun command again resumes by itself (the marker); every step's loss
    and the export equal an uninterrupted torchrun dp 2 run's, bitwise (one thread per process)."""

    def dp2(name: str) -> Path:
        recipe = _recipe(tmp_path, sample_store, name)
        raw = yaml.safe_load(recipe.read_text())
        raw["parallel"]["devices"] = 2  # must match torchrun's --nproc-per-node (Lightning checks)
        raw["eval"]["every_n_steps"] = 0
        recipe.write_text(yaml.safe_dump(raw))
        return recipe

    recipe = dp2("stopped")
    run = tmp_path / "runs" / "stopped"
    steps_log = run / "logs" / "steps.jsonl"
    proc = _torchrun(recipe)
    _wait_until(proc, lambda: steps_log.exists() and max(read_step_log(steps_log), default=0) >= 1, "step 1")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == _TORCHRUN_SIGNALLED_EXIT_CODE, err[-3000:]
    reached = max(read_step_log(steps_log))
    assert 1 <= reached < 4, reached  # stopped before the step-4 periodic checkpoint
    checkpoint = run / "checkpoints" / f"step{reached:07d}.ckpt"
    assert latest_checkpoint(run / "checkpoints") == checkpoint and checkpoint.is_dir()
    assert not list((run / "checkpoints").glob("*.tmp"))
    check_weights(checkpoint)  # complete: every rank's shard matches the checksum manifest
    lines = err.splitlines()
    assert sum("stopped by SIGTERM" in line for line in lines) == 1, err
    assert (
        f"genolong finetune: stopped by SIGTERM after step {reached}; checkpoint {checkpoint}; "
        "running the same command again resumes from it"
    ) in lines, err
    # the only traceback is torchrun's agent re-raising the signal (no genolong frame, no worker's)
    assert err.count("Traceback") == 1 and lines[-1].startswith(
        "torch.distributed.elastic.multiprocessing.api.SignalException"
    ), err
    assert genolong_frames(err) == [], err
    assert json.loads((run / MARKER).read_text())["step"] == reached
    assert not (run / "export").exists()

    resumed = _torchrun(recipe)  # the same command, no --resume
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert f"genolong: resuming from {checkpoint.name}: stopped by a signal after step {reached}" in err
    assert not (run / MARKER).exists()
    # one job at a time: two torchrun jobs side by side (4 workers, 2 agents on 2 cores) once ended
    # with a worker's SIGSEGV inside the export's state-dict gather (torch 2.13, gloo; not reproduced alone)
    straight = _torchrun(dp2("straight"))
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    _assert_same_run(tmp_path / "runs" / "straight", run, "the stopped-and-resumed torchrun run's export")


def test_requeue_after_the_checkpoint_and_scontrol_message_in_the_line(tmp_path: Path) -> None:
    """finish_stop requeues (rank 0 only, when wanted) and folds scontrol's stderr into the stop line."""
    from genolong.train.preemption import Preemption, finish_stop

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n'
        'echo "scontrol: error: Requested operation is presently disabled for job $2" >&2\nexit 1\n'
    )
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    stop = Preemption(step=3, checkpoint=Path("c/step0000003.ckpt"), signals=(signal.SIGUSR1,), requeue_wanted=True)
    assert finish_stop(stop, is_global_zero=False, environ=env) == stop  # another rank: no scontrol
    assert finish_stop(dataclasses.replace(stop, requeue_wanted=False), True, env).requeue is None
    assert not (tmp_path / "calls").exists()
    done = finish_stop(stop, is_global_zero=True, environ=env)
    assert (tmp_path / "calls").read_text() == "requeue 4242\n"
    assert done.message() == (
        "stopped by SIGUSR1 after step 3; checkpoint c/step0000003.ckpt; running the same "
        "command again resumes from it; SLURM job 4242 not requeued (scontrol requeue exited 1: "
        "Requested operation is presently disabled for job 4242)"
    )
    # a stop during start-up, with and without a checkpoint to resume from
    start = Preemption(step=4, checkpoint=Path("c/step0000004.ckpt"), signals=(signal.SIGTERM,), starting=True)
    assert start.message() == (
        "stopped by SIGTERM during start-up, before step 5; nothing new to save, checkpoint "
        "c/step0000004.ckpt; running the same command again resumes from it"
    )
    assert dataclasses.replace(start, checkpoint=None, step=0, requeue="SLURM job 9 requeued").message() == (
        "stopped by SIGTERM during start-up, before the first step; nothing to save yet; running the same command "
        "again starts the run; SLURM job 9 requeued"
    )


_FROM_START = """
import os, signal, sys
from genolong.signals import catch_from_start, ignore_from_now, keep_only, received_at_start
catch_from_start()
os.kill(os.getpid(), signal.SIGUSR1)
assert received_at_start() == (signal.SIGUSR1,), received_at_start()
keep_only((signal.SIGUSR1,))  # SIGTERM back to its default action
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
ignore_from_now()
os.kill(os.getpid(), signal.SIGUSR1)  # ignored: the status below stands
print("ok", flush=True)
sys.exit(3)
"""


def test_stop_signals_caught_from_start_then_ignored_at_the_end() -> None:
    done = subprocess.run([sys.executable, "-c", _FROM_START], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, "ok\n"), done.stderr
    # a signal the recipe does not stop on, received before the recipe was read, takes its default action
    kill = _FROM_START.replace("signal.SIGUSR1)\nassert", "signal.SIGTERM)\nassert").replace(
        "received_at_start() == (signal.SIGUSR1,)", "received_at_start() == (signal.SIGTERM,)"
    )
    done = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)


def test_task_layout_against_the_recipe() -> None:
    from genolong.config import ParallelSection
    from genolong.slurm import TaskLayoutError, check_task_layout

    two = ParallelSection(devices=2)
    job = {"SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "genolong", "SLURM_NNODES": "1", "SLURM_STEP_ID": "0"}
    check_task_layout(two, {})  # outside SLURM: nothing checked
    check_task_layout(two, {**job, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2"})
    check_task_layout(
        ParallelSection(devices=2, num_nodes=3),
        {**job, "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "2(x3)", "SLURM_NNODES": "3"},
    )
    check_task_layout(two, {**job, "SLURM_NTASKS": "2", "SLURM_JOB_NAME": "interactive"})  # Lightning ignores it too
    check_task_layout(two, {**job, "SLURM_NTASKS": "2", "TORCHELASTIC_RUN_ID": "x"})  # torchrun inside sbatch
    cases = [
        ({"SLURM_NTASKS": "2"}, "--ntasks=2 without --ntasks-per-node"),
        ({"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"}, "--ntasks-per-node=1"),
        ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2"}, "--nodes=2"),
        (
            {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_ID": None},
            "2 tasks, but this process is the batch script's, not one of srun's tasks",
        ),
    ]
    for extra, layout in cases:
        env = {k: v for k, v in {**job, **extra}.items() if v is not None}
        for rank, show in (("0", True), ("1", False)):
            with pytest.raises(TaskLayoutError) as error:
                check_task_layout(two, {**env, "SLURM_PROCID": rank})
            assert error.value.show is show
            assert str(error.value) == (
                f"the SLURM job's tasks ({layout}) do not match the recipe: the recipe runs parallel.devices=2 x "
                "parallel.num_nodes=1 processes; put `#SBATCH --nodes=1 --ntasks-per-node=2` in the job script and "
                "start genolong with `srun` (docs/slurm/finetune.sbatch), or set parallel.devices / "
                "parallel.num_nodes to the job's layout"
            )


@pytest.mark.slow
def test_signal_during_start_up_without_slurm(sample_store: Path, tmp_path: Path) -> None:
    """SIGUSR1 half a second after ``genolong finetune`` starts (torch not yet imported): the run stops
    before its first step with one line, status 75 (before: killed, 138)."""
    recipe = _recipe(tmp_path, sample_store, "early")
    proc = subprocess.Popen(
        [sys.executable, "-m", "genolong.cli", "finetune", str(recipe)],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "genolong finetune: stopped by SIGUSR1 during start-up, before the first "
        "step; nothing to save yet; running the same command again starts the run"
    )
    steps_log = tmp_path / "runs" / "early" / "logs" / "steps.jsonl"
    assert not steps_log.exists() or read_step_log(steps_log) == {}  # no step trained

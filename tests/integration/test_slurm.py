"""``genolong finetune`` under a real SLURM (issue 47): jobs submitted with the documented job script
(docs/slurm/finetune.sbatch) to the one-node cluster of the ``slurm_cluster`` fixture
(tests/slurm_cluster.py: SLURM 22.05 from Debian, KillWait 10 s, a requeued job's wait 10 s).

What SLURM does, as these tests see it: ``--signal=USR1@N`` reaches srun's tasks (the batch shell,
``exec srun``, is srun); ``scancel --signal=TERM`` (without ``--full``) reaches the tasks, and the job
ends with the status of srun (75); a save longer than KillWait is SIGKILLed; ``scontrol requeue``
sends SIGTERM to the tasks. Tiny recipes on the bundled sample; the job's Python slowed down (sleeps,
not CPU) where a test needs a window (tests/slurm_hooks/sitecustomize.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from genolong.integrity import check_weights
from genolong.model import GenoLM
from genolong.train import read_step_log
from genolong.train.finetune import latest_checkpoint
from tests.helpers import ROOT, assert_bitwise_equal

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

#: the job script the documentation shows (README, docs/scale-out.md, finetune --help)
SCRIPT = ROOT / "docs" / "slurm" / "finetune.sbatch"
HOOKS = Path(__file__).resolve().parents[1] / "slurm_hooks"


def _recipe(tmp_path: Path, store: Path, name: str, steps: int, devices: int = 1, every: int = 2) -> Path:
    recipe = {
        "name": name,
        "seed": 3,
        "model": {"preset": "tiny"},
        "data": {"store": str(store), "context": 256},
        "train": {"max_steps": steps, "lr": 2.0e-3, "warmup_steps": 2},
        "eval": {"every_n_steps": 0},
        "checkpoint": {"dir": str(tmp_path / "runs" / name / "checkpoints"), "every_n_steps": every, "keep_last": 2},
        "logging": {"dir": str(tmp_path / "runs" / name / "logs"), "progress_bar": False, "tensorboard": False},
        "parallel": {"accelerator": "cpu", "devices": devices},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _env(**extra: str) -> dict[str, str]:
    """The job's environment on top of the cluster's: this Python's ``genolong`` first on PATH, one
    thread per process (bitwise comparisons), the test hooks."""
    return {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": str(HOOKS),
        **extra,
    }


def _submit(cluster: Any, recipe: Path, *options: str, script: Path = SCRIPT, **env: str) -> tuple[str, Path]:
    """``sbatch OPTIONS SCRIPT`` (docs/slurm/finetune.sbatch) with ``RECIPE``; the job id and its output file."""
    out = recipe.with_suffix(".out")
    job = cluster.sbatch(script, f"--output={out}", *options, env=_env(RECIPE=str(recipe), **env), cwd=recipe.parent)
    return job, out


def _until(ready, what: str, cluster: Any, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s\n{cluster.logs()}")
        time.sleep(0.2)


def _steps(run: Path) -> int:
    log = run / "logs" / "steps.jsonl"
    return max(read_step_log(log), default=0) if log.exists() else 0


def _assert_same_run(straight: Path, run: Path, steps: int, what: str) -> None:
    """Every step's training loss of ``run`` equals ``straight``'s (exactly), and so does the export, bitwise."""
    a = read_step_log(straight / "logs" / "steps.jsonl")
    b = read_step_log(run / "logs" / "steps.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert b[step]["train/loss"] == a[step]["train/loss"], (step, a[step]["train/loss"], b[step]["train/loss"])
    assert_bitwise_equal(
        GenoLM.from_pretrained(run / "export").state_dict(),
        GenoLM.from_pretrained(straight / "export").state_dict(),
        what,
    )


def _seconds(runtime: str) -> int:
    """``scontrol``'s ``RunTime`` (``[D-]HH:MM:SS``) in seconds."""
    days, _, clock = runtime.rpartition("-")
    h, m, sec = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def _stop_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("genolong finetune: stopped")]


def test_two_task_job_requeued_by_its_time_limit_signal_ends_equal_to_an_uninterrupted_run(
    slurm_cluster: Any, sample_store: Path, tmp_path: Path
) -> None:
    """``--nodes=1 --ntasks-per-node=2 --signal=USR1@100 --requeue``: SLURM's SIGUSR1 stops both
    ranks at one step with a complete sharded checkpoint, one line naming the requeue, exit 75; the
    job is requeued, resumes by itself, and every step's loss and the export equal an uninterrupted
    dp-2 run's (Lightning's own launcher, outside SLURM), bitwise.

    The signal is SLURM's own (slurmctld's time-limit pass, every 30 s), placed in training: once
    step 1 is logged the time limit is cut (``scontrol update TimeLimit``) to the whole minutes
    that make the signal due now and the limit itself more than 40 s away, so it comes at the next
    pass, whatever the start-up took (a signal during start-up stops the run before its first step:
    the start-up test). The first run sleeps 2.5 s a step (no CPU) so that it is still training
    then; the requeued run gets its 10 minutes back, so it finishes."""
    steps = 16
    recipe = _recipe(tmp_path, sample_store, "job", steps, devices=2)
    run = tmp_path / "runs" / "job"
    job, out = _submit(
        slurm_cluster,
        recipe,
        "--nodes=1",
        "--ntasks-per-node=2",
        "--time=10",
        "--signal=USR1@100",
        GENOLONG_TEST_STEP_SLEEP="2.5",
    )
    _until(lambda: _steps(run) >= 1, "the job's step 1", slurm_cluster)
    elapsed = _seconds(slurm_cluster.job(job).fields["RunTime"])
    slurm_cluster.run("scontrol", "update", f"jobid={job}", f"TimeLimit={(elapsed + 100) // 60}")
    # the uninterrupted run, meanwhile (the job sleeps)
    straight_recipe = _recipe(tmp_path, sample_store, "straight", steps, devices=2)
    env = {k: v for k, v in {**os.environ, **_env()}.items() if not k.startswith("SLURM_") and k != "PYTHONPATH"}
    straight = subprocess.Popen(
        [sys.executable, "-m", "genolong.cli", "finetune", str(straight_recipe)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _until(lambda: _stop_lines(out.read_text()), "the stop line of the first run", slurm_cluster)
    slurm_cluster.run("scontrol", "update", f"jobid={job}", "TimeLimit=10")
    info = slurm_cluster.wait(job, "COMPLETED", timeout=240)
    text = out.read_text()
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-3000:]
    assert info.restarts == 1 and info.exit_code == "0:0", (info.fields, text)
    stops = _stop_lines(text)
    assert len(stops) == 1 and "Traceback" not in text and "Terminated" not in text, text
    match = re.fullmatch(
        rf"genolong finetune: stopped by SIGUSR1 after step (\d+); checkpoint (\S+); running the "
        rf"same command again resumes from it; SLURM job {job} requeued",
        stops[0],
    )
    assert match, stops[0]
    reached = int(match[1])
    assert 1 <= reached < steps, text
    assert f"genolong: resuming from step{reached:07d}.ckpt: stopped by a signal after step {reached}" in text, text
    _assert_same_run(
        tmp_path / "runs" / "straight", tmp_path / "runs" / "job", steps, "the requeued SLURM job's export"
    )


def test_signal_during_start_up_stops_with_one_line_exit_75_and_the_requeue(
    slurm_cluster: Any, sample_store: Path, tmp_path: Path
) -> None:
    """SIGUSR1 to the job's task (``scancel --signal=USR1``) while genolong starts (torch imported,
    the model built; no step yet): one line, the task's status 75 and the requeue; the requeued
    job runs the whole recipe. (Before: ``User defined signal 1``, exit 138, no requeue.)"""
    recipe = _recipe(tmp_path, sample_store, "startup", 4)
    job, out = _submit(slurm_cluster, recipe, "--time=10")
    # the srun step exists (its task started), then 1 s: genolong is importing torch by then
    _until(
        lambda: (
            f"{job}.0"
            in slurm_cluster.run("squeue", "--steps", "--noheader", "--format=%i", f"--jobs={job}", check=False).stdout
        ),
        "the srun step",
        slurm_cluster,
    )
    time.sleep(1.0)
    assert _steps(tmp_path / "runs" / "startup") == 0
    slurm_cluster.run("scancel", "--signal=USR1", job)
    info = slurm_cluster.wait(job, "COMPLETED", timeout=180)
    text = out.read_text()
    assert info.restarts == 1 and info.exit_code == "0:0", (info.fields, text)
    assert _stop_lines(text) == [
        "genolong finetune: stopped by SIGUSR1 during start-up, before the first step; nothing to save yet; running "
        f"the same command again starts the run; SLURM job {job} requeued"
    ], text
    assert "srun: error: localhost: task 0: Exited with exit code 75" in text, text
    assert "Traceback" not in text and "User defined signal" not in text, text
    assert _steps(tmp_path / "runs" / "startup") == 4 and (tmp_path / "runs" / "startup" / "export").is_dir()


def test_scancel_signal_term_checkpoints_and_full_kills(slurm_cluster: Any, sample_store: Path, tmp_path: Path) -> None:
    """``scancel --signal=TERM JOB`` reaches srun's task: genolong saves the step, one line, exit 75, no
    requeue; SLURM records the job FAILED with srun's status, ``75:0``. The same job script again
    resumes (``--resume`` is not needed: the marker); ``scancel --signal=TERM --full`` then signals the
    batch shell too, which is srun here: srun kills its tasks, no line, no checkpoint of that step."""
    recipe = _recipe(tmp_path, sample_store, "term", 8, every=100)
    run = tmp_path / "runs" / "term"
    job, out = _submit(slurm_cluster, recipe, "--time=10", GENOLONG_TEST_STEP_SLEEP="1")
    _until(lambda: _steps(run) >= 1, "step 1", slurm_cluster)
    slurm_cluster.run("scancel", "--signal=TERM", job)
    info = slurm_cluster.wait(job, timeout=120)
    text = out.read_text()
    assert (info.state, info.exit_code, info.restarts) == ("FAILED", "75:0", 0), (info.fields, text)
    reached = _steps(run)
    checkpoint = run / "checkpoints" / f"step{reached:07d}.ckpt"
    assert _stop_lines(text) == [
        f"genolong finetune: stopped by SIGTERM after step {reached}; checkpoint {checkpoint}; "
        "running the same command again resumes from it"
    ], text
    assert latest_checkpoint(run / "checkpoints") == checkpoint
    check_weights(checkpoint)

    job, out = _submit(slurm_cluster, recipe, "--time=10", GENOLONG_TEST_STEP_SLEEP="1")
    _until(lambda: _steps(run) >= reached + 1, "a step of the resumed run", slurm_cluster)
    slurm_cluster.run("scancel", "--signal=TERM", "--full", job)
    info = slurm_cluster.wait(job, timeout=120)
    text = out.read_text().split(f"genolong job {job}: ")[1]  # this job's part of the appended log
    assert f"genolong: resuming from {checkpoint.name}" in text, text
    assert _stop_lines(text) == [], text  # killed, not stopped
    assert latest_checkpoint(run / "checkpoints") == checkpoint, text  # nothing newer saved
    assert "srun: error: localhost: task 0: Killed" in text, text
    assert (info.state, info.exit_code) == ("FAILED", "137:0"), info.fields  # srun: 128 + SIGKILL


def test_save_outlasting_killwait_leaves_a_partial_file_the_requeued_run_ignores_and_names(
    slurm_cluster: Any, sample_store: Path, tmp_path: Path
) -> None:
    """``scontrol requeue`` during training sends SIGTERM; genolong's stop save takes longer than
    KillWait (the test's hook holds it 60 s before its manifest) and SLURM SIGKILLs it: no line, no
    marker, a ``step*.ckpt.tmp`` left. The requeued job resumes from the last complete checkpoint
    and says so in one line naming the partial file; it finishes all steps."""
    recipe = _recipe(tmp_path, sample_store, "killwait", 6)
    run = tmp_path / "runs" / "killwait"
    flag = tmp_path / "slow-save"
    job, out = _submit(
        slurm_cluster, recipe, "--time=10", GENOLONG_TEST_STEP_SLEEP="1", GENOLONG_TEST_SLOW_SAVE=str(flag)
    )
    _until(lambda: _steps(run) >= 3 and latest_checkpoint(run / "checkpoints") is not None, "step 3", slurm_cluster)
    flag.touch()
    slurm_cluster.run("scontrol", "requeue", job)
    saving = Path(f"{flag}.saving")
    _until(lambda: saving.exists(), "the stop save", slurm_cluster, timeout=60)
    partial = Path(saving.read_text())
    _until(lambda: slurm_cluster.job(job).restarts >= 1, "the requeue", slurm_cluster, timeout=60)
    flag.unlink()  # the requeued run saves at full speed
    info = slurm_cluster.wait(job, "COMPLETED", timeout=180)
    text = out.read_text()
    assert info.restarts == 1 and info.exit_code == "0:0", (info.fields, text)
    assert _stop_lines(text) == [], text  # the first run was killed during its save
    # SLURM's only word of the kill, in either of the wordings srun uses (which one depends on when
    # its own step timer fires against slurmd's KillWait: both were seen with the same test)
    assert (
        "srun: error: Timed out waiting for job step to complete" in text or "srun: forcing job termination" in text
    ), text
    resumed = [line for line in text.splitlines() if line.startswith("genolong: resuming from")]
    assert len(resumed) == 1 and resumed[0].startswith(
        "genolong: resuming from step0000002.ckpt: SLURM job requeued, restart 1; "
    ), text
    assert resumed[0].endswith(f"; {partial.name} (a save cut short) ignored"), (resumed, partial)
    assert _steps(run) == 6 and (run / "export").is_dir()


@pytest.mark.parametrize(
    ("devices", "layout", "job_layout"),
    [
        (2, "--ntasks=2", "--ntasks=2 without --ntasks-per-node"),
        (1, "--ntasks-per-node=2", "--ntasks-per-node=2"),
    ],
)
def test_task_layout_that_disagrees_with_the_recipe_is_one_line_exit_2(
    slurm_cluster: Any, sample_store: Path, tmp_path: Path, devices: int, layout: str, job_layout: str
) -> None:
    """A job whose tasks are not the recipe's devices x num_nodes: one line from one rank (before the
    model loads) naming both and the ``#SBATCH`` fix, each task exits 2 (before: Lightning's
    traceback from every rank). The documented script with its ``--ntasks-per-node`` line written
    another way (an ``#SBATCH`` line cannot be unset from sbatch's command line)."""
    recipe = _recipe(tmp_path, sample_store, "layout", 4, devices=devices)
    script = tmp_path / "job.sbatch"
    script.write_text(SCRIPT.read_text().replace("#SBATCH --ntasks-per-node=1\n", f"#SBATCH {layout}\n", 1))
    assert script.read_text() != SCRIPT.read_text()
    job, out = _submit(slurm_cluster, recipe, "--time=10", script=script)
    info = slurm_cluster.wait(job, timeout=120)
    text = out.read_text()
    assert (info.state, info.exit_code) == ("FAILED", "2:0"), (info.fields, text)
    errors = [line for line in text.splitlines() if line.startswith("genolong finetune: error:")]
    assert errors == [
        f"genolong finetune: error: the SLURM job's tasks ({job_layout}) do not match the recipe: the recipe runs "
        f"parallel.devices={devices} x parallel.num_nodes=1 processes; put `#SBATCH --nodes=1 "
        f"--ntasks-per-node={devices}` in the job script and start genolong with `srun` "
        "(docs/slurm/finetune.sbatch), or set parallel.devices / parallel.num_nodes to the job's layout"
    ], text
    assert "Traceback" not in text and not (tmp_path / "runs" / "layout" / "logs").exists(), text


def test_a_refused_requeue_is_named_in_the_stop_line(slurm_cluster: Any, sample_store: Path, tmp_path: Path) -> None:
    """A job submitted with ``--no-requeue``: SIGUSR1 after step 1 saves the step, ``scontrol
    requeue`` refuses, and its message is folded into genolong's one line (no extra line from
    scontrol); the task exits 75, SLURM records ``FAILED 75:0``."""
    recipe = _recipe(tmp_path, sample_store, "norequeue", 8, every=100)
    run = tmp_path / "runs" / "norequeue"
    job, out = _submit(slurm_cluster, recipe, "--time=10", "--no-requeue", GENOLONG_TEST_STEP_SLEEP="1")
    _until(lambda: _steps(run) >= 1, "step 1", slurm_cluster)
    slurm_cluster.run("scancel", "--signal=USR1", job)
    info = slurm_cluster.wait(job, timeout=120)
    text = out.read_text()
    assert (info.state, info.exit_code, info.restarts) == ("FAILED", "75:0", 0), (info.fields, text)
    reached = _steps(run)
    checkpoint = run / "checkpoints" / f"step{reached:07d}.ckpt"
    stops = _stop_lines(text)
    assert len(stops) == 1 and stops[0].startswith(
        f"genolong finetune: stopped by SIGUSR1 after step {reached}; checkpoint {checkpoint}; running the same command "
        f"again resumes from it; SLURM job {job} not requeued (scontrol requeue exited 1: "
    ), text
    assert stops[0].endswith(")") and "scontrol:" not in text and "Traceback" not in text, text
    check_weights(checkpoint)

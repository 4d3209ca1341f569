"""Preemption and time limits in ``genolong finetune``: stop at a step boundary with a checkpoint.

A signal of ``train.stop_signals`` (default SIGTERM and SIGUSR1) during training:

1. is noted by :class:`StopSignalConnector`, which takes the place of Lightning's signal connector
   (Lightning's own SIGTERM handler broadcasts from inside the handler, a collective at a random
   point of the step, and its SLURM SIGUSR1 handler writes a checkpoint from inside the handler);
2. at the end of the optimiser step the process is in, :class:`RunCheckpoint` (the run's
   ``ModelCheckpoint``) asks every rank at once (one all-reduce: a signal that reached one rank
   stops them all, at the same step); if any got one, it writes the checkpoint of that step (the
   usual atomic, checksummed ``step*.ckpt``, kept like the periodic ones), rank 0 writes the
   marker ``preempted.json`` in the run directory and, under SLURM on Lightning's requeue signal
   (SIGUSR1), requeues the job (``scontrol requeue``);
3. Lightning's ``received_sigterm`` then ends the loop (its ``SIGTERMException``), and
   ``genolong finetune`` prints one line naming the checkpoint and the step and exits with status
   75 (:data:`genolong.errors.PREEMPTED_EXIT_CODE`).

A run started again without ``--resume`` resumes by itself from the newest intact checkpoint when
the marker is there or SLURM says the job was requeued (``SLURM_RESTART_COUNT`` > 0):
:func:`auto_resume_reason`. The marker goes when the run finishes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from ..files import replace_file
from ..signals import SignalFlag

__all__ = ["MARKER", "Preemption", "RunCheckpoint", "StopSignalConnector", "auto_resume_reason", "requeue_slurm_job",
           "requeue_wanted"]

#: the run directory's note that the run was stopped by a signal (removed when the run finishes)
MARKER = "preempted.json"


@dataclass(frozen=True)
class Preemption:
    """Where a stopped run stopped."""

    step: int
    checkpoint: Path
    signals: tuple[signal.Signals, ...]
    requeue: str | None = None  # what the SLURM requeue did (rank 0), None when not asked

    def message(self) -> str:
        line = (f"stopped by {SignalFlag.names(self.signals)} after step {self.step}; checkpoint {self.checkpoint}; "
                "running the same command again resumes from it")
        return line + (f"; {self.requeue}" if self.requeue else "")


class StopSignalConnector(_SignalConnector):
    """Lightning's signal connector, with handlers that only note the signal (:class:`SignalFlag`).

    ``received_sigterm`` (which ends Lightning's loops at the next batch boundary) is set by
    :meth:`agree` only, once every rank knows, so every rank leaves at the same step. Lightning's
    ``teardown`` puts the previous handlers back.
    """

    def __init__(self, trainer: L.Trainer, flag: SignalFlag):
        super().__init__(trainer)
        self.flag = flag
        self.preemption: Preemption | None = None

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = self._get_current_signal_handlers()
        self.flag.received = []
        for sig in self.flag.signals:
            self._register_signal(sig, self.flag.note)

    def agree(self) -> tuple[signal.Signals, ...]:
        """The signals any rank got (a collective: every rank calls it at the same step)."""
        got = self.flag.agree(device=self.trainer.strategy.root_device)
        if got:
            self.received_sigterm = True
        return got


def requeue_wanted(signals: tuple[signal.Signals, ...], environment: Any, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a stop by ``signals`` should requeue the SLURM job: inside a SLURM job
    (``SLURM_JOB_ID``), on the requeue signal of Lightning's ``SLURMEnvironment`` (SIGUSR1 unless
    it says otherwise; never when its ``auto_requeue`` is off), SIGUSR1 under another launcher
    (torchrun inside ``sbatch``). SIGTERM never requeues: ``scancel`` sends it."""
    if not environ.get("SLURM_JOB_ID"):
        return False
    if isinstance(environment, SLURMEnvironment):
        return environment.auto_requeue and environment.requeue_signal in signals
    return signal.SIGUSR1 in signals


def requeue_slurm_job(environ: Mapping[str, str] = os.environ) -> str:
    """``scontrol requeue`` this job (an array job's task: ``ARRAYID_TASKID``), as Lightning's SLURM
    handler does; returns what happened, for the stop line."""
    array = environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{environ.get('SLURM_ARRAY_TASK_ID', '')}" if array else environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        return f"SLURM job not requeued (job id {job!r})"
    try:
        code = subprocess.call(["scontrol", "requeue", job], env=dict(environ), stdout=subprocess.DEVNULL)
    except OSError as error:
        return f"SLURM job {job} not requeued (scontrol: {error.strerror or error})"
    return f"SLURM job {job} requeued" if code == 0 else f"SLURM job {job} not requeued (scontrol requeue exited {code})"


def auto_resume_reason(root: Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a run started without ``--resume`` over existing checkpoints resumes anyway, or None
    (then it refuses them): the preemption marker in ``root`` (the run directory), a requeued
    SLURM job (``SLURM_RESTART_COUNT`` > 0), or a Ray Train worker (``GENOLONG_RAY_RESUME=1``, set
    by :mod:`genolong.train.ray_launcher`: a worker group started again after a failure)."""
    marker = root / MARKER
    if marker.is_file():
        try:
            step = json.loads(marker.read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            step = None
        return f"stopped by a signal{f' after step {step}' if step is not None else ''} ({marker})"
    restarts = environ.get("SLURM_RESTART_COUNT", "")
    if restarts.isdigit() and int(restarts) > 0:
        return f"SLURM job requeued, restart {restarts}"
    if environ.get("GENOLONG_RAY_RESUME") == "1":
        # a Ray Train worker (genolong.train.ray_launcher): the driver refused a fresh run over old
        # checkpoints before starting the workers, so checkpoints here are this job's own
        return "Ray Train started the workers again"
    return None


def remove_marker(root: Path) -> None:
    """The run finished: no marker (rank 0)."""
    (root / MARKER).unlink(missing_ok=True)


class RunCheckpoint(ModelCheckpoint):
    """The run's ``ModelCheckpoint`` (periodic ``step*.ckpt``), which also stops the run at a step
    boundary when a stop signal came (see the module docstring).

    Args:
        root: the run directory (the marker goes there).
        *args, **kwargs: ``ModelCheckpoint``'s.
    """

    def __init__(self, root: Path, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.root = Path(root)
        self._checked_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        connector = trainer._signal_connector
        # once per optimiser step (not per accumulated batch); the last step ends the run anyway
        if step == self._checked_step or not isinstance(connector, StopSignalConnector) or step >= (trainer.max_steps or 0):
            return
        self._checked_step = step
        got = connector.agree()
        if not got:
            return
        if self._last_global_step_saved != step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        checkpoint = Path(self._last_checkpoint_saved)
        requeue = None
        if trainer.is_global_zero:
            record = {"step": step, "checkpoint": checkpoint.name, "signals": [s.name for s in got]}
            replace_file(self.root / MARKER, lambda tmp: tmp.write_text(json.dumps(record) + "\n"), durable=True)
            if requeue_wanted(got, trainer._accelerator_connector.cluster_environment):
                requeue = requeue_slurm_job()
        connector.preemption = Preemption(step=step, checkpoint=checkpoint, signals=got, requeue=requeue)

"""Preemption and time limits in ``genolong finetune``: stop at a step boundary with a checkpoint.

A signal of ``train.stop_signals`` (default SIGTERM and SIGUSR1) during training:

1. is noted by :class:`StopSignalConnector`, which takes the place of Lightning's signal connector
   (Lightning's own SIGTERM handler broadcasts from inside the handler, a collective at a random
   point of the step, and its SLURM SIGUSR1 handler writes a checkpoint from inside the handler);
2. at the end of the optimiser step the process is in, :class:`RunCheckpoint` (the run's
   ``ModelCheckpoint``) asks every rank at once (one all-reduce: a signal that reached one rank
   stops them all, at the same step); if any got one, it writes the checkpoint of that step (the
   usual atomic, checksummed ``step*.ckpt``, kept like the periodic ones), rank 0 writes the
   marker ``preempted.json`` in the run directory;
3. Lightning's ``received_sigterm`` then ends the loop (its ``SIGTERMException``); once the
   checkpoint is complete on disk (a background save finished), rank 0, under SLURM on Lightning's
   requeue signal (SIGUSR1), requeues the job (``scontrol requeue``: :func:`finish_stop`), and
   ``genolong finetune`` prints one line naming the checkpoint, the step and the requeue (or
   ``scontrol``'s own message when it refused) and exits with status 75
   (:data:`genolong.errors.PREEMPTED_EXIT_CODE`).

The signals are noted from the first line of ``genolong finetune`` on
(:func:`genolong.signals.catch_from_start`), not only during training: one that came during
start-up (the imports, the model load, the process group) stops the run before its first step, at
the start of training (every rank agrees there), with the same line, status and requeue; one that
comes after training (SLURM's SIGTERM that follows ``scontrol requeue``) is noted and changes
nothing, so the status stays 75.

A run started again without ``--resume`` resumes by itself from the newest intact checkpoint when
the marker is there or SLURM says the job was requeued (``SLURM_RESTART_COUNT`` > 0):
:func:`auto_resume_reason`. The marker goes when the run finishes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..files import replace_file
from ..signals import SignalFlag, received_at_start

__all__ = [
    "MARKER",
    "Preemption",
    "RunCheckpoint",
    "StopSignalConnector",
    "auto_resume_reason",
    "finish_stop",
    "requeue_slurm_job",
    "requeue_wanted",
]

#: the run directory's note that the run was stopped by a signal (removed when the run finishes)
MARKER = "preempted.json"


@dataclass(frozen=True)
class Preemption:
    """Where a stopped run stopped."""

    step: int
    checkpoint: Path | None  # None: stopped during start-up before any checkpoint existed
    signals: tuple[signal.Signals, ...]
    requeue: str | None = None  # what the SLURM requeue did (rank 0), None when not asked
    starting: bool = False  # stopped during start-up, before the first step of this process
    requeue_wanted: bool = False  # rank 0 requeues the job once the checkpoint is complete

    def message(self) -> str:
        """The stop's one line (without the command's name)."""
        if not self.starting:
            line = (
                f"stopped by {SignalFlag.names(self.signals)} after step {self.step}; checkpoint "
                f"{self.checkpoint}; running the same command again resumes from it"
            )
        elif self.checkpoint is not None:
            line = (
                f"stopped by {SignalFlag.names(self.signals)} during start-up, before step {self.step + 1}; "
                f"nothing new to save, checkpoint {self.checkpoint}; running the same command again resumes "
                "from it"
            )
        else:
            line = (
                f"stopped by {SignalFlag.names(self.signals)} during start-up, before the first step; nothing "
                "to save yet; running the same command again starts the run"
            )
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
        # a stop signal that came before training (genolong.signals.catch_from_start) stops it too
        self.flag.received = [s for s in received_at_start() if s in self.flag.signals]
        for sig in self.flag.signals:
            self._register_signal(sig, self.flag.note)

    def agree(self) -> tuple[signal.Signals, ...]:
        """The signals any rank got (a collective: every rank calls it at the same step)."""
        got = self.flag.agree(device=self.trainer.strategy.root_device)
        if got:
            self.received_sigterm = True
        return got


def requeue_wanted(
    signals: tuple[signal.Signals, ...], environment: Any, environ: Mapping[str, str] = os.environ
) -> bool:
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
    # SLURM answers the requeue with SIGTERM to every process of the job's steps, scontrol
    # included (proctrack/linuxproc: the whole process tree), which could end scontrol before it
    # reports its success: it inherits SIGTERM ignored (exec keeps an ignored disposition)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return f"SLURM job {job} not requeued (scontrol requeue did not answer in 60 s)"
    except OSError as error:
        return f"SLURM job {job} not requeued (scontrol: {error.strerror or error})"
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if done.returncode == 0:
        return f"SLURM job {job} requeued"
    if done.returncode < 0:
        return (
            f"SLURM job {job} perhaps not requeued (scontrol requeue ended by {signal.Signals(-done.returncode).name})"
        )
    # scontrol's own message, folded into genolong's line ("scontrol: error: ..." on stderr)
    said = " ".join(done.stderr.split()).removeprefix("scontrol: ").removeprefix("error: ")
    return f"SLURM job {job} not requeued (scontrol requeue exited {done.returncode}{': ' + said if said else ''})"


def finish_stop(stop: Preemption, is_global_zero: bool, environ: Mapping[str, str] = os.environ) -> Preemption:
    """The stop once its checkpoint is complete on disk: rank 0 requeues the SLURM job now (if
    :func:`requeue_wanted` said so), not before, so that the requeued job never starts from a
    checkpoint still being written; SLURM's SIGTERM that follows is noted and changes nothing."""
    if not (stop.requeue_wanted and is_global_zero):
        return stop
    return dataclasses.replace(stop, requeue=requeue_slurm_job(environ))


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

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        connector = trainer._signal_connector
        # once per optimiser step (not per accumulated batch); the last step ends the run anyway
        if (
            step == self._checked_step
            or not isinstance(connector, StopSignalConnector)
            or step >= (trainer.max_steps or 0)
        ):
            return
        self._checked_step = step
        got = connector.agree()
        if not got:
            return
        if self._last_global_step_saved != step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        self._stop(trainer, connector, got, Path(self._last_checkpoint_saved), starting=False)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A stop signal that came during start-up (every rank asks here, before the first step):
        stop now, with the checkpoint the run resumed from (if any), before any step is redone."""
        super().on_train_start(trainer, pl_module)
        connector = trainer._signal_connector
        if not isinstance(connector, StopSignalConnector) or not (got := connector.agree()):
            return
        resumed = trainer.ckpt_path
        self._stop(trainer, connector, got, Path(resumed) if resumed else None, starting=True)
        raise SIGTERMException

    def _stop(
        self,
        trainer: L.Trainer,
        connector: StopSignalConnector,
        got: tuple[signal.Signals, ...],
        checkpoint: Path | None,
        starting: bool,
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and checkpoint is not None:
            record = {"step": step, "checkpoint": checkpoint.name, "signals": [s.name for s in got]}
            replace_file(self.root / MARKER, lambda tmp: tmp.write_text(json.dumps(record) + "\n"), durable=True)
        requeue = requeue_wanted(got, trainer._accelerator_connector.cluster_environment)
        connector.preemption = Preemption(
            step=step, checkpoint=checkpoint, signals=got, starting=starting, requeue_wanted=requeue
        )

"""Stopping at a safe point when a signal arrives (preemption, a time limit).

A scheduler ends a job by signal: SLURM sends SIGTERM at the time limit or on preemption (and, with
``sbatch --signal=USR1@N``, SIGUSR1 N seconds before); Kubernetes and Ray send SIGTERM. The
handlers installed here only note that a signal came (never a collective, a write or an exception
inside a handler, which could land anywhere, e.g. in the middle of an all-reduce or a checkpoint
write): the loop that owns the work asks :meth:`SignalFlag.agree` at its safe points (the end of an
optimiser step, a committed tile), where every rank of a job takes part in one all-reduce, so that
all of them stop at the same point even when the signal reached only some of them. A second
signal while the process stops (during the checkpoint write) is noted and changes nothing.

The commands that stop this way exit with :data:`genolong.errors.PREEMPTED_EXIT_CODE` (75).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "DEFAULT_STOP_SIGNALS",
    "SignalFlag",
    "catch_from_start",
    "ignore_from_now",
    "keep_only",
    "received_at_start",
]

#: the signals that stop a run at its next safe point unless a recipe says otherwise
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class SignalFlag:
    """Notes which of ``signals`` arrived, once installed (:meth:`install`, or as a context manager).

    Args:
        signals: names (``"SIGTERM"``) or numbers; empty: nothing is installed and nothing stops.
    """

    def __init__(self, signals: Sequence[str | int | signal.Signals] = DEFAULT_STOP_SIGNALS):
        self.signals = tuple(signal.Signals[s] if isinstance(s, str) else signal.Signals(s) for s in signals)
        self.received: list[signal.Signals] = []
        self._previous: dict[signal.Signals, Any] = {}

    def note(self, signum: int, frame: FrameType | None = None) -> None:
        """The handler: remember the signal (and nothing else)."""
        got = signal.Signals(signum)
        if got not in self.received:
            self.received.append(got)

    def install(self) -> None:
        """Handle ``signals`` with :meth:`note` (from the main thread only: Python allows no other),
        keeping the handlers they had for :meth:`restore`."""
        self.received = []
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self.note)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> SignalFlag:
        self.install()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.restore()

    def local(self) -> tuple[signal.Signals, ...]:
        """The signals this process received, in the order of ``signals`` (no collective)."""
        return tuple(sig for sig in self.signals if sig in self.received)

    def agree(self, device: Any = None, group: Any = None) -> tuple[signal.Signals, ...]:
        """The signals any rank of the job received, in the order of ``signals`` (empty: go on).

        A collective when ``torch.distributed`` runs more than one process: every rank must call
        it at the same point of its loop (one all-reduce of one flag per signal, on ``device``: the
        process group's device, a GPU under NCCL; ``group``: the default group unless given).
        """
        if not self.signals:
            return ()
        flags = [int(sig in self.received) for sig in self.signals]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            import torch

            tensor = torch.tensor(flags, dtype=torch.int32, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            flags = tensor.tolist()
        return tuple(sig for sig, flag in zip(self.signals, flags) if flag)

    @staticmethod
    def names(signals: Sequence[signal.Signals]) -> str:
        """``"SIGTERM"``, ``"SIGUSR1 and SIGTERM"``: for one line."""
        return " and ".join(sig.name for sig in signals)


#: the flag :func:`catch_from_start` installed (None: not installed in this process)
_FROM_START: SignalFlag | None = None


def catch_from_start(signals: Sequence[str | int | signal.Signals] = DEFAULT_STOP_SIGNALS) -> SignalFlag:
    """Note ``signals`` from now on, for the whole life of the process (``genolong finetune`` calls
    it before it imports torch or reads its recipe).

    Without it, a signal that comes before training starts (while torch is imported, the model
    loaded, the process group formed: ``sbatch --signal`` and ``scancel`` do not wait for that)
    kills the process with the default action (SIGUSR1: ``User defined signal 1``, exit 138; no
    line, no requeue), and one that comes after Lightning's teardown (SLURM's SIGTERM after
    ``scontrol requeue``) kills it during its shutdown. The training's own handlers
    (:class:`genolong.train.preemption.StopSignalConnector`) take the signals noted so far
    (:func:`received_at_start`) and put these handlers back when training ends.
    """
    global _FROM_START
    if _FROM_START is None:
        _FROM_START = SignalFlag(signals)
        _FROM_START.install()
    return _FROM_START


def received_at_start() -> tuple[signal.Signals, ...]:
    """The signals the :func:`catch_from_start` handlers noted (empty when not installed)."""
    return () if _FROM_START is None else _FROM_START.local()


def keep_only(signals: Sequence[signal.Signals]) -> None:
    """A recipe's ``train.stop_signals`` narrow :func:`catch_from_start`'s: the others get their
    default action back, and one of them that already came takes it now (a recipe with
    ``stop_signals: []`` asks to be killed)."""
    global _FROM_START
    flag = _FROM_START
    if flag is None:
        return
    for sig in [s for s in flag.signals if s not in signals]:
        handler = flag._previous.pop(sig, signal.SIG_DFL)
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if sig in flag.received:
            import os

            os.kill(os.getpid(), sig)


def ignore_from_now() -> None:
    """The command is done and its status decided: :func:`catch_from_start`'s signals are ignored
    from here to the exit. Python puts the default actions back while it finalizes, and SLURM's
    SIGTERM after ``scontrol requeue`` (or SIGUSR1 due at the same time) arriving then would kill
    the process with 143 or 138 instead of its own status."""
    flag = _FROM_START
    if flag is None or threading.current_thread() is not threading.main_thread():
        return
    for sig in flag._previous:
        signal.signal(sig, signal.SIG_IGN)

"""Collective timeouts: ``parallel.timeout_s`` on every process group, and a rank that stops
answering turned into one line naming it.

torch gives each process group its own timeout, fixed when the group is made: the default group
takes ``init_process_group(timeout=...)`` (Lightning's ``ModelParallelStrategy(timeout=...)``),
but every sub-group made later without one (a ``DeviceMesh`` dimension, a flattened dimension,
Lightning's own mesh) takes torch's library default (30 min on gloo, 10 min on NCCL) instead.
:func:`set_timeout` sets the recipe's value on every group of the job once they exist.

What a backend does at the timeout:

- gloo (CPU): the waiting collective raises ``RuntimeError: ... Timed out waiting Nms for recv
  operation to complete`` in the calling thread. The text names no peer, so :func:`name_stall`
  asks the job who is still there with ``torch.distributed.monitored_barrier`` (gloo's, which
  names on rank 0 every rank that failed to arrive) and raises :class:`CollectiveTimeoutError`:
  one line, with the rank, the operation and where the job was.
- NCCL (GPU): the watchdog thread aborts the process at the timeout
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default: a timed-out CUDA collective leaves the
  device in an unknown state); no Python exception is raised, the watchdog's log names the
  collective (``WorkNCCL(SeqNum=..., OpType=...)``) and the launcher ends the job. The timeout is
  the same; the one line is not.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ..errors import CollectiveTimeoutError

__all__ = [
    "MONITOR_LIMIT_S",
    "collective_name",
    "describe_stall",
    "in_frames",
    "is_collective_timeout",
    "name_stall",
    "set_timeout",
    "stall_guard",
]

#: The longest :func:`name_stall` waits for the ranks to report after a timeout (seconds; less when
#: ``parallel.timeout_s`` is shorter): the live ranks time out within moments of each other, and a
#: job then ends within ``timeout_s`` + this.
MONITOR_LIMIT_S = 30.0

# the messages of a collective that waited past its timeout: gloo's tcp transport ("Timed out
# waiting 15000ms for recv operation to complete"), c10d's DistBackendError / store waits, NCCL's
# blocking wait (TORCH_NCCL_BLOCKING_WAIT=1)
_TIMEOUT_TEXT = re.compile(
    r"timed out waiting|timeout caused pair closure|timed out after|watchdog caught collective operation timeout|"
    r"operation timed out|wait timeout|timeout waiting for key",
    re.IGNORECASE,
)
# a peer that went away (SIGKILL, a crash): gloo reads a closed connection at once
_GONE_TEXT = re.compile(r"connection (reset|closed) by peer|broken pipe", re.IGNORECASE)
# torch.distributed's collectives by their Python names, and what FSDP2 and DCP call them through
_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather_object",
    "all_gather",
    "all_to_all_single",
    "all_to_all",
    "reduce_scatter",
    "broadcast_object_list",
    "broadcast",
    "gather_object",
    "scatter_object_list",
    "gather",
    "scatter",
    "reduce",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
)
_FSDP_STAGES = (
    ("foreach_all_gather", "FSDP all-gather of parameters"),
    ("wait_for_unshard", "FSDP all-gather of parameters"),
    ("foreach_reduce", "FSDP reduce-scatter of gradients"),
    ("post_backward", "FSDP reduce-scatter of gradients"),
)


# (the default group, the monitor group made for it by set_timeout)
_monitor: tuple[object, dist.ProcessGroup] | None = None


def _monitor_group() -> dist.ProcessGroup | None:
    """The monitor group :func:`set_timeout` made for the running default group, or None."""
    if _monitor is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return _monitor[1] if _monitor[0] is dist.distributed_c10d._get_default_group() else None


def set_timeout(timeout_s: float) -> None:
    """Give every process group this rank belongs to (the default group and every sub-group made so
    far: the mesh dimensions, their flattened dimensions, Lightning's mesh) a timeout of
    ``timeout_s`` seconds, and make the job's monitor group (gloo, every rank; what
    :func:`name_stall` asks). A no-op without a process group. A collective: every rank calls it,
    after the last group is made."""
    global _monitor
    if not (dist.is_available() and dist.is_initialized()):
        return
    timeout = timedelta(seconds=timeout_s)
    c10d = dist.distributed_c10d
    if _monitor_group() is None:
        _monitor = (
            c10d._get_default_group(),
            dist.new_group(backend="gloo", timeout=timeout, group_desc="genolong_monitor"),
        )
    for group in list(c10d._world.pg_map):
        if group is not None and not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective that waited past its
    timeout, or one whose peer went away."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (RuntimeError, dist.DistError, TimeoutError)) and (
            _TIMEOUT_TEXT.search(str(e)) or _GONE_TEXT.search(str(e))
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def collective_name(exc: BaseException) -> str:
    """The collective ``exc`` was raised in, from its traceback: the innermost torch.distributed
    call (``all_gather_into_tensor``, ``barrier``, ...) or FSDP2 stage; ``"a collective"`` if none."""
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    for name in reversed(frames):
        if name in _COLLECTIVES:
            return name
        for stage, what in _FSDP_STAGES:
            if stage in name:
                return what
    return "a collective"


def in_frames(exc: BaseException, name: str) -> bool:
    """Whether a function called ``name`` is on ``exc``'s traceback (e.g. ``save_checkpoint``)."""
    return any(f.name == name for f in traceback.extract_tb(exc.__traceback__))


def _stalled_from(text: str) -> list[int] | None:
    """The ranks a ``monitored_barrier`` error names as missing on rank 0 (``Rank 1 failed to pass
    monitoredBarrier``, ``Ranks 1, 3 failed to pass ...``); None if it names none."""
    match = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    return [int(r) for r in re.findall(r"\d+", match.group(1))] if match else None


def name_stall(timeout_s: float) -> tuple[list[int] | None, bool]:
    """After a collective timed out: which ranks are not answering, found with a
    ``monitored_barrier`` of at most :data:`MONITOR_LIMIT_S` s over the job's monitor group (a
    gloo group of every rank made by :func:`set_timeout` and used for nothing else: gloo closes the
    connection of a timed-out collective, so the group that timed out cannot ask).

    Returns:
        ``(ranks, known)``: on rank 0, the ranks that did not arrive (``known`` True; ``[]`` if all
        did); elsewhere ``([0], False)`` when rank 0 did not answer (it, or a rank it waits on),
        or ``(None, False)`` when the barrier could not run (no group, or no monitor group:
        :func:`set_timeout` makes it).
    """
    group = _monitor_group()
    if group is None:
        return None, False
    window = timedelta(seconds=min(timeout_s, MONITOR_LIMIT_S))
    try:
        with _quiet_stderr():  # gloo logs the failure it then raises (a second line)
            dist.monitored_barrier(group, timeout=window, wait_all_ranks=True)
    except RuntimeError as exc:
        text = str(exc)
        ranks = _stalled_from(text)
        if ranks is not None:
            return ranks, True
        if "from rank 0" in text or dist.get_rank() != 0:
            return [0], False
        return None, False
    return [], True


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null inside (C++ logging writes there, not to sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def stall_guard(timeout_s: float, where: Callable[[BaseException], str]) -> Iterator[None]:
    """Turn a collective timeout raised inside into :class:`CollectiveTimeoutError` (one line: the
    rank that stopped answering, the operation, where the job was (``where(exc)``), the timeout); other
    exceptions pass unchanged. Every rank of the job should run the same guarded code."""
    try:
        yield
    except Exception as exc:
        error = describe_stall(exc, timeout_s, where(exc))
        if error is None:
            raise
        raise error from None


def describe_stall(exc: BaseException, timeout_s: float, where: str) -> CollectiveTimeoutError | None:
    """``exc`` as :class:`CollectiveTimeoutError` (asking the job which rank stopped answering:
    :func:`name_stall`, a collective of at most :data:`MONITOR_LIMIT_S` s every live rank runs),
    or None when ``exc`` is no collective timeout or there is no process group."""
    if not is_collective_timeout(exc) or not (dist.is_available() and dist.is_initialized()):
        return None
    op, me = collective_name(exc), dist.get_rank()
    ranks, known = name_stall(timeout_s)
    if known and ranks:
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped answering"
    elif known:
        who = "a rank stopped answering and came back (every rank reached the check after the timeout)"
    elif ranks == [0]:
        who = "rank 0, or a rank it waits on, stopped answering (rank 0's line names it)"
    else:
        who = "a rank stopped answering (the backend does not say which)"
    waited = f"waited {timeout_s:g} s" if _TIMEOUT_TEXT.search(str(exc)) else "lost its connection to a peer"
    return CollectiveTimeoutError(
        f"{who}: rank {me} {waited} in {op} ({where}) and gives up; check that rank's node "
        f"(a hung filesystem, a dead network link, a stopped process), or raise parallel.timeout_s if the ranks "
        f"legitimately wait longer"
    )

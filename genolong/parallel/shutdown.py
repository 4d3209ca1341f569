"""Ending a process that took part in a torch.distributed job.

A gloo process group runs worker threads (``pt_gloo_runloop``) that torch joins only when the last
reference to the group goes, and torch itself keeps references that a program cannot drop: after
``fully_shard`` over a ``DeviceMesh``, ``destroy_process_group`` unregisters the group but the
Python object stays referenced (13 references, none from a garbage-collected object, in a 2-rank
check) and its threads keep running. They then meet the interpreter's finalization, which tears
down modules and objects under them: 2-rank CPU jobs that shard a model with FSDP2 and exit ended
with SIGABRT (``terminate called without an active exception``) or SIGSEGV after all their work
was done, a few runs in a hundred (``benchmarks/rank_exit.py``). A launcher or a scheduler then
reports a finished job as failed.

:func:`exit_process` ends such a process the way ``multiprocessing`` ends its workers: the exit
handlers registered with :mod:`atexit` run (Lightning's, logging's), the standard streams are
flushed, and the process exits with ``os._exit``, without the finalization.
:func:`in_process_group` says whether this process is in that state.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_process", "in_process_group"]


def in_process_group() -> bool:
    """Whether this process has a torch.distributed process group initialized (a rank of a job).

    Does not import torch: a process that never imported ``torch.distributed`` has no group.
    """
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def exit_process(code: int) -> NoReturn:
    """End this process now with exit status ``code``, after the :mod:`atexit` handlers and a
    flush of ``sys.stdout`` / ``sys.stderr``, skipping the interpreter's finalization (see the
    module docstring for why a rank of a gloo job must).

    Files the program still holds open are not flushed by a finalization that does not run: the
    caller has closed its outputs (genolong's writers close and rename theirs before returning).
    """
    # the private name is the interpreter's own: what sys.exit would run before finalizing
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream already closed
            pass
    os._exit(code)

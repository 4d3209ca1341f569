"""Exceptions that carry a user-facing message.

The CLI prints a :class:`GenolongError` as one line and exits non-zero; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CollectiveTimeoutError",
    "DiskFullError",
    "GenolongError",
    "InputError",
    "Stopped",
    "StoreError",
]

#: the exit status of a command stopped by a signal at a safe point (``genolong finetune``: a
#: checkpoint written; ``evaluate`` / ``probe``: the tiles so far committed): 75, ``EX_TEMPFAIL``
#: of sysexits.h, "try again later". Never 0: a stopped run has not finished.
PREEMPTED_EXIT_CODE = 75


class GenolongError(Exception):
    """An error caused by the user's input or environment; the message names the input and the fix."""


class InputError(GenolongError, ValueError):
    """Bad input data or arguments (a FASTA file, a chromosome name, a flag)."""


class StoreError(GenolongError, ValueError):
    """A genome store that is missing, incomplete, damaged, or of another schema version."""


class Stopped(Exception):
    """A command stopped by a signal at a safe point (:mod:`genolong.signals`): the CLI prints the
    message as one line (from the process that should: ``show``) and exits with
    :data:`PREEMPTED_EXIT_CODE`. Not a :class:`GenolongError`: nothing was wrong with the input."""

    def __init__(self, message: str, show: bool = True):
        super().__init__(message)
        self.show = show


class CollectiveTimeoutError(GenolongError, RuntimeError):
    """A collective of a multi-process job that waited past ``parallel.timeout_s`` (or lost its
    peer): the message names the rank that stopped answering, the operation and where the job was."""


class DiskFullError(GenolongError, OSError):
    """An output that could not be written: its filesystem is full (``ENOSPC``, ``EDQUOT``) or the
    file met the process's file-size limit (``EFBIG``, ``ulimit -f``). Raised by
    :func:`genolong.files.writing`, which builds the message (the output, the bytes it needed, the
    free bytes or the limit, the fix); the writer has removed its temporary files and left the
    previous output as it was.

    Attributes:
        errno: ``errno.ENOSPC``, ``errno.EDQUOT`` or ``errno.EFBIG``.
        filename: the output's path (str).
        needed: the bytes the write needed (an estimate), or the bytes it had written when it
            failed (a lower bound; ``needed_is_lower_bound``), or None.
        free: free bytes on the output's filesystem (None if unknown).
    """

    def __init__(
        self, path: str, code: int, message: str, needed: int | None, needed_is_lower_bound: bool, free: int | None
    ) -> None:
        super().__init__(code, message, path)
        self.message = message
        self.needed = needed
        self.needed_is_lower_bound = needed_is_lower_bound
        self.free = free

    def __str__(self) -> str:
        return self.message

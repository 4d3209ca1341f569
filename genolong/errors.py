"""Exceptions that carry a user-facing message.

The CLI prints a :class:`GenolongError` as one line and exits non-zero; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

__all__ = ["CollectiveTimeoutError", "GenolongError", "InputError", "StoreError"]


class GenolongError(Exception):
    """An error caused by the user's input or environment; the message names the input and the fix."""


class InputError(GenolongError, ValueError):
    """Bad input data or arguments (a FASTA file, a chromosome name, a flag)."""


class StoreError(GenolongError, ValueError):
    """A genome store that is missing, incomplete, damaged, or of another schema version."""


class CollectiveTimeoutError(GenolongError, RuntimeError):
    """A collective of a multi-process job that waited past ``parallel.timeout_s`` (or lost its
    peer): the message names the rank that stopped answering, the operation and where the job was."""

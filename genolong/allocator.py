"""CPU runs that keep their freed memory: glibc's allocator told not to hand large blocks back.

glibc serves every request above its mmap threshold (128 KiB at start, raised up to 32 MiB as
blocks are freed) with a fresh ``mmap`` and returns it to the system on ``free``; it also trims
the heap top once more than the trim threshold is free. A long-context CPU run frees and
re-allocates activations of tens to hundreds of MB every layer, so each one is faulted in and
zeroed page by page anew: on main before this module, ``genolong evaluate`` of one 65,536-token
tile spent 38 s of system time beside 47 s of user time (BENCHMARKS.md, "CPU allocator").

:func:`keep_freed_memory` raises both thresholds with ``mallopt`` (through ctypes, so nothing needs
installing): blocks up to ``mmap_threshold`` come from the heap, and up to ``trim_threshold``
bytes of free heap are kept for the next allocation. Every genolong command that runs a model
calls it at start-up, before torch allocates anything; the test suite does too (tests/conftest.py).

What it costs: freed memory stays in the process, so the peak RSS can rise by what the heap's
fragmentation holds; ``benchmarks/cpu_allocator.py`` measures wall, user and system time and the
peak RSS side by side with glibc's defaults, and BENCHMARKS.md states the bound.

Opting out: ``GENOLONG_MALLOC=system`` leaves glibc's defaults. A user who chose for themselves
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` / ``MALLOC_MMAP_MAX_``
or a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``, or another allocator in ``LD_PRELOAD``) is
left alone, and so is a C library that is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from dataclasses import dataclass

__all__ = ["DEFAULT_MMAP_THRESHOLD", "DEFAULT_TRIM_THRESHOLD", "AllocatorSetting", "keep_freed_memory"]

log = logging.getLogger("genolong")

#: blocks up to this size come from the heap and are reused, not mapped afresh (mallopt's
#: argument is a C int, so at most 2 GiB - 1)
DEFAULT_MMAP_THRESHOLD = 1 << 30
#: free heap kept for reuse before glibc trims the top
DEFAULT_TRIM_THRESHOLD = 1 << 30

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_USER_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@dataclass(frozen=True)
class AllocatorSetting:
    """What :func:`keep_freed_memory` did.

    Attributes:
        applied: True when the thresholds were set.
        reason: why not, or what was set (one line, for logs).
        mmap_threshold: bytes, when applied (else None).
        trim_threshold: bytes, when applied (else None).
    """

    applied: bool
    reason: str
    mmap_threshold: int | None = None
    trim_threshold: int | None = None


def _user_choice(environ: os._Environ[str] | dict[str, str]) -> str | None:
    """The allocator setting the user made in the environment, if any (a short description)."""
    for name in _USER_CHOICES:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"LD_PRELOAD ({name})"
    return None


def keep_freed_memory(
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
    trim_threshold: int = DEFAULT_TRIM_THRESHOLD,
    environ: os._Environ[str] | dict[str, str] | None = None,
) -> AllocatorSetting:
    """Set glibc's mmap and trim thresholds so that freed large blocks are kept and reused.

    Args:
        mmap_threshold: requests of at least this many bytes still get their own mapping
            (default 1 GiB; at most 2**31 - 1).
        trim_threshold: free bytes at the heap top kept before trimming (default 1 GiB).
        environ: the environment to read ``GENOLONG_MALLOC`` and the user's own settings from
            (default ``os.environ``).

    Returns:
        what was done; nothing is raised: a platform without glibc, or a user's own choice, just
        leaves the allocator as it is.

    Raises:
        ValueError: a threshold outside ``1 .. 2**31 - 1``; ``GENOLONG_MALLOC`` other than
            ``keep`` or ``system``.
    """
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if not 0 < value < 2**31:
            raise ValueError(f"{name}={value}: glibc's mallopt takes 1 .. 2**31 - 1 bytes")
    env = os.environ if environ is None else environ
    mode = env.get("GENOLONG_MALLOC", "keep")
    if mode not in ("keep", "system"):
        raise ValueError(
            f"GENOLONG_MALLOC={mode!r}: use keep (the default: keep freed memory) or system (glibc's defaults)"
        )
    if mode == "system":
        return AllocatorSetting(False, "GENOLONG_MALLOC=system: glibc's defaults")
    choice = _user_choice(env)
    if choice is not None:
        return AllocatorSetting(False, f"{choice} set by the user: allocator left as it is")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return AllocatorSetting(False, "not glibc: allocator left as it is")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    # the trim threshold first: setting either one also turns off glibc's dynamic adjustment
    if not (libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) and libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)):
        return AllocatorSetting(False, "glibc refused the thresholds: allocator left at its defaults")
    reason = (
        f"glibc malloc keeps freed blocks below {mmap_threshold >> 20} MiB, trims above {trim_threshold >> 20} MiB free"
    )
    log.debug(reason)
    return AllocatorSetting(True, reason, mmap_threshold, trim_threshold)

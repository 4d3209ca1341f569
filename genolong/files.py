"""Outputs that appear whole or not at all: a file through a temporary sibling, a directory built
aside and renamed into place. Used by every writer of genolong (recipes, model configs, the
evaluation results, the quickstart report).

The temporary names are unique to the call (host, process id and a random part), never a fixed
``.NAME.tmp``: two processes that write the same output at the same moment (the ranks of a job on a shared
filesystem, two evaluations started by hand) then each build their own temporary file, and the
last rename wins with a complete file. A fixed name let one process rename the other's half-written
file away (the ``FileNotFoundError`` of issue 13). Multi-process commands still write each output
from one rank only (:mod:`genolong.train.finetune`); this is the second line of defence.

A write that finds no room (a full filesystem or quota, a file-size limit) becomes one
:class:`~genolong.errors.DiskFullError` naming the output and the bytes it needed (:func:`writing`,
used by :func:`replace_file` and by every writer that builds a directory aside); the command line
prints it as one line.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
import re
import resource
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .errors import DiskFullError

__all__ = [
    "disk_full_cause",
    "fsync",
    "fsync_tree",
    "full_disk_error",
    "replace_dir",
    "replace_file",
    "tree_bytes",
    "unique_sibling",
    "writes_output",
    "writing",
]

_F = TypeVar("_F", bound=Callable[..., Any])

#: the errors of a write that found no room: a full filesystem, a full quota, a file-size limit
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: the same in the text of a library's own exception (safetensors: "File too large (os error 27)";
#: pyarrow: "[errno 28] No space left on device")
_FULL_TEXT = re.compile(r"(?:os error|errno)\s*(\d+)", re.IGNORECASE)


def fsync(path: Path) -> None:
    """fsync one file, or one directory's own entries (after a rename inside it; not the files
    beneath: other processes may be renaming their own files in it at the same time)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync a file, or every file and directory of a directory tree (what a rename of the tree
    into place needs on disk first)."""
    if not path.is_dir():
        fsync(path)
        return
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            fsync(Path(dirpath) / name)
        fsync(Path(dirpath))


def unique_sibling(path: Path, kind: str) -> Path:
    """A hidden name beside ``path`` that no other call, process or host picks:
    ``.NAME.<kind>-<host>-<pid>-<random>``. Nothing is created."""
    host = socket.gethostname().split(".")[0] or "host"
    return path.with_name(f".{path.name}.{kind}-{host}-{os.getpid()}-{secrets.token_hex(4)}")


def replace_file(path: Path, write: Callable[[Path], Any], durable: bool = False) -> None:
    """Call ``write(tmp)`` on a hidden sibling ``.NAME.tmp-<host>-<pid>-<random>`` of ``path`` (a name unique to
    this call; the writer creates the file, so it gets the usual permissions), then rename it to
    ``path`` (replacing it); on any error the temporary file is removed and ``path`` is left as it
    was.

    Args:
        path: the output file; its parent must exist.
        write: creates the file at the path it is given and writes the whole content.
        durable: fsync the file before the rename and the directory after it, so that a power
            loss leaves the old or the new file (default False: the rename alone is atomic for
            other processes, which is what a crash of the writer needs).
    """
    path = Path(path)
    tmp = unique_sibling(path, "tmp")
    try:
        with writing(path, work=tmp):
            write(tmp)
        if durable:
            fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync(path.parent)


def replace_dir(work: Path, out: Path) -> None:
    """Rename the finished directory ``work`` to ``out`` (same parent), replacing an existing
    ``out``: the old one is moved aside first and put back if the rename fails, then deleted."""
    if not out.exists():
        os.replace(work, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    os.replace(out, old)
    try:
        os.replace(work, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# -- a full disk or a file-size limit: one error naming the output -------------------------------
def disk_full_cause(exc: BaseException) -> OSError | None:
    """The full-disk error behind ``exc``, or None: ``exc`` itself or an exception in its chain
    (``__cause__`` / ``__context__``; a torch.distributed.checkpoint ``CheckpointException``'s
    per-rank failures) that is an ``OSError`` with errno ``ENOSPC``, ``EDQUOT`` or ``EFBIG``, or
    whose text names one of them (libraries that re-raise an OS error as their own exception:
    safetensors, pyarrow)."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):  # never a full disk, whatever they interrupted
        return None
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple):  # DCP's (exception, traceback) pairs
            todo.extend(x for x in e if isinstance(x, BaseException))
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return e
        text = str(e)
        for match in _FULL_TEXT.finditer(text):
            if int(match.group(1)) in _FULL:
                return OSError(int(match.group(1)), os.strerror(int(match.group(1))))
        for code in _FULL:
            if os.strerror(code) in text:
                return OSError(code, os.strerror(code))
        todo.extend([e.__cause__, e.__context__])
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
    return None


def tree_bytes(path: Path) -> int:
    """Bytes in a file, or in every file under a directory (0 if it does not exist)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    for where in (path, *path.parents):
        if where.exists():
            try:
                return shutil.disk_usage(where).free
            except OSError:
                return None
    return None


def _file_size_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def full_disk_error(exc: BaseException) -> DiskFullError | None:
    """``exc`` as a :class:`DiskFullError` if a full disk or a file-size limit caused it (naming the
    file the operating system named, if any), else None: for errors that no :func:`writing` block
    reported."""
    if isinstance(exc, DiskFullError):
        return exc
    cause = disk_full_cause(exc)
    if cause is None:
        return None
    name = cause.filename or getattr(exc, "filename", None)
    return _full_disk_error(Path(name) if name else None, cause, None, None)


def _full_disk_error(path: Path | None, cause: OSError, needed: int | None, written: int | None) -> DiskFullError:
    code = cause.errno
    free = _free_bytes(path if path is not None else Path.cwd())
    limit = _file_size_limit()
    if needed is None and written is not None and code == errno.EFBIG and limit is not None:
        written = max(written, limit)  # a file of it needed more than the limit
    bound = needed is None and written is not None and written > 0
    amount = needed if needed is not None else written if bound else None
    if amount is None:
        need = ""
    elif bound:
        need = f"; it needed more than {amount:,} bytes"
    else:
        need = f"; it needed about {amount:,} bytes"
    if code == errno.EFBIG:
        what = (
            "File too large: it met this process's file-size limit"
            + (f" of {limit:,} bytes" if limit is not None else "")
            + " (ulimit -f)"
        )
        fix = "raise the limit or write elsewhere, then run again"
    else:
        what = os.strerror(code)  # "No space left on device", "Disk quota exceeded"
        fix = "free space there or write elsewhere, then run again"
    room = f", {free:,} bytes free on its filesystem" if free is not None else ""
    if path is None:  # the operating system did not say which file
        message = (
            f"cannot write a file: {what}{room.replace('its filesystem', 'the working directory filesystem')}; {fix}"
        )
    else:
        message = f"cannot write {path}: {what}{need}{room}; nothing was replaced (earlier outputs are intact); {fix}"
    return DiskFullError(str(path or ""), code or errno.ENOSPC, message, amount, bound, free)


@contextlib.contextmanager
def writing(
    path: str | os.PathLike[str], needed: int | None = None, work: str | os.PathLike[str] | None = None
) -> Iterator[None]:
    """Turn a full disk or a file-size limit met inside the block into one :class:`DiskFullError`
    naming ``path``: the output the user asked for, not a temporary name. Every writer of genolong
    runs its writing under this (through :func:`replace_file` or directly); the command line prints
    the error as one line. Other errors pass unchanged.

    Args:
        path: the output being written (file or directory).
        needed: the bytes the output needs, if the writer can estimate them (the tensors of a
            checkpoint or an export); default None: the bytes found in ``work`` when the write failed
            are reported as a lower bound.
        work: the temporary file or directory the block writes into; a :class:`DiskFullError` raised
            for a path inside it (a file of a directory being built) is reported for ``path``.
    """
    out = Path(path)
    inside = Path(work) if work is not None else None
    try:
        yield
    except BaseException as exc:
        failed = 0  # a file of ``work`` that reported its own full disk: the bytes it needed (then removed)
        if isinstance(exc, DiskFullError):
            own = Path(exc.filename)
            if inside is None or not (own == inside or own.is_relative_to(inside)):
                raise
            failed = exc.needed or 0
        cause = disk_full_cause(exc)
        if cause is None:
            raise
        written = tree_bytes(inside) + failed if needed is None and inside is not None else None
        raise _full_disk_error(out, cause, needed, written) from exc


def writes_output(parameter: str, work: Callable[[Path], Path] | None = None) -> Callable[[_F], _F]:
    """Decorator: the function writes the output given by its argument ``parameter`` (building it in
    ``work(output)``); a full disk or a file-size limit met during the call is reported by
    :func:`writing` for that output."""

    def decorate(fn: _F) -> _F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = Path(signature.bind(*args, **kwargs).arguments[parameter])
            with writing(out, work=work(out) if work is not None else None):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate

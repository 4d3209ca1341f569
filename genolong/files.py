"""Outputs that appear whole or not at all: a file through a temporary sibling, a directory built
aside and renamed into place. Used by every writer of genolong (recipes, model configs, the
evaluation results, the quickstart report).

The temporary names are unique to the call (host, process id and a random part), never a fixed
``.NAME.tmp``: two processes that write the same output at the same moment (the ranks of a job on a shared
filesystem, two evaluations started by hand) then each build their own temporary file, and the
last rename wins with a complete file. A fixed name let one process rename the other's half-written
file away (the ``FileNotFoundError`` of issue 13). Multi-process commands still write each output
from one rank only (:mod:`genolong.train.finetune`); this is the second line of defence.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["fsync", "fsync_tree", "replace_dir", "replace_file", "unique_sibling"]


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

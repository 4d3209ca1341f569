"""Outputs that appear whole or not at all: a file through a temporary sibling, a directory built
aside and renamed into place. Used by every writer of ``genolong.evaluation`` and the quickstart."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["replace_dir", "replace_file"]


def replace_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp)`` on a hidden sibling ``.NAME.tmp`` of ``path``, then rename it to ``path``
    (replacing it); on any error the temporary file is removed and ``path`` is left as it was."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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

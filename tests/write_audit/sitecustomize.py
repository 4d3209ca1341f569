"""Write audit for multi-process tests: loaded into every process of a job by putting this folder
on ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up, in the torchrun and Lightning
children too); inert unless ``GENOLONG_WRITE_AUDIT`` names a folder.

In each process it records every file opened for writing, every rename and every removal under
``GENOLONG_WRITE_AUDIT_ROOT`` (the run directory) to ``<audit>/rank<R>.jsonl``, and it makes the
write races happen on purpose: before each rename into the root, a process waits at a rendezvous
named after the destination until all ``GENOLONG_WRITE_AUDIT_WORLD`` ranks have arrived there (or
``GENOLONG_WRITE_AUDIT_WAIT`` seconds, default 2, have passed), so that ranks that write the same
output rename at the same instant, as ranks started together on a cluster do. Each destination's
rendezvous is held once (its first rename), so a correct job, where one rank writes each output,
loses at most the wait per output.

The rank is ``RANK`` (torchrun, SLURM through Lightning), else ``LOCAL_RANK`` (the children that
Lightning starts on one machine), else 0.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import shutil
import time

_AUDIT = os.environ.get("GENOLONG_WRITE_AUDIT")
_ROOT = os.environ.get("GENOLONG_WRITE_AUDIT_ROOT")

if _AUDIT and _ROOT:
    _rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    _world = int(os.environ.get("GENOLONG_WRITE_AUDIT_WORLD", "1"))
    _wait = float(os.environ.get("GENOLONG_WRITE_AUDIT_WAIT", "2"))
    _root = os.path.realpath(_ROOT)
    _arrivals = os.path.join(_AUDIT, "arrivals")
    os.makedirs(_arrivals, exist_ok=True)
    _real_open, _real_io_open = builtins.open, io.open
    _real_replace, _real_rename = os.replace, os.rename
    _real_remove, _real_unlink, _real_rmtree = os.remove, os.unlink, shutil.rmtree
    _log = _real_open(os.path.join(_AUDIT, f"rank{_rank}.jsonl"), "a", buffering=1)
    _held: set[str] = set()

    def _inside(path: object) -> str | None:
        if isinstance(path, int):
            return None
        try:
            full = os.path.realpath(os.fspath(path))  # type: ignore[arg-type]
        except TypeError:
            return None
        return full if full == _root or full.startswith(_root + os.sep) else None

    def _record(op: str, path: str, **extra: object) -> None:
        _log.write(
            json.dumps({"rank": _rank, "pid": os.getpid(), "op": op, "path": os.path.relpath(path, _root), **extra})
            + "\n"
        )

    def _rendezvous(dst: str) -> None:
        if _world < 2 or dst in _held:
            return
        _held.add(dst)
        key = hashlib.sha1(dst.encode()).hexdigest()[:16]
        _real_open(os.path.join(_arrivals, f"{key}.{_rank}"), "w").close()
        deadline = time.monotonic() + _wait
        while time.monotonic() < deadline:
            if sum(name.startswith(key + ".") for name in os.listdir(_arrivals)) >= _world:
                return
            time.sleep(0.005)

    def _open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        full = _inside(file) if any(c in mode for c in "wax+") else None
        if full is not None:
            _record("write", full, mode=mode)
        return _real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]

    def _renamer(real, op: str):  # type: ignore[no-untyped-def]
        def rename(src: object, dst: object, *args: object, **kwargs: object) -> None:
            full = _inside(dst)
            if full is not None:
                _rendezvous(full)
                _record(op, full, source=os.path.relpath(os.path.realpath(os.fspath(src)), _root))  # type: ignore[arg-type]
            real(src, dst, *args, **kwargs)

        return rename

    def _remover(real, op: str):  # type: ignore[no-untyped-def]
        def remove(path: object, *args: object, **kwargs: object) -> None:
            # path-based calls only: a name relative to a dir_fd (inside rmtree) is not ours to resolve
            full = None if kwargs.get("dir_fd") is not None else _inside(path)
            if full is not None:
                _record(op, full)
            real(path, *args, **kwargs)

        return remove

    builtins.open = io.open = _open  # type: ignore[assignment]
    os.remove = _remover(_real_remove, "remove")  # type: ignore[assignment]
    os.unlink = _remover(_real_unlink, "remove")  # type: ignore[assignment]
    shutil.rmtree = _remover(_real_rmtree, "remove")  # type: ignore[assignment]
    os.replace = _renamer(_real_replace, "replace")  # type: ignore[assignment]
    os.rename = _renamer(_real_rename, "rename")  # type: ignore[assignment]

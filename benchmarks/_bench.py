"""What the benchmark scripts share: runs in a fresh process (wall time, CPU time, peak RSS, the
child's JSON line), this process's own peak RSS, the machine header of a result file, and the
atomic writing of that file.

The scripts run as ``python benchmarks/NAME.py`` (this folder is then ``sys.path[0]``) and are also
imported by the tests (``benchmarks.NAME``, or from their path); each one makes this folder
importable, then imports from here::

    sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
    from _bench import environment, run_fresh, write_json  # noqa: E402

Appending (not inserting in front) keeps the scripts' names from shadowing anything else when a test
imports one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genolong.files import replace_file

__all__ = [
    "Fresh",
    "FreshRun",
    "environment",
    "fresh_python",
    "marginal_slope",
    "median_row",
    "mem_available_bytes",
    "peak_rss_bytes",
    "run_fresh",
    "sweep_arguments",
    "sweep_fresh",
    "utc_now",
    "wait_any",
    "write_json",
]

GiB = 2**30


# --------------------------------------------------------------------------------------------------
# Fresh processes
# --------------------------------------------------------------------------------------------------


@dataclass
class FreshRun:
    """One ended child process: its figures as the kernel counted them (``os.wait4`` in the launcher:
    the command's own rusage, so its peak RSS is neither this process's nor the launcher's) and what it printed.

    Attributes:
        cmd: the command line.
        returncode: its exit code (negative: the signal that ended it, e.g. -9 from the OOM killer).
        wall_s: seconds from its start to its end (``time.perf_counter`` in the launcher).
        user_s, system_s: its CPU seconds in user and kernel mode.
        minor_faults: its minor page faults.
        peak_rss_bytes: its peak resident set (``ru_maxrss``, KiB on Linux, times 1024).
        output: its stdout and stderr together (empty when they went to a log file).
    """

    cmd: list[str]
    returncode: int
    wall_s: float
    user_s: float
    system_s: float
    minor_faults: int
    peak_rss_bytes: int
    output: str = ""

    @property
    def ok(self) -> bool:
        """Whether the child exited with code 0."""
        return self.returncode == 0

    def failure(self, tail: int = 3000) -> str:
        """A message naming the command, how it ended and the last ``tail`` characters of its output."""
        return (
            f"{' '.join(self.cmd)} failed with exit code {self.returncode} after {self.wall_s:.0f} s, peak RSS "
            f"{self.peak_rss_bytes / GiB:.2f} GiB:\n{self.output[-tail:]}"
        )

    def check(self) -> FreshRun:
        """Exit this script with :meth:`failure` unless the child succeeded (a benchmark stops at a
        failed run rather than report half a table); returns ``self``."""
        if not self.ok:
            sys.exit(self.failure())
        return self

    def last_json(self) -> Any:
        """The last line of the output that parses as JSON (the figures a worker child prints last;
        stdout and stderr are one stream, so a warning may follow them). ``ValueError`` if none does."""
        for line in reversed(self.output.strip().splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
        raise ValueError(f"no JSON line in the output of {' '.join(self.cmd)}:\n{self.output[-3000:]}")


# A child's ``ru_maxrss`` starts at the peak RSS of the process that spawned it: Linux carries the
# high-water mark of the address space the child had before ``exec`` (the parent's, shared under
# vfork, copied under fork) into the child's. Spawned from a benchmark script that holds torch and
# a model, or from pytest, a child of 100 MB would read as 300 MB or more. So every command starts
# from this launcher, a bare interpreter (-I -S: about 10 MB, the floor of what can be measured),
# which spawns the command, waits for it and reports the command's own rusage on a pipe.
_LAUNCHER = """
import json, os, sys, time
fd, cmd = int(sys.argv[1]), sys.argv[2:]
t0 = time.perf_counter()
pid = os.posix_spawnp(cmd[0], cmd, os.environ)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
os.write(fd, json.dumps({"returncode": os.waitstatus_to_exitcode(status), "wall_s": wall, "user_s": ru.ru_utime,
                         "system_s": ru.ru_stime, "minor_faults": ru.ru_minflt, "maxrss_kib": ru.ru_maxrss}).encode())
"""


@dataclass
class Fresh:
    """A started child (see :func:`run_fresh`); :meth:`wait` or :func:`wait_any` ends it. ``extra``:
    what the caller keeps with it (e.g. which job it is)."""

    cmd: list[str]
    proc: subprocess.Popen
    t0: float
    report_fd: int  # the read end of the launcher's report pipe
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log: str | Path | None = None,
        **extra: Any,
    ) -> Fresh:
        """Start ``cmd`` (through the small launcher, see :data:`_LAUNCHER`); its stdout and stderr
        go to ``log`` when given, else to a pipe that :meth:`wait` reads. ``extra`` is kept for the
        caller (e.g. which job this is)."""
        cmd = [str(c) for c in cmd]
        env = dict(env) if env is not None else None
        report_r, report_w = os.pipe()
        launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(report_w), *cmd]
        try:
            if log is not None:
                with open(log, "wb") as out:  # the child keeps its own descriptor
                    proc = subprocess.Popen(
                        launcher, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, pass_fds=(report_w,)
                    )
            else:
                proc = subprocess.Popen(
                    launcher, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(report_w,)
                )
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)  # the launcher holds the write end now: EOF when it ends
        return cls(cmd, proc, time.perf_counter(), report_r, Path(log) if log is not None else None, extra)

    def wait(self) -> FreshRun:
        """Read its output to the end, reap it and return its figures."""
        output = b""
        if self.proc.stdout is not None:
            output = self.proc.stdout.read()  # before waiting: a full pipe would block the child
            self.proc.stdout.close()
        _, status, usage = os.wait4(self.proc.pid, 0)
        return self._ended(status, usage, output)

    def _ended(self, status: int, usage: resource.struct_rusage, output: bytes = b"") -> FreshRun:
        wall = time.perf_counter() - self.t0
        self.proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        with os.fdopen(self.report_fd, "rb") as handle:
            report = handle.read()
        if self.log is not None:
            output = self.log.read_bytes()
        text = output.decode(errors="replace")
        if not report:  # the launcher failed before it could run the command (e.g. not found): its own figures
            return FreshRun(
                self.cmd,
                self.proc.returncode or 1,
                wall,
                usage.ru_utime,
                usage.ru_stime,
                int(usage.ru_minflt),
                int(usage.ru_maxrss) * 1024,
                text,
            )
        r = json.loads(report)
        return FreshRun(
            self.cmd,
            r["returncode"],
            r["wall_s"],
            r["user_s"],
            r["system_s"],
            r["minor_faults"],
            r["maxrss_kib"] * 1024,
            text,
        )


def run_fresh(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    log: str | Path | None = None,
) -> FreshRun:
    """Run ``cmd`` in a fresh process to its end and return its wall time, CPU time, faults, peak RSS
    and output (:class:`FreshRun`; call ``.check()`` to stop at a failure).

    Args:
        cmd: the command line (items are turned into strings).
        env: its whole environment (default: this process's).
        cwd: its working directory (default: this one).
        log: a file for its stdout and stderr (default: a pipe; the output is in the result either way).
    """
    return Fresh.start(cmd, env, cwd, log).wait()


def fresh_python(code: str, env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> FreshRun:
    """:func:`run_fresh` of ``python -c code`` with this interpreter."""
    return run_fresh([sys.executable, "-c", code], env, cwd)


def wait_any(running: Iterable[Fresh]) -> Iterable[tuple[Fresh, FreshRun]]:
    """Yield ``(child, figures)`` for each of the started children as it ends, in the order they
    end (the children must write to a ``log``: nothing reads their pipes meanwhile). Other
    children of this process that end meanwhile are reaped and passed over."""
    by_pid = {f.proc.pid: f for f in running}
    while by_pid:
        pid, status, usage = os.wait4(-1, 0)
        if pid in by_pid:
            child = by_pid.pop(pid)
            yield child, child._ended(status, usage)


def sweep_fresh(
    script: str | Path,
    lengths: Sequence[int],
    args: Sequence[str],
    repeats: int = 1,
    env: Mapping[str, str] | None = None,
    skip: Callable[[int, dict[int, list[dict]]], str | None] | None = None,
    done: Callable[[int, int, dict, dict[int, list[dict]]], None] | None = None,
) -> tuple[dict[int, list[dict]], dict[int, str]]:
    """Run ``python script --worker --T=T *args`` in a fresh process for each length, ``repeats``
    rounds with the lengths alternating inside each round (a burst of load on a shared machine then
    hits every length alike), and collect each worker's last JSON line.

    Args:
        script: the benchmark script (its ``--worker`` mode prints one JSON line).
        lengths: the T values, in order.
        args: the worker's other arguments.
        repeats: rounds over all lengths.
        env: the workers' environment (default: this process's).
        skip: ``skip(T, runs)`` -> a reason to leave T out from now on, or None (e.g. a memory guard).
        done: ``done(round, T, run, runs)`` after each run (printing, keeping partial results).

    Returns:
        ``(runs, skipped)``: the runs per length and the reason per skipped length. A failed worker
        ends this script with its exit code and the tail of its output (a sweep stops at the first
        failure: the figures of the others would be compared with nothing).
    """
    runs: dict[int, list[dict]] = {T: [] for T in lengths}
    skipped: dict[int, str] = {}
    for i in range(repeats):
        for T in lengths:
            if T in skipped:
                continue
            why = skip(T, runs) if skip is not None else None
            if why is not None:
                skipped[T] = why
                print(f"  skip T={T}: {why}", flush=True)
                continue
            r = run_fresh([sys.executable, str(Path(script).resolve()), "--worker", f"--T={T}", *args], env=env)
            if not r.ok:
                print(f"T={T} FAILED: {r.output.strip()[-2000:]}", file=sys.stderr)
                raise SystemExit(1)
            run = r.last_json()
            runs[T].append(run)
            if done is not None:
                done(i, T, run, runs)
    return runs, skipped


def sweep_arguments(p: argparse.ArgumentParser, lengths: str, default_json: Path) -> None:
    """Add a length sweep's common options to ``p``: ``--lengths`` (default ``lengths``),
    ``--threads`` (default min(2, cores)), ``--json`` (default ``default_json``), and the hidden
    ``--worker`` / ``--T`` that :func:`sweep_fresh` passes to the fresh workers."""
    p.add_argument("--lengths", default=lengths, help="comma-separated T values")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--json", type=Path, default=default_json)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, default=0, help=argparse.SUPPRESS)


def median_row(T: int, runs: Sequence[dict], keys: Iterable[str]) -> dict[str, Any]:
    """A result row for length ``T``: the runs themselves and the median of each of ``keys``."""
    row: dict[str, Any] = {"T": T, "runs": list(runs)}
    for key in keys:
        row[key] = statistics.median(r[key] for r in runs)
    return row


def marginal_slope(rows: Sequence[dict], row: dict, key: str) -> float | None:
    """Bytes (or any ``key``) per added token from the last of ``rows`` to ``row``: constant while
    growth is linear in T; None for the first row or an equal T."""
    prev = rows[-1] if rows else None
    if prev is None or row["T"] == prev["T"]:
        return None
    return (row[key] - prev[key]) / (row["T"] - prev["T"])


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, in bytes (``ru_maxrss``: a high-water mark that never
    goes down; KiB on Linux). In a fresh worker process, the difference of two readings is what the
    code between them added to the peak."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------------------------------
# The machine header and the result file
# --------------------------------------------------------------------------------------------------


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the second (the ``date`` of a result file)."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _torch_version() -> str:
    import torch  # only the scripts that record it pay for the import

    return torch.__version__


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def mem_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# The keys the result files have carried, each with how it is measured. Several names for one
# figure (``cpus``/``nproc``, ``date``/``time``, the load average at start or end) are kept so that
# each script writes the keys its earlier result files have and stays comparable with them.
_FIELDS: dict[str, Callable[[], Any]] = {
    "date": utc_now,
    "time": utc_now,
    "host": lambda: socket.gethostname(),
    "cpus": os.cpu_count,
    "nproc": os.cpu_count,
    "platform": platform.platform,
    "machine": platform.platform,  # the flat files' "machine" is the platform string
    "python": platform.python_version,
    "torch": _torch_version,
    "threads": _torch_threads,
    "loadavg": os.getloadavg,
    "loadavg_at_start": os.getloadavg,
    "loadavg_at_end": os.getloadavg,
    "loadavg_at_write": os.getloadavg,
    "load_average_at_start": os.getloadavg,
    "load_average_at_end": os.getloadavg,
    "mem_available_bytes": mem_available_bytes,
}

DEFAULT_FIELDS = ("date", "host", "cpus", "platform", "python", "torch", "loadavg")


def environment(*keys: str) -> dict[str, Any]:
    """The machine and environment header of a result file, measured now, with the given keys in
    the given order (default :data:`DEFAULT_FIELDS`: date, host, cpus, platform, python, torch,
    load average). Known keys: those of ``_FIELDS``; an unknown one is a ``KeyError``."""
    return {k: _FIELDS[k]() for k in (keys or DEFAULT_FIELDS)}


def genolong_command(*args: Any) -> list[str]:
    """The ``genolong`` command line with ``args`` (made strings), run by this interpreter."""
    return [sys.executable, "-m", "genolong.cli", *map(str, args)]


def sample_store(store: Path | None, work: Path) -> Path:
    """``store`` when given, else the bundled sample prepared as the quickstart prepares it
    (chr1,3,4,5 train, chr22 held out) in ``work/genome``; one already there is reused."""
    if store is not None:
        return store
    store = work / "genome"
    if not (store / "manifest.json").exists():
        from genolong.quickstart import prepare_sample

        prepare_sample(store, progress=False)
    return store


def write_json(path: str | Path, doc: Any, indent: int | None = 1, **dumps: Any) -> Path:
    """Write ``doc`` as JSON (``indent``, a final newline, ``json.dumps`` keywords such as
    ``default`` or ``allow_nan``) to ``path`` atomically: a temporary sibling renamed into place,
    so a reader sees the old file or the new one, never half of one. Creates the parent folders."""
    path = Path(path)
    text = json.dumps(doc, indent=indent, **dumps) + "\n"  # before the file exists: a bad value writes nothing
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda tmp: tmp.write_text(text))
    return path

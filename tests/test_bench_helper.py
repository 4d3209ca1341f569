"""benchmarks/_bench.py: fresh-process figures, the machine header and atomic JSON result files.

One child process for the whole file (a module fixture, started and collected the way the scripts
with parallel children do it): it allocates and touches a known 48 MiB numpy array, so its peak RSS
must exceed that, prints a JSON line the helper must read back, and exits with code 3.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import _bench

ARRAY_BYTES = 48 * 2**20
SNIPPET = (
    f"import json, numpy as np; a = np.ones({ARRAY_BYTES // 8}, dtype=np.float64); "
    "print('noise first'); print(json.dumps({'sum': float(a.sum()), 'pid': __import__('os').getpid()})); "
    "raise SystemExit(3)"
)


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> _bench.FreshRun:
    log = tmp_path_factory.mktemp("bench") / "child.log"
    started = _bench.Fresh.start([sys.executable, "-c", SNIPPET], log=log, job="numpy")
    ended = list(_bench.wait_any([started]))
    assert [c.extra["job"] for c, _ in ended] == ["numpy"]
    assert log.read_text() == ended[0][1].output  # the output is read back from the log
    return ended[0][1]


def test_fresh_process_figures(child: _bench.FreshRun) -> None:
    assert not child.ok and child.returncode == 3, child.output  # the command's code, not the launcher's
    assert child.last_json()["sum"] == ARRAY_BYTES // 8
    assert child.last_json()["pid"] != os.getpid()  # a fresh process, not this one
    # The child's own peak (the touched array and the interpreter with numpy), not this test process's
    # (pytest with torch: 300 MB here; spawned directly, the child read as that).
    assert ARRAY_BYTES < child.peak_rss_bytes < ARRAY_BYTES + 120 * 2**20, child.peak_rss_bytes
    assert child.wall_s > 0 and child.user_s + child.system_s > 0 and child.minor_faults > 0
    assert child.cmd[:2] == [sys.executable, "-c"]


def test_failed_child_is_named_with_its_output(child: _bench.FreshRun) -> None:
    assert "exit code 3" in child.failure() and "noise first" in child.failure()
    with pytest.raises(SystemExit, match="exit code 3"):
        child.check()
    ok = _bench.FreshRun(["true"], 0, 0.1, 0.0, 0.0, 1, 2**20, "{}")
    assert ok.check() is ok


def test_peak_rss_of_this_process_never_goes_down() -> None:
    first = _bench.peak_rss_bytes()
    assert first > 10 * 2**20 and _bench.peak_rss_bytes() >= first


def test_environment_keeps_the_keys_asked_for() -> None:
    env = _bench.environment("time", "nproc", "machine", "loadavg_at_end")
    assert list(env) == ["time", "nproc", "machine", "loadavg_at_end"]
    assert env["nproc"] == os.cpu_count() and isinstance(env["machine"], str) and len(env["loadavg_at_end"]) == 3
    assert env["time"].endswith("+00:00") and len(env["time"]) == len("2026-01-01T00:00:00+00:00")
    assert list(_bench.environment()) == list(_bench.DEFAULT_FIELDS)
    with pytest.raises(KeyError):
        _bench.environment("no-such-key")


def test_write_json_round_trip_and_atomic(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "result.json"
    doc = {"benchmark": "x", **_bench.environment("date", "cpus", "loadavg"), "rows": [{"T": 1024, "s": 0.5}]}
    assert _bench.write_json(path, doc) == path
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc)) and path.read_text().endswith("\n")
    with pytest.raises(ValueError):  # a value strict JSON cannot hold: the old file stays, no temporary left
        _bench.write_json(path, {"nan": float("nan")}, allow_nan=False)
    assert json.loads(path.read_text())["benchmark"] == "x"
    assert sorted(p.name for p in path.parent.iterdir()) == ["result.json"]

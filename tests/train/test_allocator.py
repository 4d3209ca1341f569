"""genolong.allocator: CPU runs keep freed memory (glibc mallopt), opt-outs respected.

The effect is measured, not assumed: a child process that allocates, fills and frees a 64 MiB
tensor 20 times takes a fresh page fault for every page each time under glibc's defaults (the
block is above glibc's mmap threshold, mapped and unmapped every time) and none with genolong's
setting once the heap has grown to fit (10 warm-up rounds: torch's 64-byte aligned requests are a
little larger than the block freed before, so the heap grows a few times first; measured 6). Fault counts, not times: they do not depend on how busy the machine is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from genolong import cli
from genolong.allocator import keep_freed_memory

_CHILD = """
import resource, sys
from genolong.allocator import keep_freed_memory
setting = keep_freed_memory()
import torch
torch.set_num_threads(1)
for _ in range(10):  # warm-up: the heap grows until the freed blocks fit the next request
    x = torch.ones(16 << 20)  # 64 MiB of float32
    del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    x = torch.ones(16 << 20)
    del x
print(setting.applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env["GENOLONG_MALLOC"] = mode
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_keeping_freed_memory_removes_the_page_faults_of_reallocation() -> None:
    applied, kept = _faults("keep")
    not_applied, system = _faults("system")
    assert applied and not not_applied
    pages = 20 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    # glibc's defaults: every page of every allocation faulted in anew (seen: ~1.0 x pages)
    assert system > 0.8 * pages, (system, pages)
    # kept: the block is reused from the heap (seen: 0 to 16,384 faults, i.e. at most one more
    # growth of the heap, for 327,680 pages)
    assert kept < 0.2 * pages, (kept, pages)


@pytest.mark.parametrize(
    "environ, reason",
    [
        ({"GENOLONG_MALLOC": "system"}, "GENOLONG_MALLOC=system"),
        ({"MALLOC_MMAP_THRESHOLD_": "1000000"}, "MALLOC_MMAP_THRESHOLD_ set by the user"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES set by the user"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD (jemalloc) set by the user"),
    ],
)
def test_the_users_own_choice_is_left_alone(environ: dict[str, str], reason: str) -> None:
    setting = keep_freed_memory(environ=environ)
    assert not setting.applied and setting.reason.startswith(reason)


def test_bad_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="GENOLONG_MALLOC='fast': use keep"):
        keep_freed_memory(environ={"GENOLONG_MALLOC": "fast"})
    with pytest.raises(ValueError, match=r"mmap_threshold=4294967296: glibc's mallopt takes 1 \.\. 2\*\*31 - 1"):
        keep_freed_memory(mmap_threshold=1 << 32, environ={})


def test_the_model_commands_set_it_at_start_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    called: list[str] = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: called.append("set"))
    # both end in a one-line user error (no such recipe / result): what counts is the start-up
    assert cli.main(["finetune", str(tmp_path / "missing.yaml")]) == 2 and called == ["set"]
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2 and called == ["set"]  # runs no model

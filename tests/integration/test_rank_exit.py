"""How a process that took part in a torch.distributed job ends (genolong.parallel.shutdown).

A rank whose gloo groups are still referenced when the interpreter finalizes can abort after its
work is done (SIGABRT, "terminate called without an active exception": twice in CI, and a few jobs
in a hundred in ``benchmarks/rank_exit.py``). :func:`exit_process` ends it without that
finalization; the ``genolong`` console script takes that way out exactly when a process group is
still initialized. Each case runs in a fresh interpreter and checks what a caller relies on: the
exit status, the standard streams flushed, the ``atexit`` handlers run, and whether finalization
ran (a module-level object's ``__del__``, which only finalization calls here, leaves a file).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# the child: an atexit handler and a finalizer that each leave a file, output with no newline at
# the end (still in the buffer at exit), a 1-process gloo group when asked; then it runs CODE
_PRELUDE = """
import atexit, sys
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
class Finalized:
    def __del__(self):
        (out / "finalized").write_text("ran")
KEEP = Finalized()
def join_group():
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{out / 'pg_init'}", rank=0, world_size=1)
sys.stdout.write("partial line")
"""


def _child(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )


def test_exit_process_runs_the_exit_handlers_flushes_and_skips_finalization(tmp_path: Path) -> None:
    run = _child(tmp_path, "join_group()\nfrom genolong.parallel.shutdown import exit_process\nexit_process(3)\n")
    assert run.returncode == 3, run.stderr
    assert run.stdout == "partial line"
    assert (tmp_path / "atexit").exists()
    assert not (tmp_path / "finalized").exists()


@pytest.mark.parametrize("group", [True, False])
def test_the_console_script_skips_finalization_only_in_a_process_group(tmp_path: Path, group: bool) -> None:
    # genolong.cli.entry around a stand-in main that returns 5 (after joining a group, or not)
    code = (
        "import genolong.cli as cli\n"
        f"def main():\n    {'join_group()' if group else 'pass'}\n    return 5\n"
        "cli.main = main\ncli.entry()\n"
    )
    run = _child(tmp_path, code)
    assert run.returncode == 5, run.stderr
    assert run.stdout == "partial line"
    assert (tmp_path / "atexit").exists()
    assert (tmp_path / "finalized").exists() is not group


def test_in_process_group_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom genolong.parallel.shutdown import in_process_group\n"
        "assert not in_process_group()\nassert 'torch' not in sys.modules, 'torch imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr

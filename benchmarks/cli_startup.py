#!/usr/bin/env python
"""Start-up of the ``genolong`` command line: wall and CPU time of commands that load no model.

Each command runs in a fresh process (``python -m genolong.cli ARGS``), the current tree and, with
``--baseline DIR``, another checkout of genolong (e.g. ``git worktree add /tmp/old c56b61f``) run
side by side, interleaved (current, baseline, current, ...), because the machine is shared and
noisy; medians and the ratio baseline / current are reported. The baseline runs with ``DIR`` as its
working directory, so its ``genolong`` package is the one imported (its ``genolong.kernels`` and
``genolong.evaluation`` still come from this install: the command line loads neither for these
commands). Also recorded: whether torch or Lightning were imported by each command in this tree.

Example::

    python benchmarks/cli_startup.py --baseline /tmp/old --repeats 5

Prints a table and writes JSON (default benchmarks/results/cli_startup.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, run_fresh, write_json  # noqa: E402

ROOT = HERE.parent
#: the commands timed: ``--help`` and the help of the commands that must not load torch
COMMANDS = (("--help",), ("prepare", "--help"), ("plan", "--help"), ("compare", "--help"), ("plot", "--help"))
_PROBE = (
    "import sys, runpy; sys.argv = ['genolong', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('genolong.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
    "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning'}), file=sys.stderr)"
)


def _time(args: tuple[str, ...], cwd: Path) -> tuple[float, float, str]:
    """(wall s, CPU s, what it reported loading) of one fresh ``genolong ARGS``."""
    run = run_fresh([sys.executable, "-c", _PROBE, *args], cwd=cwd).check()
    loaded = next((line for line in run.output.splitlines() if line.startswith("LOADED")), "LOADED ?")
    return run.wall_s, run.user_s + run.system_s, loaded.removeprefix("LOADED ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another genolong checkout to time side by side")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cli_startup.json")
    args = parser.parse_args()

    rows = []
    # the current tree runs from outside the source tree, as an installed genolong does
    here = Path("/")
    for command in COMMANDS:
        current, baseline, loaded = [], [], ""
        for _ in range(args.repeats):
            wall, cpu, loaded = _time(command, here)
            current.append((wall, cpu))
            if args.baseline:
                baseline.append(_time(command, args.baseline)[:2])
        row = {
            "command": "genolong " + " ".join(command),
            "loads": loaded,
            "wall_s": statistics.median(w for w, _ in current),
            "cpu_s": statistics.median(c for _, c in current),
        }
        if baseline:
            row |= {
                "baseline_wall_s": statistics.median(w for w, _ in baseline),
                "baseline_cpu_s": statistics.median(c for _, c in baseline),
            }
            row["ratio"] = row["baseline_wall_s"] / row["wall_s"]
        rows.append(row)

    print(f"{'command':<26} {'wall s':>7} {'CPU s':>6} {'baseline wall s':>15} {'ratio':>6}  loads")
    for r in rows:
        base = f"{r['baseline_wall_s']:15.2f} {r['ratio']:6.1f}" if "ratio" in r else f"{'':>15} {'':>6}"
        print(f"{r['command']:<26} {r['wall_s']:7.2f} {r['cpu_s']:6.2f} {base}  {r['loads']}")
    print(f"medians of {args.repeats} fresh processes; ratio = baseline / current wall time")
    write_json(
        args.json, {**environment(), "repeats": args.repeats, "baseline": str(args.baseline or ""), "rows": rows}
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

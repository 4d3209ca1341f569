#!/usr/bin/env python
"""How often a finished rank of a 2-process gloo job dies on its way out, by how it ends.

Each job: two processes spawned by ``torch.multiprocessing`` (one torch thread each) join a gloo
process group, shard an 8-layer MLP with FSDP2 over a 1-D ``DeviceMesh`` and run ``--forwards``
forward passes; then every rank ends one of three ways, interleaved job by job
(``plain``, ``destroy``, ``genolong``, ``plain``, ...):

- ``plain``: returns; the interpreter exits as usual (what a Lightning-launched rank did);
- ``destroy``: ``dist.barrier()``, ``dist.destroy_process_group()``, then returns;
- ``genolong``: as ``destroy``, then :func:`genolong.parallel.shutdown.exit_process` (the way the
  ``genolong`` console script and the tests' ranks now end).

A job failed when a rank's exit status is not 0 (SIGABRT, ``terminate called without an active
exception``, and SIGSEGV were seen): its work was done by then. The table gives the failed jobs
per way with a 95% Wilson interval; the JSON the signals.

Example::

    python benchmarks/rank_exit.py                       # 60 jobs per way
    python benchmarks/rank_exit.py --jobs 20 --json /tmp/rank_exit.json
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import environment, write_json  # noqa: E402

WAYS = ("plain", "destroy", "genolong")


def _rank(rank: int, world: int, init_file: str, way: str, forwards: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for _ in range(forwards):
            model(torch.randn(4, 64))
    if way == "plain":
        return
    dist.barrier()
    dist.destroy_process_group()
    if way == "genolong":
        from genolong.parallel.shutdown import exit_process

        exit_process(0)


def _job(way: str, init_file: str, forwards: int) -> list[int]:
    """One 2-rank job; the ranks' exit statuses (negative: the signal that ended it)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank, args=(2, init_file, way, forwards), nprocs=2, join=False, start_method="spawn")
    for process in ctx.processes:
        process.join(120)
        if process.is_alive():  # a hang counts as a failure too
            process.kill()
            process.join()
    return [p.exitcode for p in ctx.processes]


def wilson(failed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of the proportion ``failed / n``."""
    if n == 0:
        return (0.0, 1.0)
    p = failed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--jobs", type=int, default=60, help="2-rank jobs per way (default 60)")
    parser.add_argument(
        "--ways", default=",".join(WAYS), help=f"comma-separated subset of {','.join(WAYS)} (default all)"
    )
    parser.add_argument("--forwards", type=int, default=10, help="forward passes per job (default 10)")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "rank_exit.json"))
    args = parser.parse_args(argv)
    ways = [w for w in WAYS if w in args.ways.split(",")]
    if not ways or len(ways) != len(set(args.ways.split(","))):
        parser.error(f"--ways {args.ways}: give some of {','.join(WAYS)}")

    statuses: dict[str, list[list[int]]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="genolong-rank-exit-") as scratch:
        for job in range(args.jobs):
            for way in ways:
                statuses[way].append(_job(way, f"{scratch}/init_{way}_{job}", args.forwards))
    rows = []
    for way in ways:
        failed = [s for s in statuses[way] if any(code != 0 for code in s)]
        low, high = wilson(len(failed), args.jobs)
        signals = sorted({code for s in failed for code in s if code != 0})
        rows.append(
            {"way": way, "jobs": args.jobs, "failed": len(failed), "ci95": [low, high], "exit_statuses_seen": signals}
        )
    print(
        f"2-rank gloo jobs, FSDP2 over an 8-layer MLP, {args.forwards} forwards each; {args.jobs} jobs per way, interleaved"
    )
    print(f"{'way':>9} {'failed':>7} {'share':>7} {'95% interval':>15}  statuses")
    for row in rows:
        low, high = row["ci95"]
        print(
            f"{row['way']:>9} {row['failed']:>4}/{row['jobs']:<3} {row['failed'] / row['jobs']:>6.1%} "
            f"[{low:>5.1%}, {high:>5.1%}]  {row['exit_statuses_seen']}"
        )
    doc = {
        "benchmark": "rank_exit",
        **environment(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "forwards": args.forwards,
        "rows": rows,
        "statuses": statuses,
    }
    print(f"-> {write_json(args.json, doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

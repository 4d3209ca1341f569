"""The export without a gather (genolong.train.export) against today's gathered export, by world size.

For world sizes 1, 2, 4 (gloo on the CPU, one torch thread per rank), a wide reduced GLM-5.3-Flash
(4 layers, 32 routed experts of hidden 256: 40.4 MiB fp32, the largest tensor 8 MiB) is sharded by
FSDP2 with expert parallelism over the ranks, then exported twice with 4 MiB shards:

- ``sharded``: :func:`genolong.train.export.export_model`, each rank its own shards;
- ``gathered``: the reference (``_full_model``: the full state dict gathered to rank 0, which writes
  every shard with ``save_pretrained``).

For each: the wall time (the slowest rank) and each rank's peak RSS increase during it (VmHWM, reset
through ``/proc/self/clear_refs`` before it; glibc's mmap threshold at 64 KiB so that freed
tensors leave the process and the RSS follows the live tensors). The files of both are checked equal.

Then the planner's figures for ``recipes/1m-node.yaml`` (``genolong plan``: the trained and frozen
parameter counts): the bytes of its export (frozen weights in bf16, trained ones in fp32, as a
bf16-mixed run stores them) and the time to write them at a stated disk bandwidth, by one writer
(the gathered path: rank 0 alone) and by the node's 8 ranks (each its shards; the aggregate capped
at the disk's bandwidth).

    python benchmarks/sharded_export.py                      # table + benchmarks/results/sharded_export.json
    python benchmarks/sharded_export.py --worlds 1 2 --disk-gbps 2 --writer-gbps 1
"""

from __future__ import annotations

import argparse
import filecmp
import gc
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_MiB = 2**20
_SHARD = 4 * _MiB


def _config():  # the wide reduced model (tests/train/test_export_sharded.py's)
    from genolong.model import PRESETS

    return PRESETS["tiny"].replace(
        num_hidden_layers=4,
        hidden_size=256,
        pattern="KDDD",
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        n_routed_experts=32,
        moe_intermediate_size=128,
        intermediate_size=512,
    )


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measure(work) -> tuple[float, int]:
    """(seconds, peak RSS increase in bytes) of ``work()`` (every rank starts together)."""
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - start, _status("VmHWM") - before


def _rank(rank: int, world: int, init: str, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    from genolong.config import ParallelSection
    from genolong.model import GenoLM
    from genolong.parallel import parallelize
    from genolong.parallel.mesh import build_mesh, ep_size
    from genolong.train.export import export_model
    from genolong.train.finetune import _full_model

    out = Path(folder)
    torch.manual_seed(0)
    model = GenoLM(_config())
    mesh = build_mesh(
        ParallelSection(accelerator="cpu", devices=world, dp_shard=world, cp=1, ep=world), world_size=world
    )
    parallelize(model, mesh=mesh, ep=ep_size(mesh))
    sharded = _measure(lambda: export_model(model, out / "sharded", max_shard_bytes=_SHARD))

    def gathered() -> None:
        full = _full_model(model)
        if rank == 0:
            full.save_pretrained(out / "gathered", max_shard_bytes=_SHARD)

    reference = _measure(gathered)
    (out / f"rank{rank}.json").write_text(json.dumps({"sharded": sharded, "gathered": reference}))
    dist.barrier()
    dist.destroy_process_group()


def _world(world: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sharded-export-") as tmp:
        folder = Path(tmp)
        mp.start_processes(_rank, args=(world, str(folder / "init"), str(folder)), nprocs=world, start_method="spawn")
        ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
        names = sorted(p.name for p in (folder / "gathered").iterdir())
        same = names == sorted(p.name for p in (folder / "sharded").iterdir()) and all(
            filecmp.cmp(folder / "gathered" / n, folder / "sharded" / n, shallow=False) for n in names
        )
    return {
        "world": world,
        "files_equal": same,
        "sharded_s": max(r["sharded"][0] for r in ranks),
        "gathered_s": max(r["gathered"][0] for r in ranks),
        "sharded_peak_mib": [round(r["sharded"][1] / _MiB, 1) for r in ranks],
        "gathered_peak_mib": [round(r["gathered"][1] / _MiB, 1) for r in ranks],
    }


def _planner(disk_gbps: float, writer_gbps: float) -> dict:
    """The 1m-node recipe's export, from the planner's parameter counts."""
    from genolong.config import load_recipe
    from genolong.plan.train import plan

    recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "1m-node.yaml")
    p = plan(recipe)
    bf16 = recipe.train.precision == "bf16-mixed"
    export_bytes = p.frozen_parameters * (2 if bf16 else 4) + p.trained_parameters * 4
    ranks = recipe.parallel.world_size
    one = export_bytes / (min(disk_gbps, writer_gbps) * 1e9)
    spread = export_bytes / (min(disk_gbps, writer_gbps * ranks) * 1e9)
    return {
        "recipe": "recipes/1m-node.yaml",
        "trained_parameters": p.trained_parameters,
        "frozen_parameters": p.frozen_parameters,
        "export_bytes": export_bytes,
        "ranks": ranks,
        "disk_gbps": disk_gbps,
        "writer_gbps": writer_gbps,
        "gathered_write_s": one,
        "sharded_write_s": spread,
        "gathered_rank0_host_bytes": export_bytes,
        "sharded_rank_host_bytes": "one 5 GB shard + the largest tensor",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--disk-gbps", type=float, default=8.0, help="the node's disk write bandwidth, GB/s (default 8: 4 NVMe)"
    )
    parser.add_argument(
        "--writer-gbps", type=float, default=2.0, help="one writing process's bandwidth, GB/s (default 2)"
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "sharded_export.json")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # the ranks' glibc: freed tensors leave at once
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from genolong.model import GenoLM

    torch.manual_seed(0)
    state = GenoLM(_config()).state_dict()
    whole, largest = sum(t.nbytes for t in state.values()), max(t.nbytes for t in state.values())
    rows = [_world(w) for w in args.worlds]
    print(
        f"model {whole / _MiB:.1f} MiB fp32, largest tensor {largest / _MiB:.1f} MiB, shards of {_SHARD / _MiB:.0f} MiB "
        f"(bound per rank: {(largest + _SHARD) / _MiB:.1f} MiB)"
    )
    print(
        f"{'world':>5} | {'sharded s':>9} | {'gathered s':>10} | {'sharded peak RSS per rank, MiB':<32} | "
        f"{'gathered peak RSS per rank, MiB':<32} | equal"
    )
    for r in rows:
        print(
            f"{r['world']:>5} | {r['sharded_s']:>9.2f} | {r['gathered_s']:>10.2f} | {str(r['sharded_peak_mib']):<32} | "
            f"{str(r['gathered_peak_mib']):<32} | {r['files_equal']}"
        )
    node = _planner(args.disk_gbps, args.writer_gbps)
    print(
        f"1m-node export (planner): {node['export_bytes'] / 1e9:.0f} GB ({node['frozen_parameters'] / 1e9:.1f}B frozen bf16 + "
        f"{node['trained_parameters'] / 1e9:.2f}B trained fp32); at {args.disk_gbps:g} GB/s disk, {args.writer_gbps:g} GB/s "
        f"per writer: gathered (rank 0 writes) {node['gathered_write_s'] / 60:.1f} min + the gather, "
        f"sharded ({node['ranks']} writers) {node['sharded_write_s'] / 60:.1f} min"
    )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _bench import environment, write_json

    result = {
        **environment(),
        "model_bytes": whole,
        "largest_tensor_bytes": largest,
        "shard_bytes": _SHARD,
        "rows": rows,
        "1m-node": node,
    }
    write_json(args.json, result)
    print(f"-> {args.json}")
    return 0 if all(r["files_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Context parallelism on CPU: training-step time and bytes through the collectives for CP = 1, 2, 4.

The `tiny` preset (seed 0) runs forward + backward of ``GenoLM.loss`` on one sequence of T tokens
(default 4,096), split into CP contiguous slices, one gloo process per slice, one intra-op thread
per process (``genolong.parallel.context.apply_context_parallel``; CP = 1 is the plain model in one
process). After a warm-up step, ``--steps`` steps are timed; the step time of a CP size is the
slowest rank's median (the ranks wait for each other at every layer). Bytes are what each rank
hands to ``all_gather``, ``all_reduce`` and the point-to-point/scatter calls per step, counted by
wrapping ``torch.distributed`` (payload per rank; maximum over ranks), next to the formulas of
``genolong.kernels.kda.cp.cp_kda_comm_bytes`` and ``genolong.parallel.cp_dsa.cp_dsa_comm_bytes``.

On a machine with fewer cores than CP processes the ranks share cores, so the times show the
overhead of the split, not a speed-up; on GPUs each rank has its own device.

Example::

    python benchmarks/cp_step.py                    # T = 4096, CP = 1, 2, 4
    python benchmarks/cp_step.py --tokens 8192 --cp 1,2

Prints a table and writes JSON (default benchmarks/results/cp_step.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "cp_step.json"


def _count_bytes(counter: dict[str, int]) -> None:
    """Wrap the torch.distributed calls the CP code uses so that they add their payload to ``counter``."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "scatter", "send", "recv", "isend", "irecv",
                                                          "broadcast", "reduce_scatter", "all_gather_into_tensor")}

    def wrap(name: str):
        original = originals[name]

        def call(*args, **kwargs):
            tensor = kwargs.get("tensor", args[1] if name in ("all_gather",) and len(args) > 1 else (args[0] if args else None))
            if isinstance(tensor, torch.Tensor):
                counter[name] = counter.get(name, 0) + size(tensor)
            return original(*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, wrap(name))


def _rank(rank: int, world: int, init: str, a: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    from genolong.model import PRESETS, GenoLM
    from genolong.parallel.context import apply_context_parallel

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        torch.manual_seed(0)
        model = GenoLM(PRESETS["tiny"])
        tokens = torch.randint(1, 5, (1, a.tokens), generator=torch.Generator().manual_seed(1))
        t = a.tokens // world
        local = tokens[:, rank * t:(rank + 1) * t]
        if world > 1:
            apply_context_parallel(model, dist.group.WORLD)
        counter: dict[str, int] = {}
        _count_bytes(counter)
        times = []
        for step in range(a.steps + 1):
            counter.clear()
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            nll, weight = model.loss(local)
            (nll / weight).backward()
            if world > 1:
                for p in model.parameters():  # a rank's gradient is its share: sum over the group
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
            elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            if step:  # step 0 warms up
                times.append(elapsed)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "bytes": dict(counter)}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length T (default 4096)")
    parser.add_argument("--cp", default="1,2,4", help="CP sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (default 3)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = parser.parse_args()

    from genolong.kernels.kda.cp import cp_kda_comm_bytes
    from genolong.model import PRESETS
    from genolong.parallel.cp_dsa import cp_dsa_comm_bytes

    config = PRESETS["tiny"]
    kda_layers = sum(t == "linear_attention" for t in config.layer_types)
    dsa_full = sum(lt == "indexed_attention" and it == "full" for lt, it in zip(config.layer_types, config.indexer_types))
    dsa_shared = sum(lt == "indexed_attention" and it == "shared" for lt, it in zip(config.layer_types, config.indexer_types))
    params = sum(p.numel() for p in __import__("genolong.model", fromlist=["GenoLM"]).GenoLM(config).parameters())
    rows = []
    for world in (int(c) for c in a.cp.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            if world == 1:
                _rank(0, 1, "", a, tmp)
            else:
                mp.start_processes(_rank, args=(world, os.path.join(tmp, "init"), a, tmp), nprocs=world, start_method="spawn")
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        step = max(statistics.median(r["times"]) for r in ranks)
        measured = max(sum(r["bytes"].values()) for r in ranks)
        t_local = a.tokens // world
        if world > 1:
            kda = cp_kda_comm_bytes(1, config.linear_num_heads, config.linear_head_dim, config.linear_head_dim, world)
            dsa_f = cp_dsa_comm_bytes(config, 1, t_local, world, full_indexer=True)
            dsa_s = cp_dsa_comm_bytes(config, 1, t_local, world, full_indexer=False)
            formula_kda = kda_layers * (kda["forward"] + kda["backward"])
            formula_dsa = dsa_full * (dsa_f["forward"] + dsa_f["backward"]) + dsa_shared * (dsa_s["forward"] + dsa_s["backward"])
        else:
            formula_kda = formula_dsa = 0
        rows.append({"cp": world, "tokens": a.tokens, "tokens_per_rank": t_local, "step_s": step,
                     "bytes_per_rank_measured": measured, "gradient_allreduce_bytes": 4 * params if world > 1 else 0,
                     "kda_formula_bytes": formula_kda, "dsa_formula_bytes": formula_dsa,
                     "per_rank_bytes": [r["bytes"] for r in ranks]})
        print(f"CP={world}: step {step:.3f} s (slowest rank's median), {measured / 2**20:.2f} MiB handed to collectives "
              f"per rank per step", flush=True)
    base = rows[0]["step_s"]
    print("\n| CP | tokens per rank | step s | vs CP=1 | MiB per rank per step (measured) | of which gradient all-reduce | KDA formula MiB | DSA formula MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['tokens_per_rank']:,} | {r['step_s']:.3f} | {r['step_s'] / base:.2f}x | "
              f"{r['bytes_per_rank_measured'] / 2**20:.2f} | {r['gradient_allreduce_bytes'] / 2**20:.2f} | "
              f"{r['kda_formula_bytes'] / 2**20:.3f} | {r['dsa_formula_bytes'] / 2**20:.3f} |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"benchmark": "cp_step", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                  "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                                  "preset": "tiny", "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()

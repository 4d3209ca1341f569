#!/usr/bin/env python
"""Context parallelism on CPU: training-step time and bytes through the KDA and DSA collectives vs T and CP size.

The `tiny` preset (seed 0) runs forward + backward of ``GenoLM.loss`` on one sequence of T tokens
(default T = 2,048 and 4,096), split into CP contiguous slices, one gloo process per slice, one
intra-op thread per process (``genolong.parallel.context.apply_context_parallel``; CP = 1 is the
plain model in one process). After a warm-up step, ``--steps`` steps are timed; the step time of a
CP size is the slowest rank's median (the ranks wait for each other at every layer).

Bytes are counted by wrapping ``torch.distributed`` (``all_gather``, ``all_reduce``, ``scatter``,
``reduce_scatter``, ...) and attributing each call to the module that made it: the KDA collectives
of ``genolong.kernels.kda.cp`` (state fold and short-conv halo), the DSA collectives of
``genolong.parallel.cp_dsa`` (latent + pooled-key all-gather; its backward on gloo is one
``scatter`` per source rank) and this script's gradient all-reduce. Each rank's count of one step
(the last) is compared with the planner's formula for the same step,
:func:`genolong.plan.comm_estimate` (which sums the per-call formulas
``cp_kda_comm_bytes``, ``conv_halo_comm_bytes`` and ``cp_dsa_comm_bytes`` over the layers), each in
its own convention:

- KDA: the *payload* each rank hands to the collectives (for an all-gather its own piece, for an
  all-reduce the whole buffer); also cross-checked with ``genolong.kernels.kda.cp.comm_meter``.
- DSA: the bytes each rank *receives* from the other ranks (an all-gather: the ``W - 1`` other
  pieces; a scatter: the piece, unless this rank is the source).

The gradient all-reduce this script does by hand (a rank's parameter gradients are its share of
the sequence's; FSDP would reduce-scatter instead) is reported separately, as its payload.

On a machine with fewer cores than CP processes the ranks share cores, so the times show the
overhead of the split, not a speed-up; on GPUs each rank has its own device.

Example::

    OMP_NUM_THREADS=1 python benchmarks/cp_step.py                 # T = 2048, 4096; CP = 1, 2, 4
    OMP_NUM_THREADS=1 python benchmarks/cp_step.py --tokens 8192 --cp 1,2

Prints a table and writes JSON (default benchmarks/results/cp_step.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "cp_step.json"
#: the module whose collectives belong to each part
SOURCES = {"genolong.kernels.kda.cp": "kda", "genolong.parallel.cp_dsa": "dsa"}
OPS = (
    "all_gather",
    "all_reduce",
    "scatter",
    "reduce_scatter",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _count_bytes(counter: dict[str, int]) -> None:
    """Wrap the torch.distributed collectives so that each call adds, under ``"<part>.<op>"`` with
    part ``kda``, ``dsa``, ``grad`` (this script) or ``other``, its payload (``.payload``) and the
    bytes this rank receives from other ranks (``.received``; all-gather, scatter and
    reduce-scatter only) to ``counter``."""
    me = dist.get_rank()

    def wrap(name: str):
        original = getattr(dist, name)

        def call(*args, **kwargs):
            caller = sys._getframe(1)
            part = SOURCES.get(caller.f_globals.get("__name__", ""))
            if part is None:
                part = "grad" if caller.f_code.co_filename == __file__ else "other"
            payload = received = 0
            if name == "all_gather":  # (tensor_list, tensor): W pieces of this size arrive, one is ours
                x, out = _arg(args, kwargs, 1, "tensor"), _arg(args, kwargs, 0, "tensor_list")
                payload, received = _size(x), _size(x) * (len(out) - 1)
            elif name == "scatter":  # (tensor, scatter_list, src): the source keeps its own piece
                x, src = _arg(args, kwargs, 0, "tensor"), _arg(args, kwargs, 2, "src")
                payload = _size(x)
                received = 0 if (src or 0) == me else _size(x)
            elif name == "reduce_scatter":  # (output, input_list)
                x, pieces = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input_list")
                payload, received = sum(_size(p) for p in pieces), _size(x) * (len(pieces) - 1)
            else:
                x = _arg(args, kwargs, 0, "tensor")
                payload = _size(x) if isinstance(x, torch.Tensor) else 0
            counter[f"{part}.{name}.payload"] = counter.get(f"{part}.{name}.payload", 0) + payload
            if received:
                counter[f"{part}.{name}.received"] = counter.get(f"{part}.{name}.received", 0) + received
            return original(*args, **kwargs)

        return call

    for name in OPS:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name))


def _sum(counter: dict[str, int], part: str, kind: str) -> int:
    return sum(v for k, v in counter.items() if k.startswith(part + ".") and k.endswith("." + kind))


def _rank(rank: int, world: int, init: str, tokens: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    from genolong.kernels.kda.cp import comm_meter
    from genolong.model import PRESETS, GenoLM
    from genolong.parallel.context import apply_context_parallel

    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
    try:
        torch.manual_seed(0)
        model = GenoLM(PRESETS["tiny"])
        ids = torch.randint(1, 5, (1, tokens), generator=torch.Generator().manual_seed(1))
        t = tokens // world
        local = ids[:, rank * t : (rank + 1) * t]
        counter: dict[str, int] = {}
        if world > 1:
            apply_context_parallel(model, dist.group.WORLD)
            _count_bytes(counter)
        times = []
        meter_bytes: dict[str, int] = {}
        for step in range(steps + 1):
            counter.clear()
            if world > 1:
                dist.barrier()
            with comm_meter() as meter:
                t0 = time.perf_counter()
                nll, weight = model.loss(local)
                (nll / weight).backward()
                if world > 1:
                    for p in model.parameters():  # a rank's gradient is its share: sum over the group
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                elapsed = time.perf_counter() - t0
            meter_bytes = dict(meter)
            model.zero_grad(set_to_none=True)
            if step:  # step 0 warms up
                times.append(elapsed)
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"times": times, "bytes": dict(counter), "kda_meter": meter_bytes})
        )
    finally:
        if world > 1:
            dist.destroy_process_group()


def _ratio(measured: int, formula: int) -> float | None:
    return None if formula == 0 else measured / formula


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--tokens", default="2048,4096", help="sequence lengths T, comma-separated (default 2048,4096)")
    parser.add_argument("--cp", default="1,2,4", help="CP sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up (default 3)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = parser.parse_args()

    from genolong.config import kernel_multiple
    from genolong.model import PRESETS
    from genolong.plan import comm_estimate

    config = PRESETS["tiny"]
    lengths = [int(x) for x in a.tokens.split(",")]
    sizes = [int(c) for c in a.cp.split(",")]
    for T in lengths:
        for world in sizes:
            if T % kernel_multiple(config, world):
                parser.error(f"--tokens {T} must be a multiple of {kernel_multiple(config, world)} for CP {world}")
    params = sum(p.numel() for p in __import__("genolong.model", fromlist=["GenoLM"]).GenoLM(config).parameters())
    rows = []
    for T in lengths:
        for world in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                if world == 1:
                    _rank(0, 1, "", T, a.steps, tmp)
                else:
                    mp.start_processes(
                        _rank,
                        args=(world, os.path.join(tmp, "init"), T, a.steps, tmp),
                        nprocs=world,
                        start_method="spawn",
                    )
                ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
            step = max(statistics.median(r["times"]) for r in ranks)
            t_local = T // world
            est = comm_estimate(config, t_local, world)
            kda = [_sum(r["bytes"], "kda", "payload") for r in ranks]
            dsa = [_sum(r["bytes"], "dsa", "received") for r in ranks]
            meter = [sum(r["kda_meter"].values()) for r in ranks]
            row = {
                "cp": world,
                "tokens": T,
                "tokens_per_rank": t_local,
                "step_s": step,
                "kda_payload_measured": max(kda),
                "kda_payload_formula": est.part_total("kda"),
                "kda_ratio": _ratio(max(kda), est.part_total("kda")),
                "kda_comm_meter": max(meter),
                "dsa_received_measured": max(dsa),
                "dsa_received_formula": est.part_total("dsa"),
                "dsa_ratio": _ratio(max(dsa), est.part_total("dsa")),
                # the indexer KL's count all-reduce (not in cp_dsa_comm_bytes; 0 unless the KL is on)
                "dsa_allreduce_payload": max(r["bytes"].get("dsa.all_reduce.payload", 0) for r in ranks),
                "gradient_allreduce_payload": max(_sum(r["bytes"], "grad", "payload") for r in ranks),
                "parameters_fp32_bytes": 4 * params,  # the all-reduce covers the parameters that got a gradient
                "other_payload": max(_sum(r["bytes"], "other", "payload") for r in ranks),
                "ranks_agree": len(set(kda)) <= 1 and len(set(dsa)) <= 1,
                "formula_rows": [
                    {"name": x.name, "convention": x.convention, "forward": x.forward, "backward": x.backward}
                    for x in est.rows
                    if x.part in ("kda", "dsa")
                ],
                "per_rank_bytes": [r["bytes"] for r in ranks],
            }
            rows.append(row)
            print(
                f"T={T} CP={world}: step {step:.3f} s; KDA {_mib(row['kda_payload_measured'])} MiB payload "
                f"(formula {_mib(row['kda_payload_formula'])}); DSA {_mib(row['dsa_received_measured'])} MiB received "
                f"(formula {_mib(row['dsa_received_formula'])})",
                flush=True,
            )

    def fmt_ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    print(
        "\n| T | CP | tokens per rank | step s | KDA payload MiB measured | KDA formula | ratio | "
        "DSA received MiB measured | DSA formula | ratio | gradient all-reduce MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens']:,} | {r['cp']} | {r['tokens_per_rank']:,} | {r['step_s']:.3f} | "
            f"{_mib(r['kda_payload_measured'])} | {_mib(r['kda_payload_formula'])} | {fmt_ratio(r['kda_ratio'])} | "
            f"{_mib(r['dsa_received_measured'])} | {_mib(r['dsa_received_formula'])} | {fmt_ratio(r['dsa_ratio'])} | "
            f"{_mib(r['gradient_allreduce_payload'])} |"
        )
    write_json(
        a.json,
        {
            "benchmark": "cp_step",
            **environment("date"),
            "command": "OMP_NUM_THREADS=1 python benchmarks/cp_step.py " + " ".join(sys.argv[1:]),
            **environment("machine", "cpus", "torch"),
            "preset": "tiny",
            "conventions": {
                "kda": "payload handed to the collectives per rank",
                "dsa": "bytes received from other ranks per rank",
            },
            "rows": rows,
        },
    )
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Expert parallelism on CPU: training-step time, all-to-all bytes and the busiest EP rank's load.

The `tiny` preset (seed 0) runs forward + backward of ``GenoLM.loss`` on one window of T tokens per
rank (default T = 2,048), its routed experts spread over EP gloo processes
(``genolong.parallel.expert.apply_expert_parallel`` on a 1-D mesh; EP = 1 is the plain model in one
process), MoE token chunks of ``--chunk`` tokens, one intra-op thread per process. After a warm-up
step ``--steps`` steps are timed; the step time of an EP size is the slowest rank's median.

Bytes are the measured counter (:class:`genolong.parallel.expert.AllToAllCounter`: payload a rank
sent to *other* ranks, forward and backward; the per-expert count exchanges separately) of the last
step, for two routings:

- ``learned``: the model's own router (random init): the load is uneven, so the bytes differ by
  rank; the busiest rank's received rows over the mean is reported (the reference's 4x figure);
- ``balanced``: a router that sends token i's slots to experts ``2i, 2i + 1 mod E``, where the
  counter must equal the interfaces.md formula to the byte: per MoE layer per chunk of c tokens,
  dispatch ``(ep - 1) / ep * c * k * H * a`` and combine the same, backward the two again;
  counts ``(ep - 1) * E/ep * 8`` per dispatch.

On a machine with fewer cores than EP processes the ranks share cores, so the times show the
overhead of the exchange, not a speed-up.

Example::

    OMP_NUM_THREADS=1 python benchmarks/ep_step.py                   # T = 2048, EP = 1, 2, 4
    OMP_NUM_THREADS=1 python benchmarks/ep_step.py --tokens 4096 --ep 1,2

Prints a table and writes JSON (default benchmarks/results/ep_step.json).
"""

from __future__ import annotations

import argparse
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

from genolong.plan import ep_comm_bytes

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))  # benchmarks/_bench.py, also when a test imports this script
from _bench import environment, write_json  # noqa: E402

DEFAULT_JSON = HERE / "results" / "ep_step.json"


def _balanced_router(experts: int, k: int) -> Any:
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        token = torch.arange(x.shape[0])
        indices = torch.stack([(2 * token + j) % experts for j in range(k)], dim=1)
        return x.new_zeros(x.shape[0], experts), torch.full((x.shape[0], k), 1.0 / k), indices

    return route


def _run(rank: int, world: int, init: str, tokens: int, chunk: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
    from torch.distributed.device_mesh import init_device_mesh

    from genolong.model import PRESETS, GenoLM
    from genolong.model.moe import MoE
    from genolong.parallel import apply_moe_chunks
    from genolong.parallel.expert import apply_expert_parallel, ep_comm_counter

    config = PRESETS["tiny"]
    result: dict[str, Any] = {}
    for routing in ("learned", "balanced"):
        torch.manual_seed(0)
        model = GenoLM(config)
        apply_moe_chunks(model, chunk)
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        if routing == "balanced":
            for m in moes:
                m.gate.forward = _balanced_router(config.n_routed_experts, config.num_experts_per_tok)  # type: ignore[method-assign]
        if world > 1:
            apply_expert_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(1, 5, (1, tokens), generator=g)
        times = []
        for step in range(steps + 1):
            counter = ep_comm_counter(model)
            if counter is not None:
                counter.reset()
            started = time.perf_counter()
            nll, weight = model.loss(ids)
            (nll / weight).backward()
            if step:
                times.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        counter = ep_comm_counter(model)
        received = [int(getattr(m, "last_received", tokens * config.num_experts_per_tok)) for m in moes]
        result[routing] = {
            "step_s": statistics.median(times),
            "bytes": counter.as_dict() if counter else None,
            "received": received,
        }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


def measure(ep: int, tokens: int, chunk: int, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        args = (ep, str(Path(folder) / "init"), tokens, chunk, steps, folder)
        if ep == 1:
            _run(0, *args)
        else:
            mp.start_processes(_run, args=args, nprocs=ep, start_method="spawn")
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=True) for r in range(ep)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank (one window each)")
    parser.add_argument("--chunk", type=int, default=512, help="MoE token chunk")
    parser.add_argument("--ep", default="1,2,4", help="EP sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    from genolong.model import PRESETS

    config = PRESETS["tiny"]
    rows = []
    print(
        f"{'EP':>3} {'routing':>9} {'step s':>8} {'vs EP1':>7} {'fwd bytes (max rank)':>21} {'bwd bytes':>11} "
        f"{'count bytes':>11} {'formula fwd':>12} {'match':>6} {'busiest/mean':>13}"
    )
    base: dict[str, float] = {}
    for ep in [int(x) for x in args.ep.split(",")]:
        ranks = measure(ep, args.tokens, args.chunk, args.steps)
        for routing in ("learned", "balanced"):
            step = max(r[routing]["step_s"] for r in ranks)
            base.setdefault(routing, step)
            counted = [r[routing]["bytes"] or {"forward": 0, "backward": 0, "splits": 0} for r in ranks]
            # the planner's formula (what `genolong plan` puts in its EP rows)
            want = ep_comm_bytes(config, args.tokens, ep, args.chunk, 4)
            received = torch.tensor([r[routing]["received"] for r in ranks], dtype=torch.float64)  # [ep, layers]
            imbalance = float((received.max(0).values / received.mean(0)).max())
            match = routing == "balanced" and all(
                c["forward"] == want["forward"] and c["backward"] == want["backward"] and c["splits"] == want["splits"]
                for c in counted
            )
            row = {
                "ep": ep,
                "routing": routing,
                "tokens_per_rank": args.tokens,
                "chunk": args.chunk,
                "step_s": step,
                "step_vs_ep1": step / base[routing],
                "bytes_by_rank": counted,
                "formula": want,
                "balanced_matches_formula": match if routing == "balanced" else None,
                "busiest_over_mean": imbalance,
            }
            rows.append(row)
            print(
                f"{ep:>3} {routing:>9} {step:>8.3f} {step / base[routing]:>7.2f} {max(c['forward'] for c in counted):>21,} "
                f"{max(c['backward'] for c in counted):>11,} {max(c['splits'] for c in counted):>11,} "
                f"{want['forward']:>12,} {str(match) if routing == 'balanced' else '-':>6} {imbalance:>13.2f}"
            )
    write_json(
        args.json,
        {"benchmark": "ep_step", **environment("date", "machine", "torch"), "preset": "tiny", "rows": rows},
        indent=2,
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

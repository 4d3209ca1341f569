"""Sharded loading and trained-only saves against the world size, next to today's path.

On a wide reduced model (tests/parallel/test_sharded_load.py's config scaled by ``--hidden``: many experts, a
few layers; its checkpoint saved in bf16), for world sizes 1, 2 and 4 (gloo ranks on this CPU),
each rank:

- **sharded** (:mod:`genolong.parallel.load`): meta model -> EP + FSDP2 -> local shards in bf16 ->
  its rows read; load seconds, peak RSS increase, bytes read;
- **today** (``GenoLM.from_pretrained`` in fp32 on every rank, then ``parallelize``): the same
  figures, measured in the same process after the first;
- **save**: a DCP save of the attention-only run's state (the attention parameters in fp32 + their
  two AdamW moments, as ``genolong finetune`` from a base now writes) against the whole model's
  (every weight, as before): seconds and bytes on disk.

Then the planner's figures for ``recipes/1m-node.yaml`` (8 GPUs): bytes each rank reads at load,
bytes per save and on disk with keep_last, against the save that held every frozen weight.

Prints a table and writes ``benchmarks/results/sharded_load.json``::

    python benchmarks/sharded_load.py            # about 5 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _bench import environment, write_json  # noqa: E402

ATTENTION = "self_attn"


def _config(hidden: int):  # noqa: ANN202
    from genolong.model import PRESETS

    return replace(
        PRESETS["tiny"],
        hidden_size=hidden,
        moe_intermediate_size=128,
        n_routed_experts=64,
        num_hidden_layers=4,
        layer_types=("linear_attention", "indexed_attention", "linear_attention", "indexed_attention"),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        indexer_types=("full",) * 4,
    )


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _rank(rank: int, world: int, base: str, work: str, init: str) -> None:
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from genolong.config import ParallelSection
    from genolong.model import GenoLM
    from genolong.model.config import ModelConfig
    from genolong.parallel import parallelize
    from genolong.parallel.load import fill_from_safetensors, materialize
    from genolong.parallel.mesh import build_mesh

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ep = 2 if world > 1 else 1
    mesh = (
        build_mesh(ParallelSection(accelerator="cpu", devices=world, dp_shard=world, ep=ep), world_size=world)
        if world > 1
        else None
    )
    config = ModelConfig.from_pretrained(base)
    out: dict[str, float | int] = {}

    with torch.device("meta"):  # warm-up: the imports and first-call costs of both paths, before either is measured
        GenoLM(config)
    GenoLM(config)
    # sharded: every weight in bf16 (a frozen base), trained attention as fp32 masters
    before = _reset_peak()
    start = time.perf_counter()
    with torch.device("meta"):
        model = GenoLM(config)
    for name, param in model.named_parameters():
        if ATTENTION not in name:
            param.requires_grad_(False)
            param.data = param.data.to(torch.bfloat16)
    if mesh is not None:
        parallelize(model, mesh=mesh, ep=ep)
    materialize(model, "cpu")
    counter = fill_from_safetensors(model, base)
    out.update(sharded_s=time.perf_counter() - start, sharded_rss=_status("VmHWM") - before, sharded_read=counter.bytes)

    # save: what training changes (attention + 2 moments) against every weight
    for kind, frozen in (("trained", True), ("whole", False)):
        state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=frozen))
        moments = (
            {
                f"{k}.exp_avg{i}": v.detach().float().clone()
                for k, v in state.items()
                if v.requires_grad
                for i in range(2)
            }
            if frozen
            else {}
        )
        target = Path(work, f"save-{kind}-{world}")
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        save({"state_dict": state, "optimizer": moments}, checkpoint_id=target)
        if world > 1:
            dist.barrier()
        out[f"save_{kind}_s"] = time.perf_counter() - start
        out[f"save_{kind}_bytes"] = sum(p.stat().st_size for p in target.glob("*.distcp"))
    del model, state, moments
    gc.collect()
    if world > 1:
        dist.barrier()

    # today: the whole fp32 model on every rank, then sharded
    before = _reset_peak()
    start = time.perf_counter()
    model = GenoLM.from_pretrained(base)
    if mesh is not None:
        parallelize(model, mesh=mesh, ep=ep)
    out.update(
        today_s=time.perf_counter() - start,
        today_rss=_status("VmHWM") - before,
        today_read=sum(p.stat().st_size for p in Path(base).glob("*.safetensors")),
    )
    Path(work, f"rank{rank}-{world}.json").write_text(json.dumps(out))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _planner() -> dict[str, int]:
    from genolong.config import load_recipe
    from genolong.plan import plan

    recipe = load_recipe(HERE.parent / "recipes" / "1m-node.yaml")
    p = plan(recipe, gpus=8)
    bf16 = 2 if recipe.train.precision == "bf16-mixed" else 4
    return {
        "gpus": 8,
        "read_per_rank": p.load_read_per_rank,
        "save_bytes": p.checkpoint_bytes,
        "save_on_disk": p.checkpoint_disk_bytes,
        "keep_last": p.keep_last,
        "save_bytes_with_frozen": p.checkpoint_bytes + bf16 * p.frozen_parameters,
        "trained_parameters": p.trained_parameters,
        "frozen_parameters": p.frozen_parameters,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--hidden",
        type=int,
        default=256,
        help="hidden size of the wide model (256: a 40 MB bf16 checkpoint, 512: 145 MB)",
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", type=Path, default=HERE / "results" / "sharded_load.json")
    args = parser.parse_args()
    from genolong.model import GenoLM

    work = Path(tempfile.mkdtemp(prefix="sharded_load_"))
    try:
        torch.manual_seed(0)
        base = work / "base"
        GenoLM(_config(args.hidden)).save_pretrained(base, dtype=torch.bfloat16, max_shard_bytes=50 * 10**6)
        checkpoint = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        rows = []
        for world in args.worlds:
            init = work / f"init-{world}"
            if world == 1:
                _rank(0, 1, str(base), str(work), str(init))
            else:
                mp.start_processes(
                    _rank, args=(world, str(base), str(work), str(init)), nprocs=world, start_method="spawn"
                )
            ranks = [json.loads((work / f"rank{r}-{world}.json").read_text()) for r in range(world)]
            rows.append({"world": world, **{k: max(r[k] for r in ranks) for k in ranks[0]}})
        result = {
            "environment": environment(),
            "checkpoint_bytes": checkpoint,
            "hidden": args.hidden,
            "per_world_max_over_ranks": rows,
            "planner_1m_node": _planner(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = 1e6
    print(f"wide model: {checkpoint / mb:.1f} MB bf16 checkpoint; figures per rank (the largest over the ranks)")
    print(
        "| world | sharded load s | sharded peak RSS +MB | sharded read MB | today load s | today peak RSS +MB | "
        "today read MB | save trained s | save trained MB | save whole s | save whole MB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['world']} | {r['sharded_s']:.2f} | {r['sharded_rss'] / mb:.1f} | {r['sharded_read'] / mb:.1f} | "
            f"{r['today_s']:.2f} | {r['today_rss'] / mb:.1f} | {r['today_read'] / mb:.1f} | {r['save_trained_s']:.2f} | "
            f"{r['save_trained_bytes'] / mb:.1f} | {r['save_whole_s']:.2f} | {r['save_whole_bytes'] / mb:.1f} |"
        )
    p = result["planner_1m_node"]
    gb = 1e9
    print(
        f"planner, recipes/1m-node.yaml on 8 GPUs: each rank reads {p['read_per_rank'] / gb:.1f} GB of the base; a save "
        f"{p['save_bytes'] / gb:.1f} GB ({p['save_on_disk'] / gb:.1f} GB on disk with keep_last {p['keep_last']}); with the "
        f"frozen weights it was {p['save_bytes_with_frozen'] / gb:.1f} GB"
    )
    print(f"-> {write_json(args.json, result)}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

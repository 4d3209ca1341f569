"""``genolong plan``: will a recipe fit? Memory per GPU and host memory of a training step, or with
``--evaluate`` of scoring (:mod:`genolong.plan`)."""

from __future__ import annotations

import argparse

from .common import Command, Subcommands, set_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``plan`` to the subcommands and return its parser."""
    pl = sub.add_parser(
        "plan",
        help="will a recipe fit? memory per GPU and host memory, and the cheapest change that makes it fit",
        description=(
            "Predict a recipe's memory per GPU (parameters, gradients and AdamW state under FSDP sharding; saved "
            "and recomputed activations per layer type under the recipe's recompute, offload and context "
            "parallelism; MoE dispatch, DSA and cross-entropy buffers; workspace) and the pinned host memory "
            "for offload per GPU and per node, with a verdict and the cheapest change that makes it fit. "
            "With --evaluate: the memory per GPU to score the recipe's model at --context N (forward only, the "
            "recipe's mesh and EP, the largest layer's forward working set, host memory for loading)."
        ),
    )
    pl.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/)")
    set_argument(pl, "override a recipe key (repeatable)")
    pl.add_argument("--gpus", type=int, metavar="N", help="number of GPUs (default: the recipe's devices x num_nodes)")
    pl.add_argument("--gpu-mem", type=float, default=80.0, metavar="GiB", help="memory per GPU (default: %(default)s)")
    pl.add_argument("--host-mem", type=float, metavar="GiB", help="host RAM per node (default: not checked)")
    pl.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default: %(default)s)")
    pl.add_argument(
        "--moe-imbalance",
        type=float,
        default=None,
        metavar="X",
        help="tokens on the busiest expert rank over the mean (default: the recipe's memory.moe_imbalance, "
        "4.0 as the reference saw, or its memory.moe_capacity_factor when smaller)",
    )
    pl.add_argument(
        "--kda-kernel",
        choices=["torch", "fla"],
        default=None,
        help="whose KDA kernel's saved tensors to count (default: what the recipe's model.overrides."
        "kernel_backend runs; auto on a GPU recipe: fla)",
    )
    pl.add_argument(
        "--dsa-kernel",
        choices=["torch", "triton"],
        default=None,
        help="whose DSA kernels' saved tensors to count (default: as --kda-kernel; auto on a GPU recipe: triton)",
    )
    pl.add_argument(
        "--evaluate",
        action="store_true",
        help="plan scoring (genolong evaluate) instead of a training step: forward only, weights sharded "
        "over the recipe's mesh, CP splitting the tile, the largest layer's forward working set",
    )
    pl.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="with --evaluate: tokens per tile (default: the recipe's eval.context, else data.context)",
    )
    pl.add_argument(
        "--segment-tokens",
        type=int,
        metavar="S",
        help="with --evaluate: stream each tile S tokens at a time, as evaluate --segment-tokens "
        "(each process holding the whole model: parallel.cp and dp_shard 1; 0: one forward; default: one forward)",
    )
    pl.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="with --evaluate: parameter dtype of the scoring (default: bfloat16 for a bf16-mixed recipe, "
        "else float32)",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    return pl


def run(args: argparse.Namespace) -> int:
    """Run ``genolong plan``: the plan as a table, or JSON with ``--json``."""
    import json

    from ..config import load_recipe
    from ..errors import InputError
    from ..plan import eval_plan, format_eval_plan, format_plan, plan

    common = dict(
        gpus=args.gpus,
        gpu_mem_gib=args.gpu_mem,
        host_mem_gib=args.host_mem,
        gpus_per_node=args.gpus_per_node,
        moe_imbalance=args.moe_imbalance,
        kda_kernel=args.kda_kernel,
        dsa_kernel=args.dsa_kernel,
    )
    if args.evaluate:
        scoring = eval_plan(
            load_recipe(args.recipe, args.set),
            context=args.context,
            dtype=args.dtype,
            segment_tokens=args.segment_tokens or None,
            **common,
        )
        print(json.dumps(scoring.to_dict(), indent=1) if args.json else format_eval_plan(scoring))
        return 0
    given = [
        flag
        for flag, value in (
            ("--context", args.context),
            ("--segment-tokens", args.segment_tokens),
            ("--dtype", args.dtype),
        )
        if value is not None
    ]
    if given:
        raise InputError(
            f"{', '.join(given)} plan(s) an evaluation: add --evaluate (without it the plan is a training step's)"
        )
    step = plan(load_recipe(args.recipe, args.set), **common)
    print(json.dumps(step.to_dict(), indent=1) if args.json else format_plan(step))
    return 0


COMMAND = Command("plan", add, run)

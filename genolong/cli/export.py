"""``genolong export``: write the export of a finetune run's step checkpoint (the merged model,
the LoRA adapter, or both) as ``finetune`` writes at its end (:mod:`genolong.train.export_run`)."""

from __future__ import annotations

import argparse

from .common import Command, Subcommands, verbose_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``export`` to the subcommands and return its parser."""
    exp = sub.add_parser(
        "export",
        help="write the export (model, LoRA adapter) of a finetune run's step checkpoint",
        description="Restore a step checkpoint of a finetune run as --resume does and write what finetune writes at its "
        "end: DIR/export (GLM-5.3-Flash safetensors; adapters merged under model.lora) and DIR/adapter (PEFT). "
        "Under torchrun each rank writes its own shards on the run's mesh; otherwise one process.",
    )
    exp.add_argument(
        "target",
        metavar="RUN|CKPT",
        help="a run directory (its newest intact checkpoint) or runs/NAME/checkpoints/stepN.ckpt",
    )
    exp.add_argument("--merged", action="store_true", help="the model only (adapters merged under model.lora)")
    exp.add_argument("--adapter", action="store_true", help="the PEFT adapter only (model.lora runs)")
    exp.add_argument(
        "--out", default=None, metavar="DIR", help="where export/ and adapter/ go (default RUN/exports/stepN)"
    )
    verbose_argument(exp)
    return exp


def run(args: argparse.Namespace) -> int:
    """Run ``genolong export``: restore the checkpoint and write the export (0 on success)."""
    from ..train.export_run import export_command

    return export_command(args.target, args.out, merged=args.merged, adapter=args.adapter)


COMMAND = Command("export", add, run, model=True)

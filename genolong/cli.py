"""The ``genolong`` command line: each subcommand parses its arguments and calls one function.

User errors (:class:`genolong.errors.GenolongError`) print as one line on stderr with exit code 2;
Ctrl-C exits with 130; a run stopped by a signal at a safe point (SIGTERM, SIGUSR1: preemption, a
time limit; :class:`genolong.errors.Stopped`) prints one line and exits with 75. Anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .allocator import keep_freed_memory
from .cli_tracks import add_names_argument, add_regions_argument, add_tracks_parser, split_regions
from .errors import PREEMPTED_EXIT_CODE, GenolongError, Stopped
from .signals import catch_from_start, ignore_from_now

__all__ = ["build_parser", "entry", "main"]


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .data.prepare import format_summary, prepare_genome

    result = prepare_genome(
        args.fasta,
        args.out,
        train=args.train,
        eval=args.eval,
        min_gap=args.min_gap,
        force=args.force,
        names=args.names,
        progress=None if not args.quiet else False,
    )
    if not args.quiet:
        print(format_summary(result))
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import run_quickstart

    run_quickstart(out=Path(args.out), progress=None if not args.quiet else False, overrides=args.set,
                   train=not args.prepare_only, control=args.control, eval_tiles=args.eval_tiles,
                   probe_tiles=args.probe_tiles)
    return 0


def _cmd_finetune(args: argparse.Namespace) -> int:
    if args.launcher == "ray":
        from .train.ray_launcher import launch

        return launch(args.recipe, args.set, resume=args.resume, address=args.ray_address,
                      max_failures=args.max_failures)
    from .slurm import load_job_recipe

    recipe = load_job_recipe(args.recipe, args.set)  # a SLURM job's tasks checked before torch loads
    from .train.finetune import run
    result = run(recipe, resume=args.resume)
    if result.is_global_zero:  # one line for the job, not one per process
        print(result.summary(recipe.name))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .train.export_run import export_command

    return export_command(args.target, args.out, merged=args.merged, adapter=args.adapter)


#: ``evaluate --segment-tokens`` default: a tile up to 64k tokens runs in one forward (as before); a
#: longer one streams, so the peak is one segment's working set plus the caches instead of growing
#: with the tile (262k tokens of the bundled base: 0.42x the one-shot peak RSS at 0.95x its time,
#: benchmarks/stream_eval.py; a 1,048,576-token tile peaks at 6.32 GiB)
_SEGMENT_TOKENS = 65536

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _parallel_section(args: argparse.Namespace) -> object:
    """The ``parallel`` section a scoring command runs on: ``--recipe R``'s (with its ``--set``
    overrides), or the one-process default with ``--set parallel.KEY=VALUE`` items on top.

    Raises:
        InputError: a ``--set`` key outside ``parallel.`` without ``--recipe``, an unknown key or a
            value that is not an integer (``accelerator`` a name).
    """
    import dataclasses

    from .config import ParallelSection, load_recipe, parse_set
    from .errors import InputError

    if args.recipe is not None:
        return load_recipe(args.recipe, args.set).parallel
    fields = {f.name: f for f in dataclasses.fields(ParallelSection)}
    values: dict[str, object] = {}
    for item in args.set:
        key, value = parse_set(item)
        name = key.removeprefix("parallel.")
        if not key.startswith("parallel.") or name not in fields:
            raise InputError(f"--set {item!r}: without --recipe only the parallel section can be set, one of "
                             f"{', '.join('parallel.' + f for f in fields)}")
        if name == "accelerator":
            if value not in ("cpu", "gpu", "cuda", "auto"):
                raise InputError(f"--set {item!r}: parallel.accelerator is one of cpu, gpu, cuda, auto")
        elif name == "timeout_s":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InputError(f"--set {item!r}: parallel.timeout_s must be a number of seconds > 0")
            value = float(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"--set {item!r}: parallel.{name} must be an integer")
        values[name] = value
    return ParallelSection(**values)  # type: ignore[arg-type]


def _scoring_backend(args: argparse.Namespace) -> str | None:
    """``--kernel-backend``, else ``--recipe``'s ``model.overrides.kernel_backend``; None leaves the
    choice to the checkpoint's run recipe, else ``auto`` (:func:`genolong.evaluation.score.scoring_kernel_backend`)."""
    if args.kernel_backend is not None or args.recipe is None:
        return args.kernel_backend
    from .config import load_recipe

    backend = load_recipe(args.recipe, args.set).model.overrides.get("kernel_backend")
    return None if backend is None else str(backend)


def _scoring_device(args: argparse.Namespace, group: object) -> str:
    """``--device`` in one process; each rank's own device (Lightning's choice) in several."""
    import torch

    if not getattr(group, "distributed"):
        return args.device
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _scored_name(args: argparse.Namespace) -> str:
    """The scored model's name for default output paths and labels: the run's name for a run,
    its ``export/`` or a ``step*.ckpt``, else the checkpoint's; ``BASE+ADAPTER`` with ``--adapter``
    (the adapter's run name for a ``runs/NAME/adapter``)."""
    path = Path(args.checkpoint).resolve()
    name = path.parent.parent.name if path.suffix == ".ckpt" else (path.parent.name if path.name == "export" else path.name)
    if args.adapter is None:
        return name
    adapter = Path(args.adapter).resolve()
    return f"{name}+{adapter.parent.name if adapter.name == 'adapter' else adapter.name}"


def _scored_meta(args: argparse.Namespace) -> dict[str, str]:
    """What was scored, for the results' metadata: the checkpoint and, with ``--adapter``, the
    adapter directory (absolute paths)."""
    meta = {"checkpoint": str(Path(args.checkpoint).resolve())}
    if args.adapter is not None:
        meta["adapter"] = str(Path(args.adapter).resolve())
    return meta


def _cmd_evaluate(args: argparse.Namespace) -> int:
    import torch

    from .data.store import GenomeStore
    from .errors import InputError
    from .evaluation.distributed import launch, load_scoring_model
    from .evaluation.report import format_bucket_table, format_routing_table
    from .evaluation.score import evaluate, recipe_context
    from .model.stream import check_segment_tokens

    context = args.context if args.context is not None else recipe_context(args.checkpoint)
    if context is None:
        raise InputError(f"give --context L: {args.checkpoint} is not a finetune run or checkpoint with a recipe to take it from")
    parallel = _parallel_section(args)
    backend = _scoring_backend(args)
    world = parallel.world_size  # type: ignore[attr-defined]
    if args.segment_tokens is None:  # streaming is one process's: a multi-process job splits the tile instead
        segment_tokens = _SEGMENT_TOKENS if world == 1 else None
    elif world > 1 and args.segment_tokens != 0:  # before the processes start: one line, not one per rank
        raise InputError(f"--segment-tokens streams a tile in one process; this job runs {world} processes, each "
                         "rank's share in one forward: pass --segment-tokens 0 (context parallelism splits the tile)")
    else:
        segment_tokens = None if args.segment_tokens == 0 else args.segment_tokens
    check_segment_tokens(segment_tokens)  # before the model loads
    if args.tracks and args.no_tokens:
        raise InputError("--tracks are drawn from the per-token table: drop --no-tokens, or drop --tracks")
    store = GenomeStore.open(args.store)
    split = store.split(args.split)
    regions = split_regions(args.regions, split, store.path) if args.regions else None  # before the model loads
    dtype = getattr(torch, _DTYPES[args.dtype])
    name = _scored_name(args)
    cut = f"-cut{args.context_cut}" if args.context_cut is not None else ""
    out = Path(args.out) if args.out else Path("evaluations") / f"{name}-{args.split}-L{context}{cut}"

    def work(group: object) -> int:
        model, vocab = load_scoring_model(args.checkpoint, group, dtype=dtype, device=_scoring_device(args, group),  # type: ignore[arg-type]
                                          kernel_backend=backend, adapter=args.adapter)
        result = evaluate(
            model, split, out, context, context_cut=args.context_cut, max_tiles=args.max_tiles,
            first_bucket=args.first_bucket, write_tokens=not args.no_tokens, vocab=vocab,
            label=args.label or f"{name}{' cut ' + str(args.context_cut) if args.context_cut is not None else ''}",
            meta={**_scored_meta(args), "store": str(store.path.resolve()), "split": args.split,
                  "dtype": _DTYPES[args.dtype], "device": args.device},
            force=args.force, progress=None if not args.quiet else False,
            segment_tokens=segment_tokens, group=group, tracks=args.tracks, regions=regions,  # type: ignore[arg-type]
        )
        if result is None:  # not the writer
            return 0
        print(f"genolong evaluate: {result.meta['tokens']:,} tokens in {result.meta['tiles']} tiles of {context:,} -> {out}")
        print(format_bucket_table(result.bucket_table()))
        if args.by is not None:
            print(f"\nsplit by {args.by} (soft-masked = lower case in the FASTA, RepeatMasker's repeats):")
            print(format_bucket_table(result.bucket_table(by=args.by)))
        if result.meta.get("routing"):
            print("\nMoE routing over the scored tiles:")
            print(format_routing_table(result.meta["routing"]))
        return 0

    return launch(parallel, work)


def _cmd_probe(args: argparse.Namespace) -> int:
    import torch

    from .data.store import GenomeStore
    from .errors import InputError
    from .evaluation.distributed import launch, load_scoring_model
    from .evaluation.probe import ProbeSettings, probe
    from .evaluation.report import format_probe_table
    from .evaluation.score import recipe_context

    context = args.context if args.context is not None else recipe_context(args.checkpoint)
    if context is None:
        raise InputError(f"give --context L: {args.checkpoint} is not a finetune run or checkpoint with a recipe to take it from")
    distances = _int_list(args.distances, "--distances") if args.distances else ()
    parallel = _parallel_section(args)
    backend = _scoring_backend(args)
    world = parallel.world_size  # type: ignore[attr-defined]
    if args.segment_tokens is None:  # streaming is one process's (as in evaluate)
        segment_tokens = _SEGMENT_TOKENS if world == 1 else None
    elif world > 1 and args.segment_tokens != 0:
        raise InputError(f"--segment-tokens streams in one process; this job runs {world} processes, each view in one "
                         "forward: pass --segment-tokens 0 (context parallelism splits the tile)")
    else:
        segment_tokens = None if args.segment_tokens == 0 else args.segment_tokens
    ProbeSettings(context, args.repeat_bases, distances, segment_tokens=segment_tokens)  # bad settings: before the model loads
    store = GenomeStore.open(args.store)
    split = store.split(args.split)
    dtype = getattr(torch, _DTYPES[args.dtype])
    name = _scored_name(args)
    out = Path(args.out) if args.out else Path("evaluations") / f"{name}-{args.split}-L{context}-probe{args.repeat_bases}"

    def work(group: object) -> int:
        model, vocab = load_scoring_model(args.checkpoint, group, dtype=dtype, device=_scoring_device(args, group),  # type: ignore[arg-type]
                                          kernel_backend=backend, adapter=args.adapter)
        result = probe(
            model, split, out, context, repeat_bases=args.repeat_bases, distances=distances, max_tiles=args.max_tiles,
            vocab=vocab, label=args.label or name,
            meta={**_scored_meta(args), "store": str(store.path.resolve()), "split": args.split,
                  "dtype": _DTYPES[args.dtype], "device": args.device},
            force=args.force, progress=None if not args.quiet else False, segment_tokens=segment_tokens,
            group=group,  # type: ignore[arg-type]
        )
        if result is None:  # not the writer
            return 0
        print(f"genolong probe: a {args.repeat_bases}-base copy planted d bases after its source in {result.meta['tiles']} "
              f"tiles of {context:,} -> {out}; 95% paired block-bootstrap CIs over tiles")
        print(format_probe_table(result.table()))
        return 0

    return launch(parallel, work)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"128,256,1024"`` -> (128, 256, 1024); a one-line error naming ``flag`` otherwise."""
    from .errors import InputError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{flag} must be comma-separated integers (e.g. 128,256,512), got {text!r}") from None


def _cmd_check_logprobs(args: argparse.Namespace) -> int:
    import torch

    from .data.store import GenomeStore
    from .errors import InputError
    from .evaluation.distributed import launch, load_scoring_model
    from .evaluation.logprobs import check_logprobs
    from .evaluation.report import markdown_table

    name = Path(args.checkpoint).resolve().name
    if args.adapter is not None:
        name = _scored_name(args)
    out = Path(args.out) if args.out else Path("evaluations") / f"{name}-logprob-gap-L{args.context}-{_DTYPES[args.dtype]}"
    if out.exists() and not args.force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    parallel = _parallel_section(args)
    backend = _scoring_backend(args)
    split = GenomeStore.open(args.store).split(args.split)

    def work(group: object) -> int:
        model, vocab = load_scoring_model(args.checkpoint, group, dtype=getattr(torch, _DTYPES[args.dtype]),  # type: ignore[arg-type]
                                          device=_scoring_device(args, group), kernel_backend=backend, adapter=args.adapter)
        label = Path(args.checkpoint).name if args.adapter is None else _scored_name(args)
        gap = check_logprobs(model, split, args.context, max_tiles=args.max_tiles, first_bucket=args.first_bucket, vocab=vocab,
                             progress=None if not args.quiet else False, label=f"{label} {_DTYPES[args.dtype]}",
                             group=group)  # type: ignore[arg-type]
        if gap is None:  # not the writer
            return 0
        gap.extra.update(_scored_meta(args))
        gap.save(out)
        table = gap.table()
        rows = [[str(r.bucket), f"{int(r.tokens):,}", f"{r.mean_abs_diff:.3g}", f"{r.max_abs_diff:.3g}"] for r in table.itertuples()]
        print(f"genolong check-logprobs: training path vs step-by-step decode, {_DTYPES[args.dtype]}, {args.max_tiles} tile(s) of "
              f"{args.context:,} -> {out}")
        print(markdown_table(rows, ["preceding bases", "tokens", "mean |diff| (nats)", "max |diff| (nats)"]))
        return 0

    return launch(parallel, work)


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from .config import load_recipe
    from .errors import InputError
    from .plan import eval_plan, format_eval_plan, format_plan, plan

    common = dict(gpus=args.gpus, gpu_mem_gib=args.gpu_mem, host_mem_gib=args.host_mem, gpus_per_node=args.gpus_per_node,
                  moe_imbalance=args.moe_imbalance, kda_kernel=args.kda_kernel, dsa_kernel=args.dsa_kernel)
    if args.evaluate:
        result = eval_plan(load_recipe(args.recipe, args.set), context=args.context, dtype=args.dtype,
                           segment_tokens=args.segment_tokens or None, **common)
        print(json.dumps(result.to_dict(), indent=1) if args.json else format_eval_plan(result))
        return 0
    given = [flag for flag, value in (("--context", args.context), ("--segment-tokens", args.segment_tokens),
                                      ("--dtype", args.dtype)) if value is not None]
    if given:
        raise InputError(f"{', '.join(given)} plan(s) an evaluation: add --evaluate (without it the plan is a training step's)")
    result = plan(load_recipe(args.recipe, args.set), **common)
    print(json.dumps(result.to_dict(), indent=1) if args.json else format_plan(result))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .evaluation.report import format_compare_table, format_gap_table, write_table
    from .evaluation.results import EvalResult
    from .evaluation.stats import compare, compare_softmask

    a, b = EvalResult.load(args.a), EvalResult.load(args.b)
    if args.by == "softmask":
        table, gap = compare_softmask(a, b, n_boot=args.n_boot, seed=args.seed)
        tables = {"compare_softmask.csv": table, "softmask_gap.csv": gap}
    else:
        tables = {"compare.csv": compare(a, b, n_boot=args.n_boot, seed=args.seed)}
    print(f"genolong compare: A = {a.label} ({args.a}), B = {b.label} ({args.b}); {a.tokens:,} tokens in {a.n_tiles} tiles; "
          f"95% paired block-bootstrap CIs over tiles ({args.n_boot} resamples)")
    print(format_compare_table(next(iter(tables.values())), "A", "B"))
    if args.by == "softmask":
        print("\nsoft-masked vs unmasked: the gap between the two relative changes (below 0: the loss falls more, "
              "or rises less, on soft-masked bases; the same resamples)")
        print(format_gap_table(tables["softmask_gap.csv"]))
    if args.out:
        for name, table in tables.items():
            write_table(table, Path(args.out) / name)
        print(f"table(s) written to {', '.join(str(Path(args.out) / name) for name in tables)}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .evaluation.plots import plot_results
    from .evaluation.results import EvalResult

    results = [EvalResult.load(d) for d in args.results]
    written = plot_results(results, Path(args.out), formats=args.format or ("png", "pdf"), n_boot=args.n_boot, seed=args.seed,
                           by=args.by)
    print(f"genolong plot: {len(written)} files in {args.out}: {', '.join(sorted(written))}")
    return 0


def _cmd_variants(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    import torch

    from .errors import InputError
    from .evaluation.distributed import launch, load_scoring_model
    from .evaluation.score import recipe_context
    from .evaluation.variant_run import check_ref_mismatch, in_regions, write_scored_vcf
    from .evaluation.variants import check_layout, score_variants
    from .evaluation.vcf import Reference, read_variants
    from .model.stream import check_segment_tokens

    if args.contexts is not None:
        contexts = _int_list(args.contexts, "--contexts")
    else:
        context = args.context if args.context is not None else recipe_context(args.checkpoint)
        if context is None:
            raise InputError(f"give --context L (or --contexts L1,L2,...): {args.checkpoint} is not a finetune run or "
                             "checkpoint with a recipe to take it from")
        contexts = (context,)
    check_segment_tokens(args.segment_tokens)  # bad settings before the model loads
    parallel = _parallel_section(args)
    backend = _scoring_backend(args)
    # before the processes start: one line, not one per rank
    check_layout(parallel.ep, parallel.world_size)  # type: ignore[attr-defined]
    vcf = Path(args.vcf)
    stem = vcf.name
    for suffix in (".gz", ".bgz", ".vcf", ".bcf"):
        stem = stem.removesuffix(suffix)
    name = _scored_name(args)
    out = Path(args.out) if args.out else Path("variants") / f"{name}-{stem}-L{'-'.join(map(str, contexts))}"
    if out.exists() and not args.force:  # before the reading and the model: one line
        raise InputError(f"{out} already exists; choose another --out or pass --force to replace it")
    # read before the processes start (a bad file: one line, not one per rank); each process reads
    # them itself (Lightning reruns this command line for the other ranks), the same variants in order
    with Reference.open(args.fasta) as reference, tempfile.TemporaryDirectory(prefix="genolong-variants-") as tmp:
        rejects = Path(tmp) / "rejects.tsv"
        found = read_variants(vcf, reference, rejects_path=rejects)
        # another build (too many REF mismatches), then nothing scorable: one line each
        extra = {"ref_mismatch": check_ref_mismatch(vcf, reference, found, rejects, args.max_ref_mismatch)}
        if args.regions is not None:
            found, extra["regions"] = in_regions(found, args.regions, {n: reference.length(n) for n in reference.names})

        def finish(work: Path, table: object) -> None:
            # the rejects and the annotated copy of the input land in the result before it is renamed
            shutil.copyfile(rejects, work / "rejects.tsv")
            write_scored_vcf(vcf, work, table, args.argv)

        def work(group: object) -> int:
            model, vocab = load_scoring_model(args.checkpoint, group, dtype=getattr(torch, _DTYPES[args.dtype]),  # type: ignore[arg-type]
                                              device=_scoring_device(args, group), kernel_backend=backend,
                                              adapter=args.adapter)
            table = score_variants(
                model, reference, found.variants, out, contexts, window=args.window, strands=args.strands, span=args.span,
                segment_tokens=args.segment_tokens, vocab=vocab,
                meta={**_scored_meta(args), "vcf": str(vcf.resolve()), "fasta": str(Path(args.fasta).resolve()), **extra,
                      "records": found.records, "rejects": found.rejects, "dtype": _DTYPES[args.dtype], "device": args.device},
                finish=finish, progress=None if not args.quiet else False, force=args.force,
                group=group)  # type: ignore[arg-type]
            if table is None:  # not the writer
                return 0
            print(f"genolong variants: {len(found.variants):,} alleles of {found.records:,} records scored at context "
                  f"{', '.join(f'{c:,}' for c in contexts)} -> {out} (scores.tsv, scores.parquet, scored.vcf.gz); "
                  f"{found.rejected:,} skipped{' (' + _counts(found.rejects) + '; rejects.tsv)' if found.rejected else ''}")
            llr = table["llr"]
            print(f"LLR (nats): median {llr.median():.4f}, 5%-95% [{llr.quantile(0.05):.4f}, {llr.quantile(0.95):.4f}]; "
                  f"below 0 (alt less likely than ref): {(llr < 0).mean():.1%}")
            return 0

        return launch(parallel, work)


def _counts(counts: dict[str, int]) -> str:
    """``{"symbolic": 2, "ref_mismatch": 1}`` -> ``"2 symbolic, 1 ref_mismatch"``."""
    return ", ".join(f"{n:,} {reason}" for reason, n in counts.items()) or "none"


def _cmd_recipe(args: argparse.Namespace) -> int:
    import json

    from .config import load_recipe, recipe_schema
    from .errors import InputError
    from .files import replace_file

    if args.action == "show":
        print(load_recipe(args.recipe, args.set).to_yaml(), end="")
        return 0
    text = json.dumps(recipe_schema(), indent=2) + "\n"
    if args.out is None:
        print(text, end="")
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if not out.parent.is_dir():
        raise InputError(f"--out {str(out)!r}: the directory {str(out.parent)!r} does not exist; create it or choose another path")
    replace_file(out, lambda tmp: tmp.write_text(text))
    print(f"genolong recipe: JSON Schema written to {out}; a recipe whose first line is "
          f"`# yaml-language-server: $schema={out.name}` (the path relative to the recipe) gets completion and checks")
    return 0


def _scoring_arguments(parser: argparse.ArgumentParser, out_default: str, buckets: bool = True) -> None:
    """The arguments ``evaluate``, ``check-logprobs`` and ``probe`` share: what to score, where, how
    (``buckets``: with ``--first-bucket``)."""
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a model directory (config.json + safetensors, e.g. runs/NAME/export), a run directory "
                             "runs/NAME or a runs/NAME/checkpoints/step*.ckpt")
    parser.add_argument("--adapter", metavar="DIR",
                        help="a LoRA adapter for the base model CHECKPOINT, in the PEFT format (adapter_config.json + "
                             "adapter_model.safetensors: a LoRA run's runs/NAME/adapter, or peft's save_pretrained): "
                             "merged into the loaded weights in memory (W + alpha/r BA, summed in float32; equal to the "
                             "base with separate adapters to float32 rounding), nothing written to disk; recorded in "
                             "the results' metadata (default: none)")
    parser.add_argument("--store", required=True, metavar="DIR", help="genome store (genolong prepare)")
    parser.add_argument("--split", default="eval", help="split to score (default: %(default)s)")
    if buckets:
        parser.add_argument("--first-bucket", type=int, default=1024, metavar="B",
                            help="upper edge of the first context bucket; later ones double (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="parameter dtype (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    parser.add_argument("--out", metavar="DIR", help=f"result directory (default: {out_default})")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _parallel_arguments(parser)
    parser.add_argument("--kernel-backend", choices=("auto", "torch", "fla", "triton"), default=None,
                        help="the kernels the model runs, as in finetune: auto = genolong's Triton / fla-core GPU kernels "
                             "on a GPU, the torch reference on a CPU (default: --recipe's model.overrides.kernel_backend, "
                             "else the checkpoint's run recipe's, else auto); recorded in the results' metadata")


def _parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--recipe`` / ``--set``: the processes a scoring command runs on (:func:`_parallel_section`)."""
    parser.add_argument("--recipe", metavar="RECIPE",
                        help="run on this recipe's parallel section (devices, num_nodes, accelerator, cp, dp_shard, "
                             "dp_replicate, ep), as `genolong finetune RECIPE` does: Lightning starts parallel.devices "
                             "processes per node, or joins those torchrun / SLURM started; the model is sharded over "
                             "the mesh (FSDP2, context and expert parallelism) and loaded shard by shard. Default: one "
                             "process")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of --recipe, or without it set the parallel section alone, e.g. "
                             "--set parallel.devices=4 --set parallel.cp=2 (repeatable)")


def _by_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--by softmask``: split ``what`` by the target base's soft-masking (RepeatMasker's lower case)."""
    parser.add_argument("--by", choices=["softmask"], default=None,
                        help=f"also split {what} by soft-masked (lower-case: repeats) vs unmasked bases, with the "
                             "same paired block-bootstrap intervals (default: all bases pooled)")


def _verbose_argument(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` for the commands that run a model (genolong.console)."""
    parser.add_argument("--verbose", action="store_true",
                        help="also show Lightning's and torch's own messages and warnings, from every process")


#: ``genolong --help``: what the tool does, for a user (the module docstring is for developers)
_DESCRIPTION = """\
Fine-tune DNA language models at long context (up to a million bases) on human
chromosomes, and measure what the longer context buys."""
_EPILOG = """\
typical order:
  genolong quickstart                  the whole story on a bundled human sample, on a CPU (minutes)
  genolong prepare GENOME.fa.gz --out STORE
                                       encode chromosomes once into a genome store
  genolong plan RECIPE.yaml            check that a training recipe fits your GPUs' memory
  genolong finetune RECIPE.yaml        train; the model is saved under runs/NAME/
  genolong evaluate runs/NAME --store STORE
                                       held-out loss by how much context each base had
  genolong compare A_DIR B_DIR         change in loss between two evaluations, with intervals
  genolong plot A_DIR B_DIR --out FIGURES
                                       figures from evaluations

Run `genolong COMMAND --help` for a command's options; recipes/ holds example recipes."""


class _VersionAction(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata is slow to import)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, default: str = argparse.SUPPRESS,
                 help: str | None = None) -> None:  # noqa: A002 - argparse's keyword
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from . import __version__

        print(f"genolong {__version__}")  # on stdout, as argparse's own version action prints
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    # help defaults from genolong.defaults, never from the modules that use them: building the
    # parser imports no numpy, zarr, torch or Lightning (tests/test_cli_startup.py)
    from . import variant_options
    from .defaults import (DEFAULT_EVAL_TILES, DEFAULT_MIN_GAP, DEFAULT_PROBE_TILES, DEFAULT_SPLITS, PROBE_CONTEXT,
                           VARIANT_WINDOW)

    parser = argparse.ArgumentParser(prog="genolong", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction, help="print genolong's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prep = sub.add_parser(
        "prepare",
        help="encode a genome (FASTA, GenBank, EMBL) into a store of training and held-out chromosomes",
        description=(
            "Encode chromosomes of FASTA (plain, gzip or bgzip, with or without .fai/.gzi indexes), GenBank or "
            "EMBL files into a genome store, the input of finetune and evaluate: one token per base, "
            "soft-masked (lower-case) bases kept as such, long runs of N dropped (they split a chromosome into "
            "segments). Chromosomes not named in --train or --eval are skipped."
        ),
    )
    prep.add_argument("fasta", nargs="+", metavar="FASTA", help="input sequence file(s)")
    prep.add_argument("--out", required=True, metavar="DIR", help="store directory to create")
    prep.add_argument("--train", default=",".join(DEFAULT_SPLITS["train"]), metavar="NAMES",
                      help="comma-separated training chromosomes; chr1 and 1 name the same one (default: %(default)s)")
    prep.add_argument("--eval", default=",".join(DEFAULT_SPLITS["eval"]), metavar="NAMES",
                      help="comma-separated held-out chromosomes (default: %(default)s)")
    prep.add_argument("--min-gap", type=int, default=DEFAULT_MIN_GAP, metavar="N",
                      help="runs of at least N unknown bases (N) split a chromosome and are dropped (default: %(default)s)")
    add_names_argument(prep)
    prep.add_argument("--force", action="store_true", help="replace an existing store at --out")
    prep.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    prep.set_defaults(func=_cmd_prepare)

    tune = sub.add_parser(
        "finetune",
        help="train the model on a genome store, as a YAML recipe says; results in runs/NAME/",
        description=(
            "Fine-tune (or train from scratch) the model (GLM-5.3-Flash architecture: linear attention, sparse "
            "attention and mixture-of-experts layers) on windows of a genome store, with the recipe's memory "
            "settings, on one or more CPUs or GPUs; checkpoints, logs and the exported model go to runs/NAME/."
        ),
    )
    tune.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/)")
    tune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a recipe key, e.g. --set train.max_steps=20 (repeatable)")
    tune.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint of this run (a run stopped by a signal, or its requeued "
                           "SLURM job, resumes without it)")
    tune.add_argument("--launcher", choices=("lightning", "ray"), default="lightning",
                      help="lightning (default): this process is the job, or one rank of it (Lightning starts the "
                           "others, or joins torchrun's / SLURM's); ray: start the job's parallel.devices x "
                           "parallel.num_nodes ranks as Ray Train workers on a Ray cluster (pip install "
                           "'genolong[ray]'; docs/scale-out.md)")
    tune.add_argument("--ray-address", default=None, metavar="ADDRESS",
                      help="with --launcher ray: the Ray cluster (auto, ray://HOST:10001; default RAY_ADDRESS, "
                           "else a local Ray)")
    tune.add_argument("--max-failures", type=int, default=3, metavar="N",
                      help="with --launcher ray: start the workers again up to N times after a failure; they resume "
                           "from the newest intact checkpoint (default: %(default)s)")
    tune.epilog = ("exit status: 0 finished; 2 an error in the input (one line); 75 stopped by a signal of "
                   "train.stop_signals (default SIGTERM, SIGUSR1: preemption, a time limit) after writing the "
                   "checkpoint of the step it was in (one line names it); under SLURM, SIGUSR1 (--signal=USR1@N) also "
                   "requeues the job. A SLURM job script (the tests run it): docs/slurm/finetune.sbatch; docs/scale-out.md.")
    _verbose_argument(tune)
    tune.set_defaults(func=_cmd_finetune)

    exp = sub.add_parser(
        "export", help="write the export (model, LoRA adapter) of a finetune run's step checkpoint",
        description="Restore a step checkpoint of a finetune run as --resume does and write what finetune writes at its "
                    "end: DIR/export (GLM-5.3-Flash safetensors; adapters merged under model.lora) and DIR/adapter (PEFT). "
                    "Under torchrun each rank writes its own shards on the run's mesh; otherwise one process.")
    exp.add_argument("target", metavar="RUN|CKPT", help="a run directory (its newest intact checkpoint) or runs/NAME/checkpoints/stepN.ckpt")
    exp.add_argument("--merged", action="store_true", help="the model only (adapters merged under model.lora)")
    exp.add_argument("--adapter", action="store_true", help="the PEFT adapter only (model.lora runs)")
    exp.add_argument("--out", default=None, metavar="DIR", help="where export/ and adapter/ go (default RUN/exports/stepN)")
    _verbose_argument(exp)
    exp.set_defaults(func=_cmd_export)

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
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key (repeatable)")
    pl.add_argument("--gpus", type=int, metavar="N", help="number of GPUs (default: the recipe's devices x num_nodes)")
    pl.add_argument("--gpu-mem", type=float, default=80.0, metavar="GiB", help="memory per GPU (default: %(default)s)")
    pl.add_argument("--host-mem", type=float, metavar="GiB", help="host RAM per node (default: not checked)")
    pl.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default: %(default)s)")
    pl.add_argument("--moe-imbalance", type=float, default=None, metavar="X",
                    help="tokens on the busiest expert rank over the mean (default: the recipe's memory.moe_imbalance, "
                         "4.0 as the reference saw, or its memory.moe_capacity_factor when smaller)")
    pl.add_argument("--kda-kernel", choices=["torch", "fla"], default=None,
                    help="whose KDA kernel's saved tensors to count (default: what the recipe's model.overrides."
                         "kernel_backend runs; auto on a GPU recipe: fla)")
    pl.add_argument("--dsa-kernel", choices=["torch", "triton"], default=None,
                    help="whose DSA kernels' saved tensors to count (default: as --kda-kernel; auto on a GPU recipe: triton)")
    pl.add_argument("--evaluate", action="store_true",
                    help="plan scoring (genolong evaluate) instead of a training step: forward only, weights sharded "
                         "over the recipe's mesh, CP splitting the tile, the largest layer's forward working set")
    pl.add_argument("--context", type=int, metavar="N",
                    help="with --evaluate: tokens per tile (default: the recipe's eval.context, else data.context)")
    pl.add_argument("--segment-tokens", type=int, metavar="S",
                    help="with --evaluate: stream each tile S tokens at a time, as evaluate --segment-tokens "
                         "(each process holding the whole model: parallel.cp and dp_shard 1; 0: one forward; default: one forward)")
    pl.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="with --evaluate: parameter dtype of the scoring (default: bfloat16 for a bf16-mixed recipe, "
                         "else float32)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_cmd_plan)

    ev = sub.add_parser(
        "evaluate",
        help="held-out loss of a model, by how much preceding context each base had (tables, 95%% intervals)",
        description=(
            "Tile a held-out split into windows of --context tokens, score every base with the model and write "
            "the per-token table (parquet), per-window and per-position sums and the bucket table. With --recipe "
            "(or --set parallel.devices=N ...) it runs on several processes as finetune does: the model sharded "
            "over the (dp_replicate, dp_shard, cp) mesh, tiles dealt to the data-parallel groups, each tile split "
            "over a context-parallel group, rank 0 writing; a killed run resumes on the same layout."
        ),
    )
    _scoring_arguments(ev, out_default="evaluations/NAME-SPLIT-LCONTEXT[-cutC]")
    ev.add_argument("--context", type=int, metavar="L",
                    help="tile length in tokens (default: the run's eval context when CHECKPOINT is a run or .ckpt)")
    ev.add_argument("--context-cut", type=int, metavar="C",
                    help="score the same tokens with at most C bases of context each (the model restarts every C bases)")
    ev.add_argument("--max-tiles", type=int, metavar="N", help="score only the first N tiles (default: all)")
    ev.add_argument("--label", help="name of this run in tables and figures (default: from CHECKPOINT)")
    ev.add_argument("--no-tokens", action="store_true", help="do not write the per-token table (aggregates only)")
    ev.add_argument("--tracks", action="store_true",
                    help="also write the per-base loss as bigWig and bedGraph into OUT/tracks (see `genolong tracks`)")
    add_regions_argument(ev)
    ev.add_argument("--segment-tokens", type=int, default=None, metavar="S",
                    help="stream a tile longer than S tokens through the model S at a time, carrying the KDA states "
                         "and DSA caches (peak memory of one segment plus the caches; equal to the one-shot forward "
                         f"up to float rounding); 0: one forward per tile (default: {_SEGMENT_TOKENS} in one process; "
                         "0 in several, where context parallelism splits the tile instead)")
    _by_argument(ev, "the printed bucket table")
    _verbose_argument(ev)
    ev.set_defaults(func=_cmd_evaluate)

    prb = sub.add_parser(
        "probe",
        help="does the model use far context? loss on a planted copy with its source in view and cut away",
        description=(
            "On held-out tiles of --context bases, overwrite the last --repeat-bases bases with the segment d bases "
            "before them, for d in powers of two up to the context, and score the copy twice on the same model: with "
            "the whole tile in view (the source d bases back included) and with the model restarted d - 1 bases "
            "before the copy's end (no base of the source in view). Prints and writes, per distance, both losses and "
            "the drop (cut - full) with 95% paired block-bootstrap CIs over tiles; a figure (PNG + PDF) and JSON."
        ),
    )
    _scoring_arguments(prb, out_default="evaluations/NAME-SPLIT-LCONTEXT-probeM", buckets=False)
    prb.add_argument("--context", type=int, metavar="L",
                     help="tile length in bases (default: the run's eval context when CHECKPOINT is a run or .ckpt)")
    prb.add_argument("--repeat-bases", type=int, default=100, metavar="M", help="bases copied (default: %(default)s)")
    prb.add_argument("--distances", metavar="D1,D2,...",
                     help="distances from source to copy (default: the powers of two with M < d <= L - M)")
    prb.add_argument("--max-tiles", type=int, metavar="N", help="probe only the first N full-length tiles (default: all)")
    prb.add_argument("--label", help="name of this run in tables and figures (default: from CHECKPOINT)")
    prb.add_argument("--segment-tokens", type=int, default=None, metavar="S",
                     help="stream forwards longer than S tokens S at a time (as evaluate); 0: one forward each "
                          f"(default: {_SEGMENT_TOKENS} in one process; 0 in several)")
    _verbose_argument(prb)
    prb.set_defaults(func=_cmd_probe)

    var = sub.add_parser(
        "variants",
        help="variant effect scores at long context: log-likelihood ratio of the alt and the ref haplotype",
        description=(
            "Read a VCF/BCF (SNVs, MNVs, indels; multi-allelic records split per ALT; each allele left-aligned and "
            "trimmed against --fasta as bcftools norm does; symbolic alleles, breakends and REF mismatches skipped "
            "with a count and a line each in rejects.tsv) and score every allele: LLR = log p(alt haplotype) - "
            "log p(ref haplotype) over the allele and --window reference bases after it, with at least --context "
            "bases of reference before it. Nearby variants share one streamed reference prefix (a block), so a "
            "variant costs about two windows, not two contexts. Writes scores.tsv, scores.parquet, a copy of the VCF "
            "with GENOLONG_LLR_L<context> INFO fields (scored.vcf.gz), rejects.tsv and meta.json; with several "
            "--contexts also context_effect.tsv (how much each score moves with context). A killed run resumes at "
            "the next block. With --recipe (or --set parallel.devices=N ...) it runs on several processes as evaluate "
            "does: blocks dealt a round at a time to the data-parallel groups, each streaming its block through the "
            "whole model (gathered on every rank), rank 0 writing; scores equal the one-process run's. With "
            "parallel.cp C a group of C ranks runs each block's long reference prefix split C ways, then splits the "
            "block's variants (scores equal to float rounding). Needs parallel.ep 1; a killed run resumes on the "
            "same layout."
        ),
    )
    var.add_argument("checkpoint", metavar="CHECKPOINT",
                     help="a model directory (config.json + safetensors, e.g. runs/NAME/export), a run directory "
                          "runs/NAME or a runs/NAME/checkpoints/step*.ckpt")
    var.add_argument("--vcf", required=True, metavar="FILE", help="the variants: VCF (plain, gzip or bgzip) or BCF")
    var.add_argument("--fasta", required=True, metavar="FILE",
                     help="the reference they were called against (FASTA: plain, gzip or bgzip; indexed or not)")
    var.add_argument("--context", type=int, metavar="L",
                     help="reference bases before each variant, at least (default: the run's eval context when "
                          "CHECKPOINT is a run or .ckpt)")
    var.add_argument("--contexts", metavar="L1,L2,...",
                     help="score the same variants at several contexts and report how much each score moves")
    var.add_argument("--window", type=int, default=VARIANT_WINDOW, metavar="W",
                     help="reference bases scored after each variant, in both haplotypes (default: %(default)s)")
    var.add_argument("--strands", choices=("forward", "both"), default="forward",
                     help="both: also score the reverse-complement strand and average the two LLRs (twice the cost; "
                          "default: %(default)s)")
    var.add_argument("--span", type=int, default=None, metavar="S",
                     help="the variants of one S-base cell of a fixed grid share a reference prefix, so each sees L to "
                          "L + S - 1 bases before it, by its position alone (default: the context L; 0: exactly L)")
    variant_options.add_arguments(var)
    var.add_argument("--segment-tokens", type=int, default=_SEGMENT_TOKENS, metavar="S",
                     help="stream the reference prefix S tokens at a time (default: %(default)s)")
    var.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter for CHECKPOINT, merged in memory (as evaluate)")
    var.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="parameter dtype (default: %(default)s)")
    var.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    var.add_argument("--kernel-backend", choices=("auto", "torch", "fla", "triton"), default=None,
                     help="the kernels the model runs (as evaluate; default: --recipe's model.overrides.kernel_backend, "
                          "else the checkpoint's run recipe's, else auto)")
    _parallel_arguments(var)
    var.add_argument("--out", metavar="DIR", help="result directory (default: variants/NAME-VCF-LCONTEXTS)")
    var.add_argument("--force", action="store_true", help="replace an existing --out")
    var.add_argument("--quiet", action="store_true", help="no progress bar")
    _verbose_argument(var)
    var.set_defaults(func=_cmd_variants)

    cmp_ = sub.add_parser(
        "compare",
        help="change in held-out loss from evaluation A to evaluation B, per context length, with 95%% intervals",
        description=(
            "Compare two `genolong evaluate` results on the same tokens (base vs tuned, full vs --context-cut, "
            "tuned vs control): per context bucket and overall, B - A in nats and in percent with 95% paired "
            "block-bootstrap intervals over tiles."
        ),
    )
    cmp_.add_argument("a", metavar="A_DIR", help="reference result (e.g. the base model, or the cut run)")
    cmp_.add_argument("b", metavar="B_DIR", help="result compared with it (e.g. the fine-tuned model)")
    cmp_.add_argument("--out", metavar="DIR", help="also write DIR/compare.csv")
    cmp_.add_argument("--n-boot", type=int, default=2000, metavar="N", help="bootstrap resamples (default: %(default)s)")
    cmp_.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    _by_argument(cmp_, "the table (written as compare_softmask.csv, with softmask_gap.csv: the gap between the two "
                       "classes' relative changes)")
    cmp_.set_defaults(func=_cmd_compare)

    plot = sub.add_parser(
        "plot",
        help="figures from evaluate results: loss vs position, bucket means, relative change",
        description=(
            "Draw per-position loss (log x, smoothed; runs overlaid), bucket means with 95% intervals and the relative "
            "change of each run vs the first, from saved `genolong evaluate` tables only."
        ),
    )
    plot.add_argument("results", nargs="+", metavar="RESULT_DIR", help="evaluate results; the first is the reference")
    plot.add_argument("--out", required=True, metavar="DIR", help="directory for the figures (created)")
    plot.add_argument("--format", action="append", choices=["png", "pdf", "svg"], default=None,
                      help="figure format, repeatable (default: png and pdf)")
    plot.add_argument("--n-boot", type=int, default=2000, metavar="N", help="bootstrap resamples (default: %(default)s)")
    plot.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    _by_argument(plot, "the bucket and relative-change figures (buckets_softmask, relative_change_softmask: "
                       "two panels)")
    plot.set_defaults(func=_cmd_plot, format=None)

    add_tracks_parser(sub)

    chk = sub.add_parser(
        "check-logprobs",
        help="self-check: the model's log-probabilities from training-style and step-by-step scoring agree",
        description=(
            "Score held-out tiles with the training path (chunked KDA, blockwise DSA top-k) and with the "
            "independent step-by-step decode path (recurrent KDA state, latent and index-key caches); report mean "
            "and max |difference| by preceding-context bucket, as a table and a figure. With --recipe (or --set "
            "parallel.*) the training path runs sharded and context-parallel, the decode path on the gathered model."
        ),
    )
    _scoring_arguments(chk, out_default="evaluations/NAME-logprob-gap-LCONTEXT-DTYPE")
    chk.add_argument("--context", type=int, required=True, metavar="L", help="tile length in tokens")
    chk.add_argument("--max-tiles", type=int, default=1, metavar="N", help="tiles to check (default: %(default)s)")
    _verbose_argument(chk)
    chk.set_defaults(func=_cmd_check_logprobs)

    quick = sub.add_parser(
        "quickstart",
        help="the whole story on a bundled sample of real human DNA, on a CPU (a few minutes)",
        description=(
            "Prepare the bundled human sample genome, evaluate the bundled short-context base model on held-out "
            "chr22, fine-tune it at long context (recipes/quickstart.yaml), evaluate it with full and with cut "
            "context (and a short-context control with --control), compare with bootstrap CIs, draw the figures "
            "and write OUT/REPORT.md."
        ),
    )
    quick.add_argument("--out", default="genolong-quickstart", metavar="DIR",
                       help="working directory for the quickstart outputs (default: %(default)s)")
    quick.add_argument("--quiet", action="store_true", help="no progress bar")
    quick.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of recipes/quickstart.yaml, e.g. --set train.max_steps=2 (repeatable)")
    quick.add_argument("--prepare-only", action="store_true", help="prepare the sample store and stop")
    quick.add_argument("--control", action="store_true",
                       help="also train and evaluate the short-context control (same windows, context cut at the base's "
                            "training length; a few more minutes)")
    quick.add_argument("--eval-tiles", type=int, default=DEFAULT_EVAL_TILES, metavar="N",
                       help="held-out tiles scored per model (default: %(default)s)")
    quick.add_argument("--probe-tiles", type=int, default=DEFAULT_PROBE_TILES, metavar="N",
                       help=f"held-out tiles of {PROBE_CONTEXT:,} bases the planted-repeat probe (genolong probe) runs on "
                            "per model; 0: no probe (default: %(default)s)")
    _verbose_argument(quick)
    quick.set_defaults(func=_cmd_quickstart)

    rec = sub.add_parser("recipe", help="the recipe schema for editors, or a recipe as genolong reads it",
                         description="`recipe schema` writes the JSON Schema of recipe files (for editor completion and "
                                     "checking); `recipe show RECIPE` prints the recipe with every key resolved.")
    rec_sub = rec.add_subparsers(dest="action", required=True, metavar="ACTION")
    schema = rec_sub.add_parser("schema", help="write the recipe JSON Schema (to stdout, or --out FILE)")
    schema.add_argument("--out", metavar="FILE", help="write it here, e.g. recipe.schema.json (default: stdout)")
    schema.add_argument("--force", action="store_true", help="replace an existing --out")
    show = rec_sub.add_parser("show", help="print a recipe with every key resolved (defaults filled, paths absolute)")
    show.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/)")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key (repeatable)")
    rec.set_defaults(func=_cmd_recipe)
    return parser


def _setup_logging() -> None:
    """genolong's own log lines (checkpoint loading, kernel backend) on stderr, once."""
    logger = logging.getLogger("genolong")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


#: the commands that run a model: their CPU runs keep freed memory (genolong.allocator)
_MODEL_COMMANDS = frozenset({"finetune", "evaluate", "check-logprobs", "probe", "quickstart"})
#: the commands that score a model, one process or several (``--recipe`` / ``--set parallel.*``)
_SCORING_COMMANDS = frozenset({"evaluate", "check-logprobs", "probe"})


def _shards_for_memory(args: argparse.Namespace) -> bool:
    """A scoring command that runs on several processes (its ``--recipe`` / ``--set parallel.*``
    layout): it shards the model to fit memory, so it keeps glibc's allocator. With the kept-freed
    heap, FSDP2's gather / free of one block after another grows every rank's heap back to about the
    whole model's footprint: 4 CPU ranks (cp 2 x dp_shard 2) peaked at 0.98x one process's RSS above
    the imports, 0.48x with glibc's defaults (benchmarks/evaluate_memory.py)."""
    if args.command not in _SCORING_COMMANDS or not hasattr(args, "set"):
        return False
    return int(getattr(_parallel_section(args), "world_size")) > 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``genolong`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for provenance (genolong variants)
    _setup_logging()
    from .console import set_verbose

    set_verbose(getattr(args, "verbose", False))
    try:
        if args.command in _MODEL_COMMANDS and not _shards_for_memory(args):
            # before torch allocates anything: freed activations are reused, not faulted in anew
            # (genolong.allocator; GENOLONG_MALLOC=system opts out)
            keep_freed_memory()
        return int(args.func(args))
    except GenolongError as exc:
        if getattr(exc, "show", True):  # False: another rank of the job prints it (genolong.slurm)
            print(f"genolong {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:  # a signal, at a safe point: the work so far is saved; not finished
        if exc.show:
            print(f"genolong {args.command}: {exc}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        print(f"genolong {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # whoever read the output went away (`genolong plan RECIPE | head`): stop without a
        # traceback, with the status a command killed by SIGPIPE has (as cat's), and point stdout
        # at /dev/null so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except Exception as exc:
        # a full disk or a file-size limit outside genolong's writers (which name their output:
        # genolong.files.writing), e.g. a log file: one line too. A file-size limit reaches here as
        # EFBIG because CPython ignores SIGXFSZ (whose default action would kill the process).
        from .files import full_disk_error

        error = full_disk_error(exc)
        if error is None:
            raise
        print(f"genolong {args.command}: error: {error}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The ``genolong`` console script (and ``python -m genolong.cli``): :func:`main` with this
    process's arguments, then exit with its code.

    A process that is still a rank of a torch.distributed job at the end (the processes Lightning,
    torchrun or SLURM start for a multi-process ``finetune`` / ``evaluate`` / ``variants``) exits
    through :func:`genolong.parallel.shutdown.exit_process`, without the interpreter's finalization,
    where gloo's worker threads can abort a run whose work is done; so does a stopped one (75, SLURM's KillWait)."""
    if sys.argv[1:2] == ["finetune"]:  # a stop signal before training stops it too (genolong.signals)
        catch_from_start()
    code = main()
    ignore_from_now()  # the status is decided: a late stop signal must not change it
    from .parallel.shutdown import exit_process, in_process_group

    if in_process_group() or code == PREEMPTED_EXIT_CODE:  # stopped: out before SLURM's KillWait ends
        exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()

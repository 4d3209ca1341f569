"""``genolong variants``: variant effect scores at long context, the log-likelihood ratio of the alt
and the ref haplotype (:func:`genolong.evaluation.variants.score_variants`; what the command adds
around the scorer: :mod:`genolong.evaluation.variant_run`), on one process or several."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..defaults import VARIANT_MAX_REF_MISMATCH, VARIANT_WINDOW
from .common import (
    DTYPES,
    SEGMENT_TOKENS,
    Command,
    Subcommands,
    checkpoint_argument,
    int_list,
    kernel_backend_argument,
    parallel_arguments,
    placement_arguments,
    verbose_argument,
)

if TYPE_CHECKING:
    from ..evaluation.distributed import ScoringGroup

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``variants`` to the subcommands and return its parser."""
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
    checkpoint_argument(var)
    var.add_argument("--vcf", required=True, metavar="FILE", help="the variants: VCF (plain, gzip or bgzip) or BCF")
    var.add_argument(
        "--fasta",
        required=True,
        metavar="FILE",
        help="the reference they were called against (FASTA: plain, gzip or bgzip; indexed or not)",
    )
    var.add_argument(
        "--context",
        type=int,
        metavar="L",
        help="reference bases before each variant, at least (default: the run's eval context when "
        "CHECKPOINT is a run or .ckpt)",
    )
    var.add_argument(
        "--contexts",
        metavar="L1,L2,...",
        help="score the same variants at several contexts and report how much each score moves",
    )
    var.add_argument(
        "--window",
        type=int,
        default=VARIANT_WINDOW,
        metavar="W",
        help="reference bases scored after each variant, in both haplotypes (default: %(default)s)",
    )
    var.add_argument(
        "--strands",
        choices=("forward", "both"),
        default="forward",
        help="both: also score the reverse-complement strand and average the two LLRs (twice the cost; "
        "default: %(default)s)",
    )
    var.add_argument(
        "--span",
        type=int,
        default=None,
        metavar="S",
        help="the variants of one S-base cell of a fixed grid share a reference prefix, so each sees L to "
        "L + S - 1 bases before it, by its position alone (default: the context L; 0: exactly L)",
    )
    var.add_argument(
        "--regions",
        metavar="BED",
        help="score only the records whose POS lies in a region of this BED (0-based, half-open; "
        "plain or gzip); the others stay in scored.vcf.gz without scores",
    )
    var.add_argument(
        "--max-ref-mismatch",
        type=float,
        default=VARIANT_MAX_REF_MISMATCH,
        metavar="F",
        help="stop, writing nothing, when more than this share of the alleles compared with --fasta "
        "has another REF (another build, chr naming, 0-based positions) (default: %(default)s)",
    )
    var.add_argument(
        "--segment-tokens",
        type=int,
        default=SEGMENT_TOKENS,
        metavar="S",
        help="stream the reference prefix S tokens at a time (default: %(default)s)",
    )
    var.add_argument(
        "--adapter", metavar="DIR", help="a PEFT LoRA adapter for CHECKPOINT, merged in memory (as evaluate)"
    )
    placement_arguments(var)
    kernel_backend_argument(
        var,
        "the kernels the model runs (as evaluate; default: --recipe's model.overrides."
        "kernel_backend, else the checkpoint's run recipe's, else auto)",
    )
    parallel_arguments(var)
    var.add_argument("--out", metavar="DIR", help="result directory (default: variants/NAME-VCF-LCONTEXTS)")
    var.add_argument("--force", action="store_true", help="replace an existing --out")
    var.add_argument("--quiet", action="store_true", help="no progress bar")
    verbose_argument(var)
    return var


def run(args: argparse.Namespace) -> int:
    """Run ``genolong variants``: the variants read and checked against ``--fasta`` before the
    processes start, then scored on every process of the job; the writer prints a summary."""
    import shutil
    import tempfile

    from ..errors import InputError
    from ..evaluation.distributed import launch
    from ..evaluation.variant_run import check_ref_mismatch, in_regions, write_scored_vcf
    from ..evaluation.variants import check_layout, score_variants
    from ..evaluation.vcf import Reference, read_variants
    from ..model.stream import check_segment_tokens
    from .scoring import load_model, parallel_section, scored_meta, scored_name, scoring_backend, scoring_context

    if args.contexts is not None:
        contexts = int_list(args.contexts, "--contexts")
    else:
        contexts = (scoring_context(args, "--context L (or --contexts L1,L2,...)"),)
    check_segment_tokens(args.segment_tokens)  # bad settings before the model loads
    parallel = parallel_section(args)
    backend = scoring_backend(args)
    # before the processes start: one line, not one per rank
    check_layout(parallel.ep, parallel.world_size)
    vcf = Path(args.vcf)
    stem = vcf.name
    for suffix in (".gz", ".bgz", ".vcf", ".bcf"):
        stem = stem.removesuffix(suffix)
    name = scored_name(args)
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

        def work(group: ScoringGroup) -> int:
            model, vocab = load_model(args, group, backend)
            table = score_variants(
                model,
                reference,
                found.variants,
                out,
                contexts,
                window=args.window,
                strands=args.strands,
                span=args.span,
                segment_tokens=args.segment_tokens,
                vocab=vocab,
                meta={
                    **scored_meta(args),
                    "vcf": str(vcf.resolve()),
                    "fasta": str(Path(args.fasta).resolve()),
                    **extra,
                    "records": found.records,
                    "rejects": found.rejects,
                    "dtype": DTYPES[args.dtype],
                    "device": args.device,
                },
                finish=finish,
                progress=None if not args.quiet else False,
                force=args.force,
                group=group,
            )
            if table is None:  # not the writer
                return 0
            print(
                f"genolong variants: {len(found.variants):,} alleles of {found.records:,} records scored at context "
                f"{', '.join(f'{c:,}' for c in contexts)} -> {out} (scores.tsv, scores.parquet, scored.vcf.gz); "
                f"{found.rejected:,} skipped{' (' + _counts(found.rejects) + '; rejects.tsv)' if found.rejected else ''}"
            )
            llr = table["llr"]
            print(
                f"LLR (nats): median {llr.median():.4f}, 5%-95% [{llr.quantile(0.05):.4f}, {llr.quantile(0.95):.4f}]; "
                f"below 0 (alt less likely than ref): {(llr < 0).mean():.1%}"
            )
            return 0

        return launch(parallel, work)


def _counts(counts: dict[str, int]) -> str:
    """``{"symbolic": 2, "ref_mismatch": 1}`` -> ``"2 symbolic, 1 ref_mismatch"``."""
    return ", ".join(f"{n:,} {reason}" for reason, n in counts.items()) or "none"


COMMAND = Command("variants", add, run)

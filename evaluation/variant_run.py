"""What ``genolong variants`` adds around the scorer (its options: :mod:`genolong.cli.variants`):
the build check, regions, and the scored VCF's INFO fields and provenance header.

- :func:`check_ref_mismatch`: past ``--max-ref-mismatch`` (default
  :data:`DEFAULT_MAX_REF_MISMATCH`, 5%) of the alleles compared against the FASTA having another
  REF, the VCF was called on something else (another build, contigs named another way, 0-based
  positions): one line naming the likely cause, non-zero exit, nothing written. The share is
  reported either way (a line, and ``meta.json``'s ``ref_mismatch``). It is checked before
  "nothing scorable" (which it also raises): a VCF whose every REF differs is another build.
- :func:`in_regions`: ``--regions BED`` keeps the records whose POS lies in a region
  (:mod:`genolong.data.regions`; as ``bcftools view -T``), all their ALTs together.
- :func:`write_scored_vcf`: ``scored.vcf.gz`` with per context ``GENOLONG_LLR_L<c>``,
  ``GENOLONG_LOGP_REF_L<c>``, ``GENOLONG_LOGP_ALT_L<c>`` (Float) and
  ``GENOLONG_CONTEXT_USED_L<c>`` (Integer), all ``Number=A``, and a ``##genolong_variants=<...>``
  line: genolong's version, the model and its weights' signature, the reference, contexts,
  window, strands, the block layout rule and the command.

It imports neither torch nor pysam at import time.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..defaults import VARIANT_MAX_REF_MISMATCH
from ..errors import InputError

__all__ = [
    "DEFAULT_MAX_REF_MISMATCH",
    "check_ref_mismatch",
    "in_regions",
    "info_fields",
    "provenance_line",
    "write_scored_vcf",
]

#: the largest share of REF mismatches (of the alleles compared with the FASTA) scored without stopping
DEFAULT_MAX_REF_MISMATCH = VARIANT_MAX_REF_MISMATCH


def _shifted(rejects: Path, reference: Any) -> str:
    """A hint when the mismatched REFs match one base to the left or right (0-based POS, or an off-by-one)."""
    import pandas as pd

    rows = pd.read_csv(rejects, sep="\t", dtype={"ref": str, "chrom": str})
    rows = rows[rows["reason"] == "ref_mismatch"].drop_duplicates("record").head(200)
    if rows.empty:
        return ""
    hits = {-1: 0, 1: 0}
    for row in rows.itertuples(index=False):
        for shift in hits:
            start = int(row.pos) - 1 + shift
            end = start + len(row.ref)
            if start >= 0 and end <= reference.length(row.chrom):
                hits[shift] += reference.fetch(row.chrom, start, end).upper() == row.ref.upper()
    best = max(hits, key=lambda s: hits[s])
    if hits[best] * 2 <= len(rows):
        return ""
    return (
        f"; {hits[best]} of {len(rows)} of the mismatched REFs sit one base to the "
        f"{'left' if best < 0 else 'right'}: the positions look {'0-based' if best > 0 else 'shifted by one'}"
    )


def check_ref_mismatch(vcf: Path, reference: Any, found: Any, rejects: Path, max_share: float) -> dict[str, Any]:
    """Stop when the VCF does not fit the FASTA; report the REF-mismatch share either way.

    Args:
        vcf: the VCF (named in the lines).
        reference: the :class:`~genolong.evaluation.vcf.Reference` it was read against.
        found: :func:`~genolong.evaluation.vcf.read_variants`' result.
        rejects: the rejects TSV read_variants wrote (looked at for a one-base shift).
        max_share: the largest share scored (0 to 1).

    Returns:
        ``{"mismatched", "compared", "share", "max_share"}`` for ``meta.json`` (a line on stderr).

    Raises:
        InputError: ``max_share`` outside [0, 1], or a share above it (one line: the share, the
            likely causes, the fix); then no allele to score at all (one line: the counts per
            reason).
    """
    if not 0.0 <= max_share <= 1.0:
        raise InputError(f"--max-ref-mismatch must be a share between 0 and 1 (e.g. 0.05), got {max_share}")
    mismatched = found.rejects.get("ref_mismatch", 0)
    # every allele that reached the REF comparison: kept, a mismatch, or an N next to it
    compared = len(found.variants) + mismatched + found.rejects.get("reference_n", 0)
    share = mismatched / compared if compared else 0.0
    report = {"mismatched": mismatched, "compared": compared, "share": share, "max_share": max_share}
    if share > max_share:
        raise InputError(
            f"{vcf}: REF differs from the reference {reference.path} at {mismatched:,} of {compared:,} alleles "
            f"({share:.1%}, more than --max-ref-mismatch {max_share:g}){_shifted(rejects, reference)}: the VCF was "
            "likely called on another build (e.g. GRCh37 against GRCh38), against contigs named the same but of "
            "another assembly (chr20 vs 20 renamed), or writes 0-based positions; give the FASTA it was called on "
            f"(see `bcftools norm -c e -f FASTA {vcf}`) or raise --max-ref-mismatch to score the matching rest"
        )
    if not found.variants:
        skipped = ", ".join(f"{n:,} {reason}" for reason, n in found.rejects.items()) or "none"
        raise InputError(
            f"{vcf}: none of its {found.records} records has an allele genolong can score "
            f"(skipped: {skipped}); see the reasons with bcftools view {vcf}"
        )
    from ..console import is_rank_zero

    if is_rank_zero():  # each process of a job reads the VCF: one line
        print(
            f"genolong variants: REF matches {reference.path} at {compared - mismatched:,} of {compared:,} alleles "
            f"({share:.2%} mismatched; the limit --max-ref-mismatch is {max_share:g})",
            file=sys.stderr,
        )
    return report


def in_regions(found: Any, bed: str | Path, sizes: Mapping[str, int]) -> tuple[Any, dict[str, Any]]:
    """The variants of ``found`` whose record's POS lies in a region of ``bed``.

    Args:
        found: the VCF's scorable variants (a ``VariantSet``; contigs as the reference names them).
        bed: the ``--regions`` BED file (plain or gzip; 0-based, half-open), read by
            :func:`genolong.data.regions.read_bed`: its chromosomes are resolved to the
            reference's names through the aliases (``20``, ``chr20``, ``NC_000020.10``).
        sizes: the reference's contig -> length.

    Returns:
        ``(a VariantSet of those, {"bed", "intervals", "bases", "alleles_outside"})``.

    Raises:
        InputError: a bad BED (a region off the reference included), or no variant in it (one
            line naming both files' contigs).
    """
    import numpy as np

    from ..data.regions import read_bed

    regions = read_bed(bed, sizes, option="--regions", where="the reference")
    inside = regions.contains(
        np.array([v.contig for v in found.variants], dtype=object),
        np.array([v.input_pos - 1 for v in found.variants], dtype=np.int64),
    )
    kept = [v for v, keep in zip(found.variants, inside.tolist()) if keep]
    if not kept:
        theirs = sorted({v.contig for v in found.variants})
        raise InputError(
            f"{bed}: none of the {len(found.variants):,} scorable alleles lies in its regions (the BED "
            f"names {', '.join(sorted(regions.intervals)[:5])}; the VCF {', '.join(theirs[:5])}): "
            "check that both use the same build"
        )
    summary = {
        "bed": str(Path(bed).resolve()),
        "intervals": sum(map(len, regions.intervals.values())),
        "bases": regions.bases,
        "alleles_outside": len(found.variants) - len(kept),
    }
    return dataclasses.replace(found, variants=kept), summary


def info_fields(
    contexts: Sequence[int], strands: str, window: int, span: int | None
) -> tuple[dict[str, str], dict[str, str]]:
    """The scored VCF's INFO fields per context: ``(name -> description, name -> type)``."""
    from .variant_score import layout_rule

    both = strands == "both"
    fields: dict[str, str] = {}
    types: dict[str, str] = {}
    for c in contexts:
        about = f"at context {c}, over the allele and {window} reference bases after it"
        fields[f"GENOLONG_LLR_L{c}"] = (
            f"genolong variants: log p(alt haplotype) - log p(ref haplotype), nats, {about} "
            f"({'both strands averaged' if both else 'forward strand'})"
        )
        fields[f"GENOLONG_LOGP_REF_L{c}"] = f"genolong variants: log p(ref haplotype), nats, {about} (forward strand)"
        fields[f"GENOLONG_LOGP_ALT_L{c}"] = f"genolong variants: log p(alt haplotype), nats, {about} (forward strand)"
        fields[f"GENOLONG_CONTEXT_USED_L{c}"] = (
            f"genolong variants: reference bases the model read before the "
            f"variant at context {c} (forward strand; {layout_rule(c, span)})"
        )
        types[f"GENOLONG_CONTEXT_USED_L{c}"] = "Integer"
    return fields, types


def provenance_line(meta: Mapping[str, Any], command: Sequence[str]) -> str:
    """``##genolong_variants=<Version=...,Model=...,ModelSignature=...,Reference=...,Contexts=...,
    Window=...,Strands=...,Span=...,Layout=...,Command=...>`` from the run's ``meta.json``."""
    from .. import __version__

    items = {
        "Version": __version__,
        "Model": meta.get("checkpoint"),
        "Adapter": meta.get("adapter"),
        "ModelSignature": meta.get("model_signature"),
        "Reference": meta.get("reference"),
        "Contexts": ",".join(map(str, meta.get("contexts", []))),
        "Window": meta.get("window"),
        "Strands": meta.get("strands"),
        "Span": meta.get("span"),
        "Layout": meta.get("layout"),
        "Regions": (meta.get("regions") or {}).get("bed"),
        "Command": " ".join(shlex.quote(a) for a in ["genolong", *command]),
    }
    text = ",".join(f'{k}="{str(v).replace(chr(34), chr(39))}"' for k, v in items.items() if v is not None)
    return f"##genolong_variants=<{text}>"


def write_scored_vcf(vcf: Path, work: Path, table: Any, command: Sequence[str]) -> None:
    """Write ``work/scored.vcf.gz`` (and its index) from the scores table and ``work/meta.json``;
    an input out of order is sorted for it (a line says so; ``meta.json``'s ``scored_vcf``)."""
    from .vcf import write_annotated_vcf

    meta = json.loads((work / "meta.json").read_text())
    fields, types = info_fields(meta["contexts"], meta["strands"], meta["window"], meta["span"])
    values: dict[tuple[int, int], dict[str, float]] = {}
    for row in table.itertuples(index=False):
        c = int(row.context)
        values.setdefault((int(row.record), int(row.allele)), {}).update(
            {
                f"GENOLONG_LLR_L{c}": float(row.llr),
                f"GENOLONG_LOGP_REF_L{c}": float(row.logp_ref),
                f"GENOLONG_LOGP_ALT_L{c}": float(row.logp_alt),
                f"GENOLONG_CONTEXT_USED_L{c}": float(row.context_used),
            }
        )
    written = write_annotated_vcf(
        vcf, work / "scored.vcf.gz", values, fields, types=types, header=[provenance_line(meta, command)]
    )
    if written.sorted:
        print(
            f"genolong variants: {vcf} is not sorted by contig and position; scored.vcf.gz holds its records "
            "sorted (each contig's in one block, by POS), so that it is indexed",
            file=sys.stderr,
        )
    meta["scored_vcf"] = {
        "sorted_from_input_order": written.sorted,
        "index": None if written.index is None else written.index.name,
    }
    (work / "meta.json").write_text(json.dumps(meta, indent=1))

"""Variants for ``genolong variants``: VCF/BCF records read with pysam, split per ALT allele and
normalised against the reference FASTA (left-aligned, parsimonious, as ``bcftools norm`` writes them).

This module holds the record every part of variant scoring shares (:class:`Variant`); the reader,
the normaliser and the annotated-VCF writer live here too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Variant"]


@dataclass(frozen=True, order=False)
class Variant:
    """One ALT allele of one VCF record, normalised against the reference.

    Attributes:
        contig: reference sequence name, as in the FASTA (and the VCF).
        pos: 0-based start of ``ref`` on ``contig`` after normalisation.
        ref: the normalised reference allele, uppercase ``A``/``C``/``G``/``T``, non-empty; for an
            indel it starts with the anchor base (the base before the event), as in VCF.
        alt: the normalised alternate allele, same alphabet and convention; ``alt == ref`` for a
            record whose ALT equals its REF (scored exactly 0).
        record: 0-based index of the record in the input file (the order it was read).
        allele: 1-based index of this ALT among the record's ALTs.
        id: the record's ID column (``"."`` when absent).
        input_pos: the record's POS as written (1-based).
        input_ref: the record's REF as written.
        input_alt: this ALT as written.
    """

    contig: str
    pos: int
    ref: str
    alt: str
    record: int
    allele: int
    id: str
    input_pos: int
    input_ref: str
    input_alt: str

    @property
    def end(self) -> int:
        """0-based exclusive end of ``ref`` on the contig."""
        return self.pos + len(self.ref)

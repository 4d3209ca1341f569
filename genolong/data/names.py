"""Human chromosome names across conventions, and ``NAME:START-END`` record names.

The same chromosome goes by several names: UCSC ``chr1``, Ensembl / 1000 Genomes / GRC ``1``,
RefSeq ``NC_000001.11`` (GRCh38) or ``NC_000001.10`` (GRCh37), GenBank ``CM000663.2`` (GRCh38) or
``CM000663.1`` (GRCh37). genolong resolves each to the UCSC form (``chr1`` ... ``chr22``, ``chrX``,
``chrY``, ``chrM``) so that ``--train chr1`` finds ``>1`` or ``>NC_000001.11`` as well.

================  =============  =============  ============  ============
UCSC              GRCh38 RefSeq  GRCh37 RefSeq  GRCh38 GenBank GRCh37 GenBank
================  =============  =============  ============  ============
chr1 (1)          NC_000001.11   NC_000001.10   CM000663.2    CM000663.1
chr2 (2)          NC_000002.12   NC_000002.11   CM000664.2    CM000664.1
...               ...            ...            ...           ...
chr22 (22)        NC_000022.11   NC_000022.10   CM000684.2    CM000684.1
chrX (X, 23)      NC_000023.11   NC_000023.10   CM000685.2    CM000685.1
chrY (Y, 24)      NC_000024.10   NC_000024.9    CM000686.2    CM000686.1
chrM (M, MT)      NC_012920.1 (rCRS; hg19's chrM is NC_001807.4)  J01415.2
================  =============  =============  ============  ============

RefSeq ``NC_0000NN`` numbers the nuclear chromosomes 1-24 (23 = X, 24 = Y) and GenBank
``CM000663``-``CM000686`` runs in the same order, so any version of those accessions resolves; the
full versioned table is :data:`ACCESSIONS`. Names that are not a human chromosome (``chrUn_...``,
``chr1_KI270706v1_random``, ``HLA-A*01:01:01:01``) are kept as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ACCESSIONS",
    "CHROMOSOMES",
    "Region",
    "canonical_name",
    "parse_record_name",
    "same_chromosome",
    "source_name",
]

#: UCSC names of the human chromosomes, in karyotype order.
CHROMOSOMES: tuple[str, ...] = tuple([f"chr{i}" for i in range(1, 23)] + ["chrX", "chrY", "chrM"])

_GRCH38_REFSEQ_VERSION = {
    1: 11,
    2: 12,
    3: 12,
    4: 12,
    5: 10,
    6: 12,
    7: 14,
    8: 11,
    9: 12,
    10: 11,
    11: 10,
    12: 12,
    13: 11,
    14: 9,
    15: 10,
    16: 10,
    17: 11,
    18: 10,
    19: 10,
    20: 11,
    21: 9,
    22: 11,
    23: 11,
    24: 10,
}


def _build_accessions() -> dict[str, str]:
    table: dict[str, str] = {}
    for number, v38 in _GRCH38_REFSEQ_VERSION.items():
        ucsc = CHROMOSOMES[number - 1]
        table[f"NC_{number:06d}.{v38}"] = ucsc  # GRCh38 RefSeq
        table[f"NC_{number:06d}.{v38 - 1}"] = ucsc  # GRCh37 RefSeq: one version earlier
        table[f"CM{662 + number:06d}.2"] = ucsc  # GRCh38 GenBank
        table[f"CM{662 + number:06d}.1"] = ucsc  # GRCh37 GenBank
    table.update({"NC_012920.1": "chrM", "J01415.2": "chrM", "NC_001807.4": "chrM"})
    return table


#: Versioned accession -> UCSC name, for GRCh38 and GRCh37 (RefSeq and GenBank).
ACCESSIONS: dict[str, str] = _build_accessions()

_CHROM_RE = re.compile(r"^(?:chr)?(\d{1,2}|x|y|m|mt)$", re.IGNORECASE)
_REFSEQ_RE = re.compile(r"^NC_0000(\d\d)(?:\.\d+)?$", re.IGNORECASE)
_GENBANK_RE = re.compile(r"^CM000(\d{3})(?:\.\d+)?$", re.IGNORECASE)
_MITO_RE = re.compile(r"^(?:NC_012920|J01415|NC_001807)(?:\.\d+)?$", re.IGNORECASE)
_REGION_RE = re.compile(r"^(?P<name>.+):(?P<start>[\d,]+)-(?P<end>[\d,]+)$")


def canonical_name(name: str) -> str:
    """The UCSC name of a human chromosome, whatever convention ``name`` uses.

    Args:
        name: a record or requested name, e.g. ``"1"``, ``"chr1"``, ``"NC_000001.11"``,
            ``"CM000663.2"``, ``"MT"``.

    Returns:
        ``"chr1"`` ... ``"chr22"``, ``"chrX"``, ``"chrY"``, ``"chrM"``; any other name unchanged.
    """
    if m := _CHROM_RE.match(name):
        key = m.group(1).upper()
        if key.isdigit():
            number = int(key)
            return f"chr{number}" if 1 <= number <= 22 else name
        return "chrM" if key in ("M", "MT") else f"chr{key}"
    if m := _REFSEQ_RE.match(name):
        number = int(m.group(1))
        if 1 <= number <= 24:
            return CHROMOSOMES[number - 1]
    if m := _GENBANK_RE.match(name):
        number = int(m.group(1)) - 662
        if 1 <= number <= 24:
            return CHROMOSOMES[number - 1]
    if _MITO_RE.match(name):
        return "chrM"
    return name


def same_chromosome(a: str, b: str) -> bool:
    """Whether two names denote the same chromosome (``same_chromosome("1", "NC_000001.11")``)."""
    return canonical_name(a) == canonical_name(b)


@dataclass(frozen=True)
class Region:
    """What a record name says about its sequence.

    Attributes:
        record: the record's name as written (first word of the FASTA header).
        contig: the canonical chromosome name (:func:`canonical_name` of the name part).
        start: 0-based genomic coordinate of the record's first base (0 unless the name has a
            ``:START-END`` suffix, 1-based inclusive as samtools writes it).
        length: the length the suffix implies, or ``None`` without a suffix.
    """

    record: str
    contig: str
    start: int = 0
    length: int | None = None


def parse_record_name(record: str) -> Region:
    """Split a record name into chromosome and coordinates.

    ``chr22:20000001-21000000`` (samtools ``faidx`` region style, 1-based inclusive) is the
    slice of chr22 starting at 0-based position 20,000,000 with 1,000,000 bases; ``chr1`` is a
    whole chromosome starting at 0.

    Args:
        record: the first word of a FASTA header (or a GenBank/EMBL id).

    Returns:
        The :class:`Region` the name describes.
    """
    if m := _REGION_RE.match(record):
        start = int(m.group("start").replace(",", ""))
        end = int(m.group("end").replace(",", ""))
        if 1 <= start <= end:
            return Region(
                record=record, contig=canonical_name(m.group("name")), start=start - 1, length=end - start + 1
            )
    return Region(record=record, contig=canonical_name(record))


def source_name(record: str) -> str:
    """The chromosome name as a record writes it, without a ``:START-END`` slice suffix.

    ``"22:20000001-21000000"`` -> ``"22"``, ``"chr20"`` -> ``"chr20"``, ``"NC_000020.10"`` ->
    ``"NC_000020.10"``: the name the user's own files (FASTA, VCF, BED) use for it, where
    :func:`canonical_name` gives the UCSC one.
    """
    if m := _REGION_RE.match(record):
        start = int(m.group("start").replace(",", ""))
        end = int(m.group("end").replace(",", ""))
        if 1 <= start <= end:
            return m.group("name")
    return record

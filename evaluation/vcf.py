"""Variants for ``genolong variants``: VCF/BCF records read with pysam, split per ALT allele and
normalised against the reference FASTA (left-aligned, parsimonious, as ``bcftools norm`` writes them).

- :class:`Reference`: the FASTA, by random access (pysam/htslib ``faidx``; an index is built in a
  temporary directory when none sits beside the file) or, for a plain-gzip FASTA such as UCSC's
  ``hg38.fa.gz`` (no random access possible), the contigs the VCF needs read into memory in one
  streamed pass (:mod:`genolong.data.fasta`).
- :func:`normalize`: one allele pair left-aligned and trimmed to parsimony (Tan, Abecasis & Kang
  2015, "Unified representation of genetic variants"; the algorithm of ``bcftools norm -f``).
- :func:`read_variants`: a VCF/BCF as a :class:`VariantSet` of normalised :class:`Variant` s, one per
  ALT, with every skipped allele counted by reason and listed in a rejects file.
- :func:`write_annotated_vcf`: a copy of the input VCF with per-ALT INFO fields added (the scores).
"""

from __future__ import annotations

import gzip
import math
import os
import re
import shutil
import tempfile
import weakref
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..data.alphabet import decode, encode
from ..data.fasta import detect_format, open_source
from ..errors import InputError
from ..files import replace_file, unique_sibling, writing
from .hts_messages import htslib_messages, report

__all__ = [
    "REJECT_REASONS",
    "AnnotatedVCF",
    "Reference",
    "Variant",
    "VariantSet",
    "normalize",
    "read_variants",
    "write_annotated_vcf",
]


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

    @property
    def key(self) -> tuple[str, int, str, str]:
        """``(contig, pos, ref, alt)``: equal for every representation of one variant."""
        return (self.contig, self.pos, self.ref, self.alt)


# ------------------------------------------------------------------------------------------------
# The reference FASTA

_NOT_BASE = re.compile(r"[^ACGTNacgtn]")


class Reference:
    """The reference FASTA that variants are checked, normalised and scored against.

    Open it with :meth:`open`. Random access (pysam's ``FastaFile``, htslib ``faidx``) for bgzip
    and plain FASTA: the ``.fai`` (and, for bgzip, ``.gzi``) beside the file when both are there,
    else an index built by ``samtools faidx`` in a temporary directory (nothing is written beside
    the user's file; removed on :meth:`close`). A plain-gzip FASTA cannot be read by random access:
    its contigs are decompressed in one streamed pass (:func:`genolong.data.fasta.open_source`)
    and only those asked for with :meth:`load` (or touched first by :meth:`fetch`) are kept in
    memory, one byte per base (hg38 chr1: 249 MB).

    Sequence comes back with its case (lowercase: soft-masked repeats); IUPAC ambiguity codes come
    back as N (either case), as in genolong's store.

    Attributes:
        path: the FASTA file.
        kind: ``indexed`` (pysam, the index beside the file), ``indexed-temporary`` (pysam, an
            index built in a temporary directory) or ``memory`` (plain gzip, streamed).
    """

    def __init__(self, path: Path, kind: str, fasta: Any = None, tempdir: Path | None = None):
        """Use :meth:`open`."""
        self.path = path
        self.kind = kind
        self._fasta = fasta
        self._lengths: dict[str, int] | None = None
        self._loaded: dict[str, np.ndarray] = {}
        if fasta is not None:
            self._lengths = dict(zip(fasta.references, fasta.lengths, strict=True))
        self._cleanup = weakref.finalize(self, _close_reference, fasta, tempdir)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Reference:
        """Open a FASTA file (plain, gzip or bgzip) for :meth:`fetch`.

        Args:
            path: the reference FASTA; the VCF's contig names must be its record names.

        Returns:
            The reference (close it with :meth:`close`, or use it as a context manager).

        Raises:
            InputError: missing, empty or not FASTA (GenBank/EMBL are refused: a reference for a
                VCF is FASTA), or an index that cannot be built (the message names the fix).
        """
        import pysam

        path = Path(path)
        kind = detect_format(path)
        if kind in ("genbank", "embl"):
            raise InputError(f"{path}: a {kind} file; give the reference as FASTA (plain, gzip or bgzip)")
        if kind == "fasta-gzip":
            return cls(path, "memory")
        fai, gzi = Path(f"{path}.fai"), Path(f"{path}.gzi")
        if fai.is_file() and (kind == "fasta" or gzi.is_file()):
            try:
                return cls(path, "indexed", pysam.FastaFile(str(path)))
            except (OSError, ValueError) as exc:
                raise InputError(
                    f"{path}: cannot open with its index {fai} ({exc}); delete the index "
                    f"(and any .gzi) and re-index with `samtools faidx {path}`"
                ) from None
        # no index beside the file: build one aside rather than write next to the user's file
        tempdir = Path(tempfile.mkdtemp(prefix="genolong-fai-"))
        tmp_fai, tmp_gzi = tempdir / "ref.fai", tempdir / "ref.gzi"
        try:
            args = [str(path), "--fai-idx", str(tmp_fai)]
            if kind == "fasta-bgzip":
                args += ["--gzi-idx", str(tmp_gzi)]
            pysam.faidx(*args)
            fasta = pysam.FastaFile(
                str(path),
                filepath_index=str(tmp_fai),
                filepath_index_compressed=str(tmp_gzi) if kind == "fasta-bgzip" else None,
            )
        except (pysam.utils.SamtoolsError, OSError, ValueError) as exc:
            shutil.rmtree(tempdir, ignore_errors=True)
            why = " ".join(str(exc).split())[-300:]
            raise InputError(
                f"{path}: cannot index the FASTA ({why}); check the file with `samtools faidx {path}`"
            ) from None
        return cls(path, "indexed-temporary", fasta, tempdir)

    def close(self) -> None:
        """Release the file and remove a temporary index (also done when the object is collected)."""
        self._cleanup()
        self._fasta = None
        self._loaded.clear()

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what is in the file ---------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The record names, in FASTA order (a streamed pass for a plain-gzip FASTA, once)."""
        return list(self._all_lengths())

    def length(self, contig: str) -> int:
        """The length of ``contig`` in bases.

        Raises:
            InputError: no such record in the FASTA.
        """
        lengths = self._all_lengths()
        if contig not in lengths:
            raise self._absent(contig)
        return lengths[contig]

    def __contains__(self, contig: object) -> bool:
        return contig in self._all_lengths()

    def load(self, contigs: Iterable[str]) -> None:
        """Make ``contigs`` available to :meth:`fetch` at once: for a plain-gzip FASTA, one streamed
        pass that keeps them in memory (and learns every record's name and length); a no-op for
        random access. Names not in the FASTA are ignored (:meth:`length` reports them)."""
        if self.kind != "memory":
            return
        wanted = set(contigs) - set(self._loaded)
        if wanted or self._lengths is None:
            self._stream(wanted)

    def _all_lengths(self) -> dict[str, int]:
        if self._lengths is None:
            self._stream(set())
        assert self._lengths is not None
        return self._lengths

    def _stream(self, wanted: set[str]) -> None:
        """One pass over a plain-gzip FASTA: every record's length, and the tokens of ``wanted``."""
        lengths: dict[str, int] = {}
        for info, blocks in open_source(self.path).records(lambda info: True):
            if info.name in lengths:
                raise InputError(f"{info.where()}: a second record named {info.name!r}; give each record its own name")
            assert blocks is not None
            if info.name in wanted:
                self._loaded[info.name] = np.concatenate([block.tokens for block in blocks])
                lengths[info.name] = int(self._loaded[info.name].size)
            else:
                lengths[info.name] = sum(int(block.tokens.size) for block in blocks)
        self._lengths = lengths

    def _absent(self, contig: str) -> InputError:
        names = list(self._all_lengths())
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} records)" if len(names) > 5 else "")
        return InputError(f"{self.path}: no record {contig!r} (the FASTA has {shown}); name a record of the FASTA")

    # -- sequence --------------------------------------------------------------------------------

    def _check_range(self, contig: str, start: int, end: int) -> None:
        length = self.length(contig)
        if not 0 <= start <= end <= length:
            raise ValueError(f"{contig}:[{start}, {end}) is outside the record (0 to {length:,}) in {self.path}")

    def fetch(self, contig: str, start: int, end: int) -> str:
        """The bases ``[start, end)`` (0-based, half-open) of ``contig``, case kept.

        Returns:
            ``end - start`` letters of ``ACGTNacgtn`` (IUPAC codes as N, their case kept).

        Raises:
            InputError: no such record, or a character that is not a base in that range.
            ValueError: the range is not inside the record.
        """
        self._check_range(contig, start, end)
        if self.kind == "memory":
            return decode(self._tokens(contig)[start:end])
        text = self._fasta.fetch(reference=contig, start=start, end=end)
        if _NOT_BASE.search(text):  # ambiguity codes -> N as in the store; anything else is an error
            text = decode(self._encode(text, contig, start))
        return text

    def tokens(self, contig: str, start: int, end: int) -> np.ndarray:
        """The bases ``[start, end)`` of ``contig`` as store token ids (:mod:`genolong.data.alphabet`).

        Returns:
            ``[end - start]`` uint8 (a new array), soft-mask flag kept, ambiguity codes as N.

        Raises:
            InputError: as :meth:`fetch` (an unknown contig or a range outside it).
        """
        self._check_range(contig, start, end)
        if self.kind == "memory":
            return self._tokens(contig)[start:end].copy()
        return self._encode(self._fasta.fetch(reference=contig, start=start, end=end), contig, start)

    def _tokens(self, contig: str) -> np.ndarray:
        if contig not in self._loaded:
            self.load([contig])
        return self._loaded[contig]

    def _encode(self, text: str, contig: str, start: int) -> np.ndarray:
        try:
            return encode(text)
        except ValueError as exc:
            raise InputError(f"{self.path}: record {contig!r} near base {start + 1:,}: {exc}; fix the FASTA") from None


def _close_reference(fasta: Any, tempdir: Path | None) -> None:
    if fasta is not None:
        fasta.close()
    if tempdir is not None:
        shutil.rmtree(tempdir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Normalisation

#: bases fetched at a time when an indel is shifted left (bcftools norm uses 100 too; the result
#: does not depend on it)
_PAD = 100


def normalize(reference: Reference, contig: str, pos0: int, ref: str, alt: str) -> tuple[int, str, str]:
    """Left-align and trim one REF/ALT pair to its parsimonious form, as ``bcftools norm -f`` does.

    The algorithm of Tan, Abecasis & Kang (2015) as bcftools implements it: while both alleles end
    with the same base, drop it, and when an allele becomes empty extend both with the reference
    bases to their left (an indel slides left through its repeat); then drop the bases both start
    with while both keep at least one (an indel keeps its one anchor base; an MNV or SNV loses its
    shared flanks: ``CGT>CAT`` becomes ``G>A`` one base on). At the contig's first base there is no
    base to the left: the variant keeps the base after it (``AA>A`` at POS 1), as bcftools does.
    ``ref == alt`` (not a variant) is returned unchanged (uppercase). The REF is not checked
    against the reference here (:func:`read_variants` does).

    Args:
        reference: the FASTA.
        contig: a record of ``reference``.
        pos0: 0-based start of ``ref``.
        ref: the reference allele (case ignored).
        alt: the alternate allele (case ignored).

    Returns:
        ``(pos0, ref, alt)`` normalised, alleles uppercase. Bases taken from the reference may be
        N where the reference has N (callers reject those).
    """
    ref, alt = ref.upper(), alt.upper()
    if ref == alt:
        return pos0, ref, alt
    pos = pos0
    while ref[-1:] == alt[-1:] and ref and alt:
        if min(len(ref), len(alt)) <= 1 and pos == 0:
            break  # the contig's first base: nothing to the left to pad with
        ref, alt = ref[:-1], alt[:-1]
        if not ref or not alt:
            pad = min(pos, _PAD)
            left = reference.fetch(contig, pos - pad, pos).upper()
            ref, alt, pos = left + ref, left + alt, pos - pad
    trim = 0
    limit = min(len(ref), len(alt)) - 1  # keep at least one base in each allele
    while trim < limit and ref[trim] == alt[trim]:
        trim += 1
    return pos + trim, ref[trim:], alt[trim:]


# ------------------------------------------------------------------------------------------------
# Reading

#: why an ALT allele is skipped (the ``reason`` column of the rejects file)
REJECT_REASONS: dict[str, str] = {
    "missing_alt": "ALT is '.' (no alternate allele)",
    "symbolic": "a symbolic allele (<DEL>, <INS>, <*>, <NON_REF>, ...) or the spanning-deletion allele *",
    "breakend": "a breakend (A[chr2:100[, ]chr2:100]A, A., .A)",
    "not_acgt": "REF or ALT holds a base other than A, C, G, T (N or an IUPAC ambiguity code)",
    "ref_mismatch": "REF differs from the reference at POS (case ignored; N in the reference never matches)",
    "reference_n": "left-aligning the allele reached an N (or IUPAC code) of the reference",
}

_REJECTS_HEADER = "record\tchrom\tpos\tid\tref\talt\treason\n"
_ACGT = re.compile(r"[ACGTacgt]+")
_FIX_BGZIP = "check it with `bgzip -t` (or `gzip -t`), then write or fetch it again"


@dataclass
class VariantSet:
    """The variants of a VCF/BCF file, normalised, and what was skipped.

    Attributes:
        variants: one :class:`Variant` per kept ALT allele, sorted by (the contig's place in the
            reference FASTA, ``pos``, ``record``, ``allele``).
        rejects: skipped ALT alleles per reason (:data:`REJECT_REASONS`; only reasons that
            occurred).
        records: how many records the file holds.
    """

    variants: list[Variant]
    rejects: dict[str, int] = field(default_factory=dict)
    records: int = 0

    @property
    def rejected(self) -> int:
        """How many ALT alleles were skipped, all reasons together."""
        return sum(self.rejects.values())


@dataclass(frozen=True)
class _Record:
    index: int
    chrom: str
    pos: int  # 1-based, as written
    id: str
    ref: str
    alts: tuple[str, ...]  # ("." ,) for ALT '.'


@contextmanager
def _open_vcf(path: Path) -> Iterator[Any]:
    """pysam's reader on a VCF/BCF (plain, bgzip; a plain-gzip VCF is decompressed to a temporary
    file first: htslib cannot read it through pysam). Open errors become one-line InputErrors."""
    if not path.exists():
        raise InputError(f"{path}: no such file; check the path to the VCF")
    if not path.is_file() or path.stat().st_size == 0:
        raise InputError(f"{path}: empty or not a regular file; give a VCF or BCF file")
    tempdir: str | None = None
    try:
        try:
            handle = _variant_file(path, path)
        except NotImplementedError:  # plain gzip: pysam cannot seek in it
            tempdir = tempfile.mkdtemp(prefix="genolong-vcf-")
            plain = Path(tempdir) / "input.vcf"
            try:
                with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (EOFError, OSError, zlib.error) as exc:
                raise InputError(f"{path}: the gzip stream is truncated or damaged ({exc}); {_FIX_BGZIP}") from None
            handle = _variant_file(plain, path)
        try:
            yield handle
        finally:
            try:
                handle.close()
            except OSError:  # htslib fails the close of a stream that failed to decompress; reported already
                pass
    finally:
        if tempdir is not None:
            shutil.rmtree(tempdir, ignore_errors=True)


def _variant_file(path: Path, shown: Path) -> Any:
    """``pysam.VariantFile(path)``; errors name ``shown`` (the user's file)."""
    import pysam

    verbosity = pysam.set_verbosity(0)  # no "[E::idx_find_and_load] Could not retrieve index file" for unindexed input
    try:
        return pysam.VariantFile(str(path))
    except ValueError as exc:
        if "VCF/BCF format" not in str(exc):
            raise
        damage = _gzip_damage(path)
        if damage is not None:
            raise InputError(f"{shown}: the compressed file is damaged ({damage}); {_FIX_BGZIP}") from None
        raise InputError(
            f"{shown}: not a VCF/BCF file with a header (a VCF starts with '##fileformat=VCFv4.x' and has a "
            "'#CHROM POS ID REF ALT ...' line before its records); add the header or give the right file"
        ) from None
    except OSError as exc:
        if "truncated" in str(exc) or "EOF marker" in str(exc):
            raise InputError(f"{shown}: the bgzip file is truncated (no end-of-file block); {_FIX_BGZIP}") from None
        raise InputError(
            f"{shown}: cannot read as VCF/BCF ({exc}); check it with `bcftools view {shown} > /dev/null`"
        ) from None
    finally:
        pysam.set_verbosity(verbosity)


def _gzip_damage(path: Path) -> str | None:
    """Why the start of a gzip/bgzip file does not decompress, or None (also for uncompressed files)."""
    with open(path, "rb") as handle:
        if handle.read(2) != b"\x1f\x8b":
            return None
    try:
        with gzip.open(path, "rb") as handle:
            handle.read(1 << 17)
    except (EOFError, OSError, zlib.error) as exc:
        return str(exc) or type(exc).__name__
    return None


def _read_records(path: Path) -> tuple[list[_Record], dict[str, int | None]]:
    """Every record of the file, and the header's contig lengths (None where not given). htslib's
    messages are captured (:mod:`~genolong.evaluation.hts_messages`): those that matter are printed
    as genolong's lines, or named in the error."""
    records: list[_Record] = []
    failure: tuple[str, Exception] | None = None
    with htslib_messages() as said:
        with _open_vcf(path) as vcf:
            contigs = {name: vcf.header.contigs[name].length for name in vcf.header.contigs}
            iterator = iter(vcf)
            while True:
                try:
                    rec = next(iterator)
                except StopIteration:
                    break
                except (OSError, ValueError) as exc:
                    where = f"record {len(records) + 1}"
                    header = None if vcf.is_bcf else _header_lines(path)
                    if header is not None:
                        where += f" (line {header + len(records) + 1})"
                    failure = (where, exc)
                    break
                index = len(records)
                ref = rec.ref or ""
                if ref in ("", "."):
                    raise InputError(
                        f"{path}: record {index + 1} ({rec.chrom}:{rec.pos}) has no REF ('.'); every record needs "
                        "its reference bases: fill them in from the reference (e.g. `bcftools norm -c s -f REF.fa`)"
                    )
                records.append(_Record(index, rec.chrom, rec.pos, rec.id or ".", ref, tuple(rec.alts or (".",))))
    if failure is not None:
        where, exc = failure
        detail = "; ".join(line.strip() for line in dict.fromkeys(said) if line.strip())
        raise InputError(
            f"{path}: cannot read {where}: htslib says {exc!s}{f' ({detail})' if detail else ''}, the file is "
            f"truncated or malformed; check it with `bcftools view {path} > /dev/null`"
        )
    report(said, str(path))
    return records, contigs


def _header_lines(path: Path) -> int | None:
    """How many header lines ('#') a VCF text file (plain, gzip or bgzip) starts with, or None if
    they do not decompress: what htslib reads back is not the text (it adds a PASS filter line), so
    the file is read again."""
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    count = 0
    try:
        with gzip.open(path, "rb") if gz else open(path, "rb") as handle:
            for line in handle:
                if not line.startswith(b"#"):
                    break
                count += 1
    except (EOFError, OSError, zlib.error):
        return None
    return count


def _classify(alt: str) -> str | None:
    """The reject reason of an ALT by its form alone, or None."""
    if alt == ".":
        return "missing_alt"
    if alt == "*" or alt.startswith("<"):
        return "symbolic"
    if "[" in alt or "]" in alt or (len(alt) > 1 and (alt.startswith(".") or alt.endswith("."))):
        return "breakend"
    if not _ACGT.fullmatch(alt):
        return "not_acgt"
    return None


def _check_contigs(path: Path, reference: Reference, records: list[_Record], header: dict[str, int | None]) -> None:
    """A contig the reference lacks, a header length that is not the reference's, a REF past the
    contig's end: each means the VCF was called against another reference (build or naming)."""
    used = dict.fromkeys(record.chrom for record in records)
    reference.load(used)
    for chrom in used:
        if chrom not in reference:
            hint = ""
            for other in (
                f"chr{chrom}",
                chrom.removeprefix("chr"),
                "chrM" if chrom == "MT" else "MT" if chrom == "chrM" else "",
            ):
                if other and other != chrom and other in reference:
                    hint = f" (it has {other!r}: the two name chromosomes differently)"
                    break
            raise InputError(
                f"{path}: contig {chrom!r} is not in the reference {reference.path}{hint}; give the FASTA of the "
                "build the VCF was called on, or rename the VCF's contigs with `bcftools annotate --rename-chrs MAP`"
            )
        declared = header.get(chrom)
        if declared is not None and declared != reference.length(chrom):
            raise InputError(
                f"{path}: the header gives contig {chrom!r} length {declared:,} but the reference {reference.path} "
                f"has {reference.length(chrom):,}: another build; give the FASTA the VCF was called on"
            )
    for record in records:
        if record.pos < 1 and any(_classify(alt) is None for alt in record.alts):
            raise InputError(
                f"{path}: record {record.index + 1} ({record.chrom}:{record.pos}) has POS < 1 for a sequence "
                "variant; POS is 1-based: fix the record"
            )
        length = reference.length(record.chrom)
        if record.pos - 1 + len(record.ref) > length:
            raise InputError(
                f"{path}: record {record.index + 1} ({record.chrom}:{record.pos}, REF {len(record.ref)} bases) ends "
                f"beyond the end of {record.chrom!r} ({length:,} bases in {reference.path}): another build; "
                "give the FASTA the VCF was called on"
            )


def read_variants(
    vcf_path: str | os.PathLike[str], reference: Reference, rejects_path: str | os.PathLike[str] | None = None
) -> VariantSet:
    """Read a VCF/BCF file's SNVs, MNVs and indels, one :class:`Variant` per ALT, normalised.

    Multi-allelic records are split per ALT (each keeps its record index and 1-based allele
    index); each allele is left-aligned and trimmed (:func:`normalize`), so that equivalent
    representations (a left- or right-shifted indel, a padded one, a multi-allelic record or its
    split records) give equal variants. ALT equal to REF is kept unchanged (``alt == ref``).
    Skipped alleles are counted per reason (:data:`REJECT_REASONS`) and, with ``rejects_path``,
    listed one per line. Input order does not matter (the variants are sorted in memory).

    Args:
        vcf_path: VCF (plain, gzip or bgzip) or BCF.
        reference: the FASTA the variants were called against (:meth:`Reference.open`).
        rejects_path: where to write the skipped alleles as TSV (``record`` 0-based, ``chrom``,
            ``pos`` as written, ``id``, ``ref``, ``alt``, ``reason``; a header line; written whole
            or not at all); default None: counted only.

    Returns:
        The :class:`VariantSet`.

    Raises:
        InputError: a missing, header-less, truncated or malformed file; a record without REF; a
            contig absent from the reference, a header contig length or a REF end that does not
            fit it (all signs of another build). The message names the file and the fix.
    """
    path = Path(vcf_path)
    records, header = _read_records(path)
    _check_contigs(path, reference, records, header)
    order = {name: i for i, name in enumerate(reference.names)}
    variants: list[Variant] = []
    rejected: list[tuple[_Record, str, str]] = []
    for record in records:
        pos0 = record.pos - 1
        ref_ok = _ACGT.fullmatch(record.ref) is not None
        matches: bool | None = None  # REF against the reference, looked up once per record
        for allele, alt in enumerate(record.alts, 1):
            reason = _classify(alt) or (None if ref_ok else "not_acgt")
            if reason is None:
                if matches is None:
                    matches = reference.fetch(record.chrom, pos0, pos0 + len(record.ref)).upper() == record.ref.upper()
                reason = None if matches else "ref_mismatch"
            if reason is None:
                pos, ref, norm_alt = normalize(reference, record.chrom, pos0, record.ref, alt)
                if not (_ACGT.fullmatch(ref) and _ACGT.fullmatch(norm_alt)):
                    reason = "reference_n"
                else:
                    variants.append(
                        Variant(
                            record.chrom,
                            pos,
                            ref,
                            norm_alt,
                            record.index,
                            allele,
                            record.id,
                            record.pos,
                            record.ref,
                            alt,
                        )
                    )
                    continue
            rejected.append((record, alt, reason))
    variants.sort(key=lambda v: (order[v.contig], v.pos, v.record, v.allele))
    if rejects_path is not None:
        _write_rejects(Path(rejects_path), rejected)
    counts = Counter(reason for _, _, reason in rejected)
    return VariantSet(
        variants=variants, rejects={r: counts[r] for r in REJECT_REASONS if counts[r]}, records=len(records)
    )


def _write_rejects(path: Path, rejected: list[tuple[_Record, str, str]]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w") as out:
            out.write(_REJECTS_HEADER)
            for record, alt, reason in rejected:
                out.write(f"{record.index}\t{record.chrom}\t{record.pos}\t{record.id}\t{record.ref}\t{alt}\t{reason}\n")

    replace_file(path, write)


# ------------------------------------------------------------------------------------------------
# Writing

_INFO_ID = re.compile(r"[A-Za-z_][0-9A-Za-z_.]*")
#: positions from 2^29 on do not fit a .tbi (tabix's default binning); a .csi then
_TBI_MAX_POS = 1 << 29


def _format_float(value: float | None) -> str:
    """Shortest text that reads back as the same float32 (VCF Type=Float); '.' for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "."
    text = str(np.float32(value))
    return {"inf": "Inf", "-inf": "-Inf"}.get(text, text)


def _escape(description: str) -> str:
    """A Description without the characters readers trip on: htslib keeps a backslash-escaped quote
    as written, so double quotes become single ones (and line breaks spaces)."""
    return " ".join(description.replace('"', "'").split())


def _text_lines(path: Path) -> Iterator[str]:
    """The VCF text of ``path``, line by line (newline kept): a VCF as written, a BCF as htslib
    formats it."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        with gzip.open(path, "rb") as check:
            if check.read(3) == b"BCF":
                yield from _bcf_lines(path)
                return
    elif magic == b"BC":
        yield from _bcf_lines(path)
        return
    opener: Any = gzip.open if magic == b"\x1f\x8b" else open
    try:
        with opener(path, "rt", newline="") as handle:
            yield from handle
    except (EOFError, OSError, zlib.error) as exc:
        raise InputError(f"{path}: the file is truncated or damaged ({exc}); {_FIX_BGZIP}") from None


def _bcf_lines(path: Path) -> Iterator[str]:
    with htslib_messages() as said, _open_vcf(path) as vcf:
        lines = str(vcf.header).splitlines(keepends=True) + [str(rec) for rec in vcf]
    report(said, str(path))
    yield from lines


@dataclass(frozen=True)
class AnnotatedVCF:
    """What :func:`write_annotated_vcf` wrote.

    Attributes:
        path: the VCF.
        index: its ``.tbi`` / ``.csi``, or None (a plain ``.vcf``).
        sorted: True when the input's records were out of order and the copy was sorted (by the
            header's ``##contig`` order, then first appearance, then POS; input order among equals).
    """

    path: Path
    index: Path | None
    sorted: bool


def write_annotated_vcf(
    input_vcf: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    values: Mapping[tuple[int, int], Mapping[str, float]],
    fields: Mapping[str, str],
    types: Mapping[str, str] | None = None,
    header: Iterable[str] = (),
) -> AnnotatedVCF:
    """Write a copy of ``input_vcf`` with per-ALT INFO fields added (e.g. the variant scores).

    The records keep their text (a VCF's is copied; a BCF is written as VCF text); each gets every
    field of ``fields`` (``Number=A``), one value per ALT: ``values[(record, allele)][field]``
    (``record`` 0-based in file order, ``allele`` 1-based, as in :class:`Variant`), ``.`` where
    missing (or NaN). A record with ALT ``.`` gets none. ``Float`` values are written as the
    shortest text that reads back as the same float32, ``Integer`` ones as integers.

    ``out_path`` ending in ``.vcf``: plain text, in input order. Ending in ``.vcf.gz`` or
    ``.vcf.bgz``: bgzip with a tabix index (``.tbi``; ``.csi`` past 2^29 bases); records out of
    order (a contig in two blocks, or POS decreasing) are sorted for the copy so that it can be
    indexed (see :class:`AnnotatedVCF`). Written in a temporary directory beside ``out_path`` and
    renamed into place.

    Args:
        input_vcf: the VCF/BCF the values belong to (the one :func:`read_variants` read).
        out_path: the output file.
        values: per ``(record, allele)``, a value per field name (absent fields: missing).
        fields: INFO field name -> description (the header's ``Description``), in output order.
        types: INFO field name -> ``Float`` (the default for a field not named) or ``Integer``.
        header: meta-information lines (``##key=value``, no newline) added before ``#CHROM``
            (e.g. provenance); default none.

    Returns:
        The :class:`AnnotatedVCF`.

    Raises:
        InputError: a field the input already defines (remove it first), an out_path that is not
            ``.vcf``/``.vcf.gz``/``.vcf.bgz``, or an unreadable input.
        ValueError: a field name that is not a valid INFO ID, a type other than Float/Integer, a
            header line not starting with ``##``, or a ``values`` key that names no (record, ALT)
            of the input.
    """
    source, out = Path(input_vcf), Path(out_path)
    if out.name.endswith(".vcf"):
        compressed = False
    elif out.name.endswith((".vcf.gz", ".vcf.bgz")):
        compressed = True
    else:
        raise InputError(f"{out}: name the annotated VCF *.vcf (plain) or *.vcf.gz (bgzip and indexed)")
    types = {name: (types or {}).get(name, "Float") for name in fields}
    for name in fields:
        if not _INFO_ID.fullmatch(name):
            raise ValueError(f"INFO field name {name!r} is not a valid VCF ID ([A-Za-z_][0-9A-Za-z_.]*)")
        if types[name] not in ("Float", "Integer"):
            raise ValueError(f"INFO field {name}: type {types[name]!r} is neither Float nor Integer")
    extra = list(header)
    for line in extra:
        if not line.startswith("##") or "\n" in line:
            raise ValueError(f"a VCF header line starts with '##' and is one line, got {line!r}")
    work = unique_sibling(out, "tmp")
    work.mkdir()
    try:
        with writing(out, work=work):
            written = work / out.name
            sorted_, max_pos = _write_annotated(source, written, compressed, values, fields, types, extra)
            index: Path | None = None
            if compressed:
                import pysam

                csi = max_pos >= _TBI_MAX_POS
                with htslib_messages() as said:
                    pysam.tabix_index(str(written), preset="vcf", csi=csi, force=True)
                report(said, str(out))
                index = Path(f"{written}.{'csi' if csi else 'tbi'}")
            for suffix in (".tbi", ".csi"):  # an old index must not describe the new file
                Path(f"{out}{suffix}").unlink(missing_ok=True)
            os.replace(written, out)
            if index is not None:
                index = Path(f"{out}{index.suffix}")
                os.replace(Path(f"{written}{index.suffix}"), index)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return AnnotatedVCF(out, index, sorted_)


def _format_value(value: float | None, type_: str) -> str:
    if type_ == "Integer":
        return "." if value is None or (isinstance(value, float) and math.isnan(value)) else str(int(value))
    return _format_float(value)


def _write_annotated(
    source: Path,
    dest: Path,
    compressed: bool,
    values: Mapping[tuple[int, int], Mapping[str, float]],
    fields: Mapping[str, str],
    types: Mapping[str, str],
    extra: list[str],
) -> tuple[bool, int]:
    """Copy ``source`` to ``dest`` with the INFO fields and header lines added; with ``compressed``
    the records are sorted if they are out of order. Returns (sorted here, largest POS)."""
    import pysam

    names = list(fields)
    used: set[tuple[int, int]] = set()
    record = -1
    seen: dict[str, int] = {}  # contig -> first appearance
    declared: dict[str, int] = {}  # contig -> place among the header's ##contig lines
    last: tuple[str, int] = ("", -1)
    in_order, max_pos = True, 0
    head: list[str] = []
    body: list[tuple[str, int, str]] = []  # (contig, POS, line)
    for line in _text_lines(source):
        if line.startswith("##"):
            match = re.match(r"##INFO=<ID=([^,>]+)", line)
            if match and match.group(1) in fields:
                raise InputError(
                    f"{source}: already has INFO/{match.group(1)} (scored before?); give the unscored VCF "
                    f"or remove the field with `bcftools annotate -x INFO/{match.group(1)}`"
                )
            contig = re.match(r"##contig=<ID=([^,>]+)", line)
            if contig:
                declared.setdefault(contig.group(1), len(declared))
            head.append(line)
            continue
        if line.startswith("#"):
            for name in names:
                head.append(f'##INFO=<ID={name},Number=A,Type={types[name]},Description="{_escape(fields[name])}">\n')
            head.extend(f"{x}\n" for x in extra)
            head.append(line)
            continue
        if not line.strip():
            continue
        record += 1
        text = line.rstrip("\r\n")
        ending = line[len(text) :] or "\n"
        cols = text.split("\t", 8)
        if len(cols) < 8:
            raise InputError(
                f"{source}: record {record + 1} has {len(cols)} columns, a VCF record needs 8 or more; "
                f"check it with `bcftools view {source} > /dev/null`"
            )
        chrom, pos = cols[0], int(cols[1])
        if chrom != last[0]:
            in_order = in_order and chrom not in seen
            seen.setdefault(chrom, len(seen))
        elif pos < last[1]:
            in_order = False
        last = (chrom, pos)
        max_pos = max(max_pos, pos)
        if cols[4] != "." and names:
            alleles = range(1, cols[4].count(",") + 2)
            entries = []
            for name in names:
                got = []
                for allele in alleles:
                    per = values.get((record, allele))
                    if per is not None:
                        used.add((record, allele))
                    got.append(_format_value(per.get(name) if per is not None else None, types[name]))
                entries.append(f"{name}={','.join(got)}")
            added = ";".join(entries)
            cols[7] = added if cols[7] in (".", "") else f"{cols[7]};{added}"
        body.append((chrom, pos, "\t".join(cols) + ending))
    stray = set(values) - used
    if stray:
        first = min(stray)
        raise ValueError(
            f"values for (record {first[0]}, allele {first[1]}) match no ALT of {source} "
            f"({record + 1} records): values from another VCF?"
        )
    resort = compressed and not in_order
    if resort:  # an index needs each contig in one block, POS non-decreasing: the header's order, then first seen
        rank = {c: declared.get(c, len(declared) + seen[c]) for c in seen}
        body.sort(key=lambda entry: (rank[entry[0]], entry[1]))  # stable: input order among equals
    out: IO[bytes] = pysam.BGZFile(str(dest), "wb") if compressed else open(dest, "wb")  # type: ignore[assignment]
    try:
        out.write("".join(head).encode())
        for _, _, text in body:
            out.write(text.encode())
    finally:
        out.close()
    return resort, max_pos

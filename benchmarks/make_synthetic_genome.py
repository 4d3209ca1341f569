#!/usr/bin/env python
"""Write a synthetic, hg38-like FASTA quickly and deterministically (for benchmarks and tests).

The output looks like a UCSC assembly to a FASTA reader: records ``chr1, chr2, ...`` in UCSC
order, 60-column lines, uppercase N runs (10 kb telomeres at both ends, a centromere gap of a few
Mb, some 50 kb contig gaps and some 100 bp scaffold gaps), about half of the bases soft-masked
(lowercase runs of a few hundred to a few thousand bases: mutated copies of interspersed repeat
families and microsatellites), GC about 41% (with isochore-like variation and CpG depletion) and a
handful of IUPAC ambiguity codes. It compresses roughly like real DNA in gzip (a little over
2 bits per base).

Layouts (``--layout``):

- ``hg38`` (default): real hg38 chromosome lengths in UCSC order, the last record truncated so
  the total is ``--mbp``. 500 Mbp gives chr1 (248.96 Mbp), chr2 (242.19 Mbp) and chr3 (8.85 Mbp).
- ``scaled``: chr1..chr22, chrX, chrY, every length scaled from hg38 to a total of ``--mbp``.
- ``--chrom-mbp X`` overrides both: one record ``chr1`` of X Mbp (for memory benchmarks).
- ``--records chr1=250,chr22=1`` overrides all: exactly these records (sizes in Mbp).

The genome is never held in memory: each record is generated and written in blocks of
~3.9 Mbp, compressed by python-isal (gzip; level 1 by default) on a second thread, or written as
BGZF (bgzip-compatible blocks compressed with isal on a thread pool) together with ``.fai`` and
``.gzi`` indexes, or as plain text with a ``.fai``. The output is first written under a temporary
name and renamed at the end, so a file at ``--out`` is always complete.

Example::

    python benchmarks/make_synthetic_genome.py --out /tmp/genolong-bench/syn500.fa.gz --mbp 500
    python benchmarks/make_synthetic_genome.py --out /tmp/x.fa.gz --format bgzip --mbp 50
    python benchmarks/make_synthetic_genome.py --out /tmp/chr1_250.fa.gz --chrom-mbp 250
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))  # benchmarks/_bench.py, also when a test imports this script
from _bench import write_json  # noqa: E402

# hg38 primary chromosome lengths (UCSC order; chrM left out).
HG38_LENGTHS: dict[str, int] = {
    "chr1": 248_956_422,
    "chr2": 242_193_529,
    "chr3": 198_295_559,
    "chr4": 190_214_555,
    "chr5": 181_538_259,
    "chr6": 170_805_979,
    "chr7": 159_345_973,
    "chr8": 145_138_636,
    "chr9": 138_394_717,
    "chr10": 133_797_422,
    "chr11": 135_086_622,
    "chr12": 133_275_309,
    "chr13": 114_364_328,
    "chr14": 107_043_718,
    "chr15": 101_991_189,
    "chr16": 90_338_345,
    "chr17": 83_257_441,
    "chr18": 80_373_285,
    "chr19": 58_617_616,
    "chr20": 64_444_167,
    "chr21": 46_709_983,
    "chr22": 50_818_468,
    "chrX": 156_040_895,
    "chrY": 57_227_415,
}
# Extra small records of a UCSC hg38 file (--with-extras): chrM and a few unplaced/random contigs.
EXTRAS: dict[str, int] = {
    "chrM": 16_569,
    "chr1_KI270706v1_random": 175_055,
    "chrUn_KI270302v1": 2_274,
    "chrUn_GL000220v1": 161_802,
}

BLOCK_LINES = 1 << 16  # lines per generation block (block = 60 * 65536 = 3,932,160 bases)
BGZF_BLOCK = 0xFF00  # uncompressed bytes per BGZF block, as bgzip writes them
BGZF_EOF = bytes.fromhex("1f8b08040000000000ff0600424302001b0003000000000000000000")
IUPAC = np.frombuffer(b"RYKMSWBDHV", dtype=np.uint8)


def _uint8(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8)


@dataclass
class Stats:
    """Counts accumulated while writing (over all records)."""

    records: list[tuple[str, int]] = field(default_factory=list)
    bases: int = 0
    n_bases: int = 0
    lower: int = 0
    gc: int = 0
    iupac: int = 0
    gaps: int = 0


# --------------------------------------------------------------------------------------------
# Layout: record lengths, gaps, soft-masked intervals
# --------------------------------------------------------------------------------------------


def parse_records(spec: str) -> list[tuple[str, float]]:
    """``"chr1=250,chr22=1"`` -> ``[("chr1", 250.0), ("chr22", 1.0)]`` (sizes in Mbp)."""
    out = []
    for item in spec.split(","):
        name, sep, size = item.strip().partition("=")
        try:
            mbp = float(size)
        except ValueError:
            mbp = -1.0
        if not sep or not name or mbp <= 0:
            raise ValueError(f"--records: cannot read {item!r}; write NAME=MBP[,NAME=MBP...], e.g. chr1=250,chr22=1")
        out.append((name, mbp))
    return out


def record_lengths(
    mbp: float, layout: str, chrom_mbp: float | None, extras: bool, records: list[tuple[str, float]] | None = None
) -> list[tuple[str, int]]:
    """Return ``[(name, length), ...]`` for the requested size and layout (``records`` wins)."""
    if records:
        recs = [(n, int(round(m * 1e6))) for n, m in records]
    elif chrom_mbp is not None:
        recs = [("chr1", int(round(chrom_mbp * 1e6)))]
    else:
        total = int(round(mbp * 1e6))
        if layout == "scaled":
            full = sum(HG38_LENGTHS.values())
            recs = [(n, max(1000, int(round(l * total / full)))) for n, l in HG38_LENGTHS.items()]
        elif layout == "hg38":
            recs, left = [], total
            for n, l in HG38_LENGTHS.items():
                if left <= 0:
                    break
                take = min(l, left)
                if take < 100_000 and recs:  # a tiny tail record is useless: add it to the last
                    name, prev = recs[-1]
                    recs[-1] = (name, prev + take)
                else:
                    recs.append((n, take))
                left -= take
        else:
            raise ValueError(f"unknown layout {layout!r}: use hg38 or scaled")
    if extras:
        recs += list(EXTRAS.items())
    for name, length in recs:
        if length < 1000:
            raise ValueError(f"record {name} would be {length} bp; ask for a larger --mbp")
    return recs


def gap_layout(length: int, rng: np.random.Generator, small: bool) -> np.ndarray:
    """N runs of one record as a sorted ``[k, 2]`` array of ``[start, end)``.

    Telomeres (10 kb) at both ends, one centromere gap of 2-4 Mb (at most 5% of the record), about
    one 50 kb gap per 25 Mbp and one 100 bp gap per 5 Mbp, none overlapping. ``small`` records
    (chrM-like extras) get no gaps.
    """
    if small:
        return np.zeros((0, 2), dtype=np.int64)
    tel = min(10_000, length // 20)
    gaps = [(0, tel), (length - tel, length)]
    cen_len = int(min(rng.uniform(2e6, 4e6), 0.05 * length))
    cen_start = int(rng.uniform(0.3, 0.5) * length)
    gaps.append((cen_start, cen_start + cen_len))
    n50 = max(1, int(round(length / 25e6)))
    n100 = max(2, int(round(length / 5e6)))
    lens = [50_000] * n50 + [100] * n100
    for glen in lens:
        for _ in range(20):  # rejection sampling; gives up quietly on a crowded record
            s = int(rng.integers(tel + 1000, max(tel + 1001, length - tel - glen - 1000)))
            e = s + glen
            if all(e + 1000 <= a or s >= b + 1000 for a, b in gaps):
                gaps.append((s, e))
                break
    arr = np.array(sorted(gaps), dtype=np.int64)
    return arr[arr[:, 1] > arr[:, 0]]


def mask_layout(length: int, rng: np.random.Generator) -> np.ndarray:
    """Soft-masked (lowercase) intervals of one record: ``[k, 2]`` sorted, disjoint ``[start, end)``.

    Alternating renewal process: masked runs log-normal (median 400 bp, 20-8000 bp), unmasked runs
    exponential (mean 600 bp); about half of the sequence ends up masked.
    """
    n = int(length / 1100 * 1.2) + 16
    masked = np.clip(rng.lognormal(np.log(400.0), 0.9, n), 20, 8000).astype(np.int64)
    unmasked = (rng.exponential(600.0, n) + 1).astype(np.int64)
    starts = np.cumsum(unmasked + np.concatenate([[0], masked[:-1]]))
    ends = starts + masked
    keep = starts < length
    return np.stack([starts[keep], np.minimum(ends[keep], length)], axis=1)


# --------------------------------------------------------------------------------------------
# Sequence content
# --------------------------------------------------------------------------------------------


@dataclass
class RepeatLibrary:
    """Consensus sequences of repeat families, concatenated (uint8 ACGT)."""

    seq: np.ndarray  # [total] uint8
    start: np.ndarray  # [F] offset of each family in seq
    length: np.ndarray  # [F] family length
    weight: np.ndarray  # [F] probability of picking the family for a masked run
    microsat: np.ndarray  # [F] bool: tandem repeat of a short unit


def make_library(rng: np.random.Generator) -> RepeatLibrary:
    """40 interspersed families (300 bp to 6.5 kb, GC 38-52%) and 10 microsatellite units."""
    acgt = _uint8("ACGT")
    units = ["A", "CA", "TA", "GA", "AAT", "CAG", "AAAT", "GGAA", "AATGG", "TTAGGG"]
    seqs, micro, weights = [], [], []
    for i in range(40):
        flen = int(300 if i < 6 else rng.integers(300, 6500))
        gc = rng.uniform(0.38, 0.52)
        p = np.array([(1 - gc) / 2, gc / 2, gc / 2, (1 - gc) / 2])
        seqs.append(acgt[rng.choice(4, size=flen, p=p)])
        micro.append(False)
        weights.append(3.0 if i < 6 else 1.0)  # Alu-like families are the most common
    for u in units:
        seqs.append(_uint8(u))
        micro.append(True)
        weights.append(1.2)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    w = np.array(weights)
    return RepeatLibrary(
        seq=np.concatenate(seqs),
        start=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        length=lengths,
        weight=w / w.sum(),
        microsat=np.array(micro),
    )


# ASCII: A=65 C=67 G=71 T=84; lowercase = | 0x20.
_A, _C, _G, _T, _N = 65, 67, 71, 84, 78
_AT = np.array([_A, _T], dtype=np.uint8)
_CG = np.array([_C, _G], dtype=np.uint8)
_COMPLEMENT = np.arange(256, dtype=np.uint8)
_COMPLEMENT[[_A, _C, _G, _T]] = [_T, _G, _C, _A]


def background(n: int, gc: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``n`` random bases, GC fraction ``gc`` (per base, float32) -> [n] uint8 uppercase."""
    r = rng.random(n, dtype=np.float32)
    bit = rng.integers(0, 2, size=n, dtype=np.uint8)
    return np.where(r < gc, _CG[bit], _AT[bit])


def make_block(
    b0: int,
    b1: int,
    gaps: np.ndarray,
    masks: np.ndarray,
    mask_family: np.ndarray,
    mask_offset: np.ndarray,
    mask_div: np.ndarray,
    mask_minus: np.ndarray,
    iupac_pos: np.ndarray,
    iupac_code: np.ndarray,
    lib: RepeatLibrary,
    rng: np.random.Generator,
) -> np.ndarray:
    """Bases ``[b0, b1)`` of one record -> [b1 - b0] uint8 ASCII."""
    n = b1 - b0
    # Isochore-like GC: one level per 100 kb region (aligned to record coordinates).
    r0, r1 = b0 // 100_000, (b1 - 1) // 100_000 + 1
    region_gc = (0.415 + 0.05 * np.sin(np.arange(r0, r1) * 0.7) * np.cos(np.arange(r0, r1) * 0.13)).astype(np.float32)
    pos = np.arange(b0, b1, dtype=np.int64)
    seq = background(n, region_gc[pos // 100_000 - r0], rng)
    # CpG depletion: three quarters of CG dinucleotides become TG or CA (deamination).
    cg = np.flatnonzero((seq[:-1] == _C) & (seq[1:] == _G))
    u = rng.random(cg.size)
    seq[cg[u < 0.375]] = _T
    seq[cg[(u >= 0.375) & (u < 0.75)] + 1] = _A

    # Soft-masked runs overlapping the block: copy (mutated) repeat consensus, lowercase.
    i0 = np.searchsorted(masks[:, 1], b0, side="right")
    i1 = np.searchsorted(masks[:, 0], b1, side="left")
    if i1 > i0:
        m = masks[i0:i1]
        s = np.maximum(m[:, 0], b0) - b0
        e = np.minimum(m[:, 1], b1) - b0
        lens = e - s
        ids = np.repeat(np.arange(i0, i1), lens)
        run_start = np.repeat(s, lens)
        idx = np.arange(lens.sum(), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens) + run_start
        # Offset within the family counted from the start of the whole run (not the block).
        within = idx + b0 - masks[ids, 0] + mask_offset[ids]
        fam = mask_family[ids]
        flen = lib.length[fam]
        w = within % flen
        minus = mask_minus[ids]
        # Copies on the minus strand read the consensus backwards, complemented.
        src = lib.start[fam] + np.where(minus, flen - 1 - w, w)
        rep = lib.seq[src]
        rep[minus] = _COMPLEMENT[rep[minus]]
        mutate = rng.random(rep.size, dtype=np.float32) < mask_div[ids]
        nm = int(mutate.sum())
        rep[mutate] = _uint8("ACGT")[rng.integers(0, 4, nm)]
        seq[idx] = rep | 0x20

    # N runs override everything (uppercase N, as in UCSC files).
    j0 = np.searchsorted(gaps[:, 1], b0, side="right")
    j1 = np.searchsorted(gaps[:, 0], b1, side="left")
    for gs, ge in gaps[j0:j1]:
        seq[max(gs, b0) - b0 : min(ge, b1) - b0] = _N
    k = (iupac_pos >= b0) & (iupac_pos < b1)
    seq[iupac_pos[k] - b0] = iupac_code[k]
    return seq


def to_lines(seq: np.ndarray, width: int) -> bytes:
    """[n] uint8 -> FASTA text with a newline every ``width`` bases (and after the last)."""
    n = seq.size
    full = n // width
    parts = []
    if full:
        body = np.empty((full, width + 1), dtype=np.uint8)
        body[:, :width] = seq[: full * width].reshape(full, width)
        body[:, width] = 10
        parts.append(body.tobytes())
    if n % width:
        parts.append(seq[full * width :].tobytes() + b"\n")
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------


class GzipWriter:
    """Single-member gzip stream compressed by isal on a background thread."""

    def __init__(self, path: Path, level: int, threads: int):
        from isal import igzip_threaded

        self._fh = igzip_threaded.open(path, "wb", compresslevel=level, threads=threads, block_size=1 << 20)

    def write(self, data: bytes) -> None:
        self._fh.write(data)

    def close(self) -> None:
        self._fh.close()


class PlainWriter:
    """Uncompressed text."""

    def __init__(self, path: Path):
        self._fh = open(path, "wb", buffering=1 << 22)

    def write(self, data: bytes) -> None:
        self._fh.write(data)

    def close(self) -> None:
        self._fh.close()


def _bgzf_block(data: bytes, level: int) -> bytes:
    from isal import isal_zlib

    comp = isal_zlib.compress(data, level, wbits=-15)
    if len(comp) + 26 > 65536:  # incompressible: store (level 0) so the block stays <= 64 KiB
        comp = isal_zlib.compress(data, 0, wbits=-15)
    header = b"\x1f\x8b\x08\x04\x00\x00\x00\x00\x00\xff\x06\x00BC\x02\x00" + struct.pack("<H", len(comp) + 25)
    return header + comp + struct.pack("<II", isal_zlib.crc32(data) & 0xFFFFFFFF, len(data))


class BgzfWriter:
    """BGZF (bgzip) output: 0xff00-byte blocks compressed with isal on a thread pool, + ``.gzi``."""

    def __init__(self, path: Path, level: int, threads: int):
        self._fh = open(path, "wb")
        self._level = max(1, level)
        self._pool = ThreadPoolExecutor(max(1, threads))
        self._buf = bytearray()
        self._pending = None
        self._coff = 0  # compressed offset of the next block
        self._uoff = 0  # uncompressed offset of the next block
        self.gzi: list[tuple[int, int]] = []

    def _submit(self, final: bool) -> None:
        nblk = len(self._buf) // BGZF_BLOCK if not final else -(-len(self._buf) // BGZF_BLOCK)
        if nblk == 0:
            return
        chunks = [bytes(self._buf[i * BGZF_BLOCK : (i + 1) * BGZF_BLOCK]) for i in range(nblk)]
        del self._buf[: nblk * BGZF_BLOCK]
        fut = [self._pool.submit(_bgzf_block, c, self._level) for c in chunks]
        self._drain()  # write the previous batch while this one compresses
        self._pending = (fut, [len(c) for c in chunks])

    def _drain(self) -> None:
        if self._pending is None:
            return
        fut, ulens = self._pending
        for f, ulen in zip(fut, ulens):
            blk = f.result()
            if self._uoff:  # .gzi lists every block start except the first
                self.gzi.append((self._coff, self._uoff))
            self._fh.write(blk)
            self._coff += len(blk)
            self._uoff += ulen
        self._pending = None

    def write(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= 64 * BGZF_BLOCK:
            self._submit(final=False)

    def close(self) -> None:
        self._submit(final=True)
        self._drain()
        self._fh.write(BGZF_EOF)
        self._fh.close()
        self._pool.shutdown()

    def write_gzi(self, path: Path) -> None:
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(self.gzi)))
            for c, u in self.gzi:
                fh.write(struct.pack("<QQ", c, u))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def generate(
    out: Path,
    mbp: float = 500.0,
    seed: int = 0,
    fmt: str = "gzip",
    line_width: int = 60,
    layout: str = "hg38",
    chrom_mbp: float | None = None,
    extras: bool = False,
    level: int = 1,
    threads: int = 1,
    quiet: bool = False,
    records: list[tuple[str, float]] | None = None,
) -> dict:
    """Write the synthetic FASTA to ``out`` (+ indexes); return a summary dict (also printed)."""
    t0 = time.perf_counter()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recs = record_lengths(mbp, layout, chrom_mbp, extras, records)
    lib = make_library(np.random.default_rng([seed, 1_000_003]))
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    if fmt == "gzip":
        writer = GzipWriter(tmp, level, threads)
    elif fmt == "bgzip":
        writer = BgzfWriter(tmp, level, max(1, threads + 1))
    elif fmt == "plain":
        writer = PlainWriter(tmp)
    else:
        raise ValueError(f"unknown format {fmt!r}: use gzip, bgzip or plain")

    stats = Stats()
    fai_lines = []
    uoff = 0
    block = BLOCK_LINES * line_width
    try:
        for ri, (name, length) in enumerate(recs):
            rng = np.random.default_rng([seed, ri])
            small = name in EXTRAS
            gaps = gap_layout(length, rng, small)
            masks = mask_layout(length, rng)
            nm = len(masks)
            fam = rng.choice(len(lib.length), size=nm, p=lib.weight)
            offset = rng.integers(0, 1 << 30, size=nm) % lib.length[fam]
            minus = rng.random(nm) < 0.5
            div = np.where(lib.microsat[fam], rng.uniform(0.0, 0.05, nm), rng.uniform(0.02, 0.25, nm)).astype(
                np.float32
            )
            # A handful of IUPAC codes (one per ~50 Mbp, at least 2), never inside a gap.
            niu = 0 if small else max(2, length // 50_000_000)
            cand = rng.integers(0, length, size=4 * niu + 8)
            in_gap = np.zeros(cand.size, dtype=bool)
            for gs, ge in gaps:
                in_gap |= (cand >= gs) & (cand < ge)
            iupac_pos = np.sort(cand[~in_gap][:niu])
            iupac_code = IUPAC[rng.integers(0, IUPAC.size, iupac_pos.size)]

            header = f">{name}\n".encode()
            writer.write(header)
            uoff += len(header)
            fai_lines.append(f"{name}\t{length}\t{uoff}\t{line_width}\t{line_width + 1}\n")
            for bi, b0 in enumerate(range(0, length, block)):
                b1 = min(length, b0 + block)
                brng = np.random.default_rng([seed, ri, bi + 1])
                seq = make_block(b0, b1, gaps, masks, fam, offset, div, minus, iupac_pos, iupac_code, lib, brng)
                text = to_lines(seq, line_width)
                writer.write(text)
                uoff += len(text)
                stats.n_bases += int(np.count_nonzero(seq == _N))
                stats.lower += int(np.count_nonzero(seq >= 97))
                upper = seq & 0xDF
                stats.gc += int(np.count_nonzero((upper == _C) | (upper == _G)))
            stats.records.append((name, length))
            stats.bases += length
            stats.iupac += int(iupac_pos.size)
            stats.gaps += len(gaps)
        writer.close()
        if fmt == "bgzip":
            writer.write_gzi(Path(str(tmp) + ".gzi"))
        if fmt in ("bgzip", "plain"):
            Path(str(tmp) + ".fai").write_text("".join(fai_lines))
    except BaseException:
        for p in (tmp, Path(str(tmp) + ".gzi"), Path(str(tmp) + ".fai")):
            p.unlink(missing_ok=True)
        raise
    # Indexes first, the FASTA last: a present FASTA implies present indexes.
    for ext in (".fai", ".gzi"):
        if Path(str(tmp) + ext).exists():
            os.replace(str(tmp) + ext, str(out) + ext)
        elif Path(str(out) + ext).exists():
            Path(str(out) + ext).unlink()
    os.replace(tmp, out)
    secs = time.perf_counter() - t0
    acgt = stats.bases - stats.n_bases
    size = out.stat().st_size
    summary = {
        "path": str(out),
        "format": fmt,
        "seed": seed,
        "layout": "records" if records else "single" if chrom_mbp is not None else layout,
        "line_width": line_width,
        "records": [{"name": n, "length": l} for n, l in stats.records],
        "bases": stats.bases,
        "n_bases": stats.n_bases,
        "gaps": stats.gaps,
        "iupac": stats.iupac,
        "lowercase_fraction_of_non_n": stats.lower / max(1, acgt),
        "gc_fraction_of_non_n": stats.gc / max(1, acgt),
        "file_bytes": size,
        "uncompressed_bytes": uoff,
        "bits_per_non_n_base": 8 * size / max(1, acgt),
        "seconds": secs,
    }
    if not quiet:
        names = [n for n, _ in stats.records]
        shown = ", ".join(f"{n}={l:,}" for n, l in stats.records[:6]) + (" ..." if len(names) > 6 else "")
        print(f"wrote {out} ({fmt}) in {secs:.1f} s")
        print(f"  records   {len(names)}: {shown}")
        print(f"  bases     {stats.bases:,} ({stats.n_bases:,} N in {stats.gaps} gaps, {stats.iupac} IUPAC)")
        print(
            f"  lowercase {summary['lowercase_fraction_of_non_n']:.3f} of non-N; GC {summary['gc_fraction_of_non_n']:.3f}"
        )
        print(
            f"  file      {size / 1e6:.1f} MB ({summary['bits_per_non_n_base']:.2f} bits per non-N base); "
            f"{stats.bases / 1e6 / secs:.0f} Mbp/s"
        )
        extra = [str(out) + e for e in (".fai", ".gzi") if Path(str(out) + e).exists()]
        if extra:
            print(f"  indexes   {', '.join(extra)}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, type=Path, help="output FASTA path (e.g. syn.fa.gz)")
    p.add_argument("--mbp", type=float, default=500.0, help="total size in Mbp (default 500)")
    p.add_argument("--chrom-mbp", type=float, default=None, help="instead: one record chr1 of this many Mbp")
    p.add_argument(
        "--records", default=None, metavar="NAME=MBP,...", help="instead: exactly these records, e.g. chr1=250,chr22=1"
    )
    p.add_argument(
        "--layout",
        choices=["hg38", "scaled"],
        default="hg38",
        help="hg38: real lengths in UCSC order, last one truncated (default); scaled: all 24 scaled",
    )
    p.add_argument("--with-extras", action="store_true", help="append chrM and a few chrUn/_random contigs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--format",
        choices=["gzip", "bgzip", "plain"],
        default="gzip",
        help="gzip (isal, one member), bgzip (+ .fai, .gzi) or plain (+ .fai)",
    )
    p.add_argument("--line-width", type=int, default=60)
    p.add_argument("--level", type=int, default=1, help="compression level (isal 0-3; default 1)")
    p.add_argument("--threads", type=int, default=1, help="compression threads (default 1, beside the generator)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary as JSON here")
    a = p.parse_args(argv)
    if a.line_width < 1:
        p.error("--line-width must be >= 1")
    try:
        records = parse_records(a.records) if a.records else None
        summary = generate(
            a.out,
            a.mbp,
            a.seed,
            a.format,
            a.line_width,
            a.layout,
            a.chrom_mbp,
            a.with_extras,
            a.level,
            a.threads,
            records=records,
        )
    except ValueError as e:
        p.error(str(e))
    if a.json:
        write_json(a.json, summary, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

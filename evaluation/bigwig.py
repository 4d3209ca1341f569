"""A bigWig writer whose zoom levels are computed exactly, with numpy.

Why genolong writes bigWig itself: both Python writers at hand get the zoom levels (the summaries a
browser, or ``pyBigWig.stats()``, reads when zoomed out) wrong for genolong's tracks.

- pyBigWig 0.3.29 (libBigWig ``addEntries``) stores a zoom record's sum when the next record
  begins: the last record of every zoom level and of every zoom block keeps ``sum = 0`` with its
  count, minimum and maximum set (a zoomed mean over a chromosome's last bases came out at half).
- pybigtools 0.3.0 (bigtools ``process_val_zoom``) moves back to the end of the last zoom record
  when a value starts past it, so an unscored stretch longer than a zoom bin (an N gap between two
  segments, bases outside ``--regions``) is filled with the next value, bases and all.

The file layout is the UCSC one (Kent et al. 2010, Bioinformatics 26:2204; version 4, as
``bedGraphToBigWig`` writes): header, zoom headers, total summary, chromosome B+ tree, the data
(zlib sections of at most :data:`ITEMS_PER_SLOT` items, one chromosome each) and its R tree, then
per zoom level its records (zlib blocks) and their R tree, and the magic number again at the end.
Values are float32. Zoom bins of level ``r`` are ``[k*r, (k+1)*r)`` of each chromosome; a record
spans its bin's first to last covered base and holds the bases covered, minimum, maximum and the
float64 sums (stored as float32) of value and value squared over them.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["BIGWIG_MAGIC", "ITEMS_PER_SLOT", "write_bigwig_file", "zoom_reductions"]

BIGWIG_MAGIC = 0x888FFC26
_CHROM_TREE_MAGIC = 0x78CA8C91
_RTREE_MAGIC = 0x2468ACE0
#: items (data values or zoom records) per zlib block, and R-tree fan-out (UCSC's defaults)
ITEMS_PER_SLOT = 1024
_BLOCK_SIZE = 256
_MAX_ZOOMS = 10


@dataclass
class _Block:
    """One compressed block: its chromosome range and where it lies in the file."""

    chrom: int
    start: int
    end: int
    offset: int = 0
    size: int = 0


def zoom_reductions(bin_size: int, max_size: int) -> list[int]:
    """Zoom levels (bases per zoom bin): ``bin_size * 10``, ``* 40``, ``* 160``, ... (as UCSC's
    ``bedGraphToBigWig`` starts at 10 items and steps by 4) while a bin is below the largest
    chromosome, at most 10; multiples of ``bin_size``, so a binned value never straddles two zoom
    bins."""
    out: list[int] = []
    r = bin_size * 10
    while r < max_size and len(out) < _MAX_ZOOMS:
        out.append(r)
        r *= 4
    return out


def _zoom_records(
    chrom: np.ndarray, start: np.ndarray, end: np.ndarray, value: np.ndarray, reduction: int
) -> np.ndarray:
    """The zoom records of one level: ``[m]`` structured (chrom, start, end, count, min, max, sum, sumsq).

    Args:
        chrom, start, end: ``[n]`` chromosome ids and 0-based half-open intervals, sorted, each
            inside one zoom bin (``reduction`` a multiple of the intervals' bin size).
        value: ``[n]`` float32.
    """
    zbin = start // reduction  # [n]
    first = np.r_[True, (chrom[1:] != chrom[:-1]) | (zbin[1:] != zbin[:-1])]
    rows = np.flatnonzero(first)  # [m]
    length = (end - start).astype(np.float64)
    v = value.astype(np.float64)
    records = np.zeros(rows.size, dtype=_ZOOM_DTYPE)
    records["chrom"] = chrom[rows]
    records["start"] = start[rows]
    records["end"] = np.maximum.reduceat(end, rows)
    records["count"] = np.add.reduceat(end - start, rows)
    records["min"] = np.minimum.reduceat(value, rows)
    records["max"] = np.maximum.reduceat(value, rows)
    records["sum"] = np.add.reduceat(length * v, rows)
    records["sumsq"] = np.add.reduceat(length * v * v, rows)
    return records


_ZOOM_DTYPE = np.dtype(
    [
        ("chrom", "<u4"),
        ("start", "<u4"),
        ("end", "<u4"),
        ("count", "<u4"),
        ("min", "<f4"),
        ("max", "<f4"),
        ("sum", "<f4"),
        ("sumsq", "<f4"),
    ]
)
_BEDGRAPH_DTYPE = np.dtype([("start", "<u4"), ("end", "<u4"), ("value", "<f4")])
_VARSTEP_DTYPE = np.dtype([("start", "<u4"), ("value", "<f4")])


def _slots(chrom: np.ndarray) -> list[tuple[int, int]]:
    """``(first, stop)`` row ranges of at most :data:`ITEMS_PER_SLOT` rows, one chromosome each."""
    cuts = np.flatnonzero(chrom[1:] != chrom[:-1]) + 1
    out: list[tuple[int, int]] = []
    for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, chrom.size].tolist()):
        out += [(s, min(s + ITEMS_PER_SLOT, b)) for s in range(a, b, ITEMS_PER_SLOT)]
    return out


def _write_rtree(f: io.BufferedWriter, blocks: list[_Block], end_of_data: int) -> None:
    """Write the R tree (UCSC "cirTree") over ``blocks`` at the file's position: its header, then
    its nodes from the root down, level by level (the leaves last).

    Level 0 groups the blocks ``_BLOCK_SIZE`` to a (leaf) node; level ``L + 1`` groups the nodes of
    level ``L``; the top level is one node, the root, right after the header (where readers look).
    """
    assert blocks, "an R tree over no block"
    spans = [[(b.chrom, b.start, b.chrom, b.end) for b in blocks]]  # spans[L][i]: item i of level L
    while len(spans[-1]) > _BLOCK_SIZE:
        below = spans[-1]
        spans.append(
            [
                (
                    below[i][0],
                    below[i][1],
                    below[min(i + _BLOCK_SIZE, len(below)) - 1][2],
                    below[min(i + _BLOCK_SIZE, len(below)) - 1][3],
                )
                for i in range(0, len(below), _BLOCK_SIZE)
            ]
        )
    f.write(
        struct.pack(
            "<IIQIIIIQII",
            _RTREE_MAGIC,
            _BLOCK_SIZE,
            len(blocks),
            blocks[0].chrom,
            blocks[0].start,
            blocks[-1].chrom,
            blocks[-1].end,
            end_of_data,
            ITEMS_PER_SLOT,
            0,
        )
    )
    top = len(spans) - 1
    offset = f.tell()
    node_offsets: dict[int, list[int]] = {}  # level -> file offset of each of its nodes
    for level in range(top, -1, -1):
        item_bytes = 32 if level == 0 else 24
        node_offsets[level] = []
        for k in range(0, len(spans[level]), _BLOCK_SIZE):
            node_offsets[level].append(offset)
            offset += 4 + item_bytes * min(_BLOCK_SIZE, len(spans[level]) - k)
    for level in range(top, -1, -1):
        items = spans[level]
        for k in range(0, len(items), _BLOCK_SIZE):
            chunk = items[k : k + _BLOCK_SIZE]
            f.write(struct.pack("<BBH", 1 if level == 0 else 0, 0, len(chunk)))
            for i, (c0, s0, c1, e1) in enumerate(chunk, k):
                if level == 0:
                    f.write(struct.pack("<IIIIQQ", c0, s0, c1, e1, blocks[i].offset, blocks[i].size))
                else:  # item i of level L spans node i of level L - 1
                    f.write(struct.pack("<IIIIQ", c0, s0, c1, e1, node_offsets[level - 1][i]))
    assert f.tell() == offset


def write_bigwig_file(
    path: str | os.PathLike[str],
    sizes: Mapping[str, int],
    contig: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    value: np.ndarray,
    bin_size: int = 1,
) -> None:
    """Write a bigWig file.

    Args:
        path: the file to write (replaced).
        sizes: chromosome name -> size, every chromosome of the header (sorted by name in bytes).
        contig: ``[n]`` chromosome names, the intervals sorted by (name in bytes, start), none
            overlapping, none empty (n >= 0).
        start, end: ``[n]`` int 0-based half-open intervals.
        value: ``[n]`` float32 values.
        bin_size: every interval lies inside ``[k*bin_size, (k+1)*bin_size)`` (1: one base each;
            a binned track's bin size): the zoom levels are multiples of it.

    Raises:
        ValueError: no interval (a bigWig holds at least one).
    """
    if not len(contig):
        raise ValueError("a bigWig needs at least one value")
    names = sorted(sizes, key=lambda name: name.encode())
    ids = {name: i for i, name in enumerate(names)}
    chrom = np.array([ids[c] for c in contig], np.uint32)
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    value = np.asarray(value, np.float32)
    per_base = bool(len(start)) and bool(np.all(end - start == 1))
    reductions = zoom_reductions(bin_size, max(sizes.values()))
    uncompressed = 0
    with open(path, "wb") as f:
        f.write(b"\0" * (64 + 24 * len(reductions)))  # header and zoom headers: filled in at the end
        summary_offset = f.tell()
        v = value.astype(np.float64)
        length = (end - start).astype(np.float64)
        f.write(
            struct.pack(
                "<Qdddd",
                int((end - start).sum()),
                float(value.min()),
                float(value.max()),
                float((length * v).sum()),
                float((length * v * v).sum()),
            )
        )
        # chromosome B+ tree: one leaf holding every chromosome (keys: names zero-padded, in byte order)
        chrom_tree_offset = f.tell()
        key_size = max(1, max(len(n.encode()) for n in names))
        f.write(struct.pack("<IIIIQQ", _CHROM_TREE_MAGIC, max(1, len(names)), key_size, 8, len(names), 0))
        f.write(struct.pack("<BBH", 1, 0, len(names)))
        for name in names:
            f.write(name.encode().ljust(key_size, b"\0") + struct.pack("<II", ids[name], int(sizes[name])))
        # the data: sections of up to ITEMS_PER_SLOT items of one chromosome
        data_offset = f.tell()
        slots = _slots(chrom)
        f.write(struct.pack("<Q", len(slots)))
        blocks: list[_Block] = []
        for a, b in slots:
            if per_base:  # variable step, span 1: 8 bytes an item
                items = np.empty(b - a, _VARSTEP_DTYPE)
                head = struct.pack("<IIIIIBBH", int(chrom[a]), int(start[a]), int(end[b - 1]), 0, 1, 2, 0, b - a)
            else:  # bedGraph: 12 bytes an item
                items = np.empty(b - a, _BEDGRAPH_DTYPE)
                items["end"] = end[a:b]
                head = struct.pack("<IIIIIBBH", int(chrom[a]), int(start[a]), int(end[b - 1]), 0, 0, 1, 0, b - a)
            items["start"] = start[a:b]
            items["value"] = value[a:b]
            raw = head + items.tobytes()
            uncompressed = max(uncompressed, len(raw))
            packed = zlib.compress(raw)
            blocks.append(_Block(int(chrom[a]), int(start[a]), int(end[b - 1]), f.tell(), len(packed)))
            f.write(packed)
        index_offset = f.tell()
        _write_rtree(f, blocks, index_offset)
        zoom_headers: list[tuple[int, int, int]] = []
        for reduction in reductions:
            records = _zoom_records(chrom, start, end, value, reduction)
            zoom_data = f.tell()
            f.write(struct.pack("<I", len(records)))
            zblocks: list[_Block] = []
            for a, b in _slots(records["chrom"]):
                raw = records[a:b].tobytes()
                uncompressed = max(uncompressed, len(raw))
                packed = zlib.compress(raw)
                zblocks.append(
                    _Block(
                        int(records["chrom"][a]),
                        int(records["start"][a]),
                        int(records["end"][b - 1]),
                        f.tell(),
                        len(packed),
                    )
                )
                f.write(packed)
            zoom_index = f.tell()
            _write_rtree(f, zblocks, zoom_index)
            zoom_headers.append((reduction, zoom_data, zoom_index))
        f.write(struct.pack("<I", BIGWIG_MAGIC))
        f.seek(0)
        f.write(
            struct.pack(
                "<IHHQQQHHQQIQ",
                BIGWIG_MAGIC,
                4,
                len(zoom_headers),
                chrom_tree_offset,
                data_offset,
                index_offset,
                0,
                0,
                0,
                summary_offset,
                uncompressed,
                0,
            )
        )
        for reduction, zoom_data, zoom_index in zoom_headers:
            f.write(struct.pack("<IIQQ", reduction, 0, zoom_data, zoom_index))

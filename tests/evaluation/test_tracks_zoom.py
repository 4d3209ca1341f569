"""bigWig zoom levels agree with the bases (issue 46, item 1).

A browser zoomed out, and ``pyBigWig.stats()`` (``exact=False``, its default), read a bigWig's
zoom levels: per zoom bin the bases covered, minimum, maximum, sum and sum of squares. libBigWig's
writer (pyBigWig ``addEntries``, genolong's writer before) left the sum of the last bin of every
zoom block 0, count, minimum and maximum set: a zoomed mean over a chromosome's last bases was
about half the true one.

Oracles: numpy over the values written (float64 sums of the float32 values); pyBigWig
(libBigWig, a reader independent of the writer, pybigtools) for ``stats()`` and ``values()``;
pybigtools' reader for the zoom records themselves. Tolerance: a zoom record stores its sum as
float32, so a zoomed mean is the bases' mean to float32 rounding (relative 2^-24 per record; 1e-6
allows for the sum over records); minima and maxima are float32 values and compare exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pybigtools
import pyBigWig
import pytest

from genolong.evaluation.tracks import Track, bin_track, write_tracks

pytestmark = pytest.mark.usefixtures("one_thread")  # the suite's rule for modules that compare bitwise

_RTOL = 1e-6  # float32 storage of a zoom record's sum (see the module docstring)


def _layout(rng: np.random.Generator) -> tuple[Track, dict[str, int]]:
    """A per-base loss track laid out as evaluate lays tiles: tiles of 4,096 whose first base is
    unscored, an N gap of 2,000 between two segments, a contig whose last base is scored, a short
    one that ends before its chromosome does; values float32 like the per-token table's."""
    parts: list[tuple[str, np.ndarray]] = []
    # chr20: 72 tiles, 290k values: 284 data blocks of 1,024, so the R tree has two levels
    for seg_start, n_tiles in ((10_000, 40), (10_000 + 40 * 4096 + 2_000, 32)):
        parts += [("chr20", np.arange(seg_start + t * 4096 + 1, seg_start + (t + 1) * 4096)) for t in range(n_tiles)]
    end20 = int(parts[-1][1][-1]) + 1  # chr20's last base is scored
    parts += [("chr3", np.arange(5_000 + t * 4096 + 1, 5_000 + (t + 1) * 4096 - 37 * (t == 4))) for t in range(5)]
    contig = np.concatenate([np.full(p.size, c, object) for c, p in parts])
    position = np.concatenate([p for _, p in parts]).astype(np.int64)
    value = rng.gamma(2.0, 0.6, position.size).astype(np.float32)
    order = np.lexsort((position, contig))
    sizes = {"chr20": end20, "chr3": 5_000 + 5 * 4096 + 1_000}
    return Track("t", "nll", "t loss", "test", contig[order], position[order], value[order]), sizes


def _dense(track: Track, contig: str, size: int) -> np.ndarray:
    """``[size]`` float64: each base's value (an interval's value on each of its bases), NaN where none."""
    dense = np.full(size, np.nan)
    rows = track.contig == contig
    start, end = track.position[rows], track.ends[rows]
    covered = np.concatenate([np.arange(s, e) for s, e in zip(start, end)]) if track.end is not None else start
    dense[covered] = np.repeat(track.value[rows].astype(np.float64), end - start)
    return dense


def _check_zooms(path: Path, track: Track, sizes: dict[str, int], rng: np.random.Generator, ranges: int = 25) -> int:
    """Every zoom record, and ``stats()`` over ``ranges`` random zoom-aligned ranges per level and
    chromosome, against numpy over the bases; returns the number of ``stats()`` ranges checked."""
    reader = pybigtools.open(str(path))
    bw = pyBigWig.open(str(path))
    checked = 0
    try:
        levels = sorted(reader.zooms())
        assert len(levels) >= 2, levels  # several zoom levels are exercised
        for contig in sorted(set(track.contig)):
            size = sizes[contig]
            dense = _dense(track, contig, size)
            have = ~np.isnan(dense)
            # per-base values: the two readers and the track agree exactly
            np.testing.assert_array_equal(np.asarray(bw.values(contig, 0, size, numpy=True)), dense)
            np.testing.assert_array_equal(np.asarray(reader.values(contig, 0, size, fillna=np.nan)), dense)
            for k, level in enumerate(levels):
                records = list(reader.zoom_records(level, contig))
                assert (
                    records and records[-1][1] == int(np.flatnonzero(have)[-1]) + 1
                )  # the last bin reaches the last base
                # every zoom record, the last one included: numpy over its bases (reduceat over the
                # record bounds; the even results are the records, the odd ones the gaps between)
                bounds = np.array([[r[0], r[1]] for r in records]).ravel()
                assert (np.diff(bounds) >= 0).all() and bounds[-1] <= size
                idx = bounds[:-1] if bounds[-1] == size else bounds
                count = np.add.reduceat(have.astype(np.int64), idx)[::2]
                zero = np.where(have, dense, 0.0)
                total = np.add.reduceat(zero, idx)[::2]
                squares = np.add.reduceat(zero * zero, idx)[::2]
                low = np.minimum.reduceat(np.where(have, dense, np.inf), idx)[::2]
                high = np.maximum.reduceat(np.where(have, dense, -np.inf), idx)[::2]
                got = {key: np.array([r[2][key] for r in records]) for key in records[0][2]}
                np.testing.assert_array_equal(got["bases_covered"], count, err_msg=f"{contig} zoom {level}")
                np.testing.assert_array_equal(got["min_val"].astype(np.float32), low.astype(np.float32))
                np.testing.assert_array_equal(got["max_val"].astype(np.float32), high.astype(np.float32))
                np.testing.assert_allclose(got["sum"], total, rtol=_RTOL, err_msg=f"{contig} zoom {level}")
                np.testing.assert_allclose(got["sum_squares"], squares, rtol=_RTOL)
                # stats() reads zoom level k for a range of at least 2 * level and under 2 * the next
                # level (libBigWig's determineZoomLevel); ranges made of whole records of level k, the
                # first and the last record and the chromosome's end among them
                upper = 2 * levels[k + 1] if k + 1 < len(levels) else size + 1
                starts = np.array([r[0] for r in records])
                ends = np.array([r[1] for r in records])
                picks = [0, len(records) - 1, *rng.integers(0, len(records), 4 * ranges).tolist()]
                done = 0
                for i in picks:
                    j = int(np.searchsorted(ends, starts[i] + 2 * level))  # the first end at least 2 * level away
                    j = min(j + int(rng.integers(0, 3)), len(records) - 1)
                    lo = int(starts[i])
                    hi = size if (j == len(records) - 1 and rng.random() < 0.5) else int(ends[j])
                    if not 2 * level <= hi - lo < upper:
                        continue
                    want = dense[lo:hi][have[lo:hi]]
                    for exact in (False, True):
                        mean, low, high = (
                            bw.stats(contig, lo, hi, type=t, exact=exact)[0] for t in ("mean", "min", "max")
                        )
                        assert mean == pytest.approx(want.mean(), rel=_RTOL), (contig, level, lo, hi, exact)
                        assert np.float32(low) == np.float32(want.min()) and np.float32(high) == np.float32(want.max())
                    done += 1
                    if done == ranges:
                        break
                assert done >= min(ranges, len(records) // 3), (contig, level, done)
                checked += done
    finally:
        bw.close()
    return checked


def _libbigwig_write(path: Path, track: Track, sizes: dict[str, int]) -> None:
    """genolong's writer before issue 46: pyBigWig ``addEntries``, one span-1 entry per base."""
    bw = pyBigWig.open(str(path), "w")
    bw.addHeader(sorted(sizes.items()))
    for contig in sorted(set(track.contig)):
        rows = track.contig == contig
        bw.addEntries(contig, track.position[rows], values=track.value[rows].astype(np.float64), span=1)
    bw.close()


def _pybigtools_write(path: Path, track: Track, sizes: dict[str, int]) -> None:
    """The same intervals written by pybigtools 0.3.0."""
    rows = zip(
        track.contig.tolist(), track.position.tolist(), track.ends.tolist(), track.value.astype(np.float64).tolist()
    )
    pybigtools.open(str(path), "w").write(dict(sizes), rows)


def test_zoom_levels_equal_the_bases(tmp_path: Path) -> None:
    rng = np.random.default_rng(46)
    track, sizes = _layout(rng)
    write_tracks(tmp_path / "out", [track], sizes, formats=("bigwig",))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["chrom.sizes", "t.nll.bw"]
    assert _check_zooms(tmp_path / "out" / "t.nll.bw", track, sizes, rng) >= 200
    # the check is sharp: the previous writer's file fails it (a zoom bin's sum of 0), and so does
    # pybigtools' (the N gap filled with the next value)
    _libbigwig_write(tmp_path / "old.bw", track, sizes)
    with pytest.raises(AssertionError, match="(?i)sum|not equal"):
        _check_zooms(tmp_path / "old.bw", track, sizes, rng, ranges=5)
    _pybigtools_write(tmp_path / "other.bw", track, sizes)
    with pytest.raises(AssertionError, match="(?i)not equal"):
        _check_zooms(tmp_path / "other.bw", track, sizes, rng, ranges=5)


def test_binned_track_zoom_levels_equal_the_bins(tmp_path: Path) -> None:
    """--bin N: one interval per bin holding the mean of its bases; the zoom levels summarise
    those intervals base by base."""
    rng = np.random.default_rng(7)
    track, sizes = _layout(rng)
    binned = bin_track(track, 50, sizes)
    # each bin: [50k, 50k + 50) cut at the chromosome's end, the float32 mean of its scored bases
    for contig in sorted(set(track.contig)):
        rows, brow = track.contig == contig, binned.contig == contig
        index = track.position[rows] // 50
        want = {int(b): track.value[rows][index == b].astype(np.float64).mean() for b in np.unique(index)}
        assert binned.position[brow].tolist() == [b * 50 for b in sorted(want)]
        assert binned.ends[brow].tolist() == [min(b * 50 + 50, sizes[contig]) for b in sorted(want)]
        np.testing.assert_array_equal(binned.value[brow], np.float32([want[b] for b in sorted(want)]))
    write_tracks(tmp_path / "out", [binned], sizes, formats=("bigwig",))
    assert _check_zooms(tmp_path / "out" / "t.nll.bw", binned, sizes, rng, ranges=15) >= 100

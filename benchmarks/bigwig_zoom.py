#!/usr/bin/env python
"""bigWig zoom levels against the bases: genolong's writer, pyBigWig's and pybigtools' (issue 46).

One per-base loss layout as ``evaluate`` writes it (tiles of 4,096 whose first base is unscored,
an N gap of 2,000 bases between two segments, the chromosome's last base scored; values float32
gamma-distributed like a loss), ``--tiles`` tiles in all, written by the three writers. For each
file, read back with pyBigWig (libBigWig):

- ``bad records``: zoom records (all levels, read with pybigtools) whose bases, minimum, maximum
  or sum differ from numpy over the bases they span (sum: relative 1e-6, float32 storage);
- ``worst mean error``: the largest relative error of ``pyBigWig.stats(type="mean")`` (zoomed,
  ``exact=False``) over ranges of whole zoom records of the level it reads, the last ones included;
- ``last 152 bp``: the zoomed mean over the chromosome's last 152 bases against numpy;
- write seconds (median of ``--repeats``) and file bytes per value.

Prints a table and writes JSON (default benchmarks/results/bigwig_zoom.json).

Example::

    python benchmarks/bigwig_zoom.py --tiles 72 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))
from _bench import environment, write_json  # noqa: E402


def _layout(tiles: int, seed: int = 46) -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    first = tiles // 2
    parts = [np.arange(10_000 + t * 4096 + 1, 10_000 + (t + 1) * 4096) for t in range(first)]
    gap_end = 10_000 + first * 4096 + 2_000
    parts += [np.arange(gap_end + t * 4096 + 1, gap_end + (t + 1) * 4096) for t in range(tiles - first)]
    position = np.concatenate(parts).astype(np.int64)
    return position, rng.gamma(2.0, 0.6, position.size).astype(np.float32), int(position[-1]) + 1


def _genolong(path: Path, position: np.ndarray, value: np.ndarray, size: int) -> None:
    from genolong.evaluation.bigwig import write_bigwig_file

    write_bigwig_file(path, {"chr20": size}, np.full(position.size, "chr20", object), position, position + 1, value)


def _pybigwig(path: Path, position: np.ndarray, value: np.ndarray, size: int) -> None:
    import pyBigWig

    bw = pyBigWig.open(str(path), "w")
    bw.addHeader([("chr20", size)])
    bw.addEntries("chr20", position, values=value.astype(np.float64), span=1)
    bw.close()


def _pybigtools(path: Path, position: np.ndarray, value: np.ndarray, size: int) -> None:
    import pybigtools

    rows = zip(["chr20"] * position.size, position.tolist(), (position + 1).tolist(), value.astype(np.float64).tolist())
    pybigtools.open(str(path), "w").write({"chr20": size}, rows)


def _measure(path: Path, position: np.ndarray, value: np.ndarray, size: int) -> dict[str, float]:
    import pybigtools
    import pyBigWig

    dense = np.full(size, np.nan)
    dense[position] = value
    have = ~np.isnan(dense)
    reader, bw = pybigtools.open(str(path)), pyBigWig.open(str(path))
    levels = sorted(reader.zooms())
    bad, worst, ranges = 0, 0.0, 0
    for k, level in enumerate(levels):
        records = list(reader.zoom_records(level, "chr20"))
        for start, end, summary in records:
            inside = dense[start:end][have[start:end]]
            ok = (
                summary["bases_covered"] == inside.size
                and inside.size > 0
                and np.float32(summary["min_val"]) == np.float32(inside.min())
                and np.float32(summary["max_val"]) == np.float32(inside.max())
                and abs(summary["sum"] - inside.sum()) <= 1e-6 * abs(inside.sum())
            )
            bad += not ok
        upper = 2 * levels[k + 1] if k + 1 < len(levels) else size + 1
        starts, ends = np.array([r[0] for r in records]), np.array([r[1] for r in records])
        pairs = []
        for i in range(0, len(records), max(1, len(records) // 40)):
            j = int(np.searchsorted(ends, starts[i] + 2 * level))
            if j < len(records):
                pairs.append((i, j))
        # the last records: the shortest range of whole records ending with the last one
        i_last = int(np.searchsorted(starts, ends[-1] - 2 * level, side="right")) - 1
        if i_last >= 0:
            pairs.append((i_last, len(records) - 1))
        for i, j in pairs:
            lo, hi = int(starts[i]), int(ends[j])
            if not 2 * level <= hi - lo < upper or not have[lo:hi].any():
                continue
            want = dense[lo:hi][have[lo:hi]].mean()
            got = bw.stats("chr20", lo, hi, type="mean")[0]
            worst = max(worst, abs(got - want) / want if got is not None else 1.0)
            ranges += 1
    last = bw.stats("chr20", size - 152, size, type="mean")[0]
    bw.close()
    return {
        "levels": len(levels),
        "bad_records": bad,
        "records": sum(len(list(reader.zoom_records(z, "chr20"))) for z in levels),
        "ranges": ranges,
        "worst_mean_error": worst,
        "last152_zoomed": last,
        "last152_bases": float(dense[size - 152 :][have[size - 152 :]].mean()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=72)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "bigwig_zoom.json"))
    args = parser.parse_args(argv)
    position, value, size = _layout(args.tiles)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in (("genolong", _genolong), ("pyBigWig 0.3.29", _pybigwig), ("pybigtools 0.3.0", _pybigtools)):
            path = Path(tmp) / f"{name.split()[0]}.bw"
            seconds = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                write(path, position, value, size)
                seconds.append(time.perf_counter() - t0)
            row = {
                "writer": name,
                "values": int(position.size),
                "write_s": statistics.median(seconds),
                "bytes_per_value": path.stat().st_size / position.size,
                **_measure(path, position, value, size),
            }
            rows.append(row)
    header = [
        "writer",
        "levels",
        "bad records",
        "worst zoomed mean error",
        "last 152 bp zoomed / bases",
        "write s",
        "B/value",
    ]
    print(" | ".join(header))
    for r in rows:
        print(
            " | ".join(
                [
                    r["writer"],
                    str(r["levels"]),
                    f"{r['bad_records']:,} / {r['records']:,}",
                    f"{r['worst_mean_error']:.2e} ({r['ranges']} ranges)",
                    f"{r['last152_zoomed']:.4f} / {r['last152_bases']:.4f}",
                    f"{r['write_s']:.2f}",
                    f"{r['bytes_per_value']:.2f}",
                ]
            )
        )
    write_json(args.out, {"environment": environment(), "tiles": args.tiles, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

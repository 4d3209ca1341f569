#!/usr/bin/env python
"""Write a ~133 Mbp two-chromosome FASTA of *real* human sequence, tiled (for benchmarks).

The prepare benchmark should run on real DNA (its compression ratio, N runs and line layout are
what ``gzip -dc`` and ``genolong prepare`` see on a real assembly), but no whole chromosome is on
this machine and none can be downloaded. This script tiles the real human pieces under
``/work/shared/data/human/`` (about 7.5 Mbp: GRCh37 chr22:20-21M with its N runs, hg19 chr3/4/5
2 Mbp windows, hg38 chr16 soft-masked, the start of GRCh37 chr1, chrM; see that folder's README)
into records ``>1`` and ``>2`` (GRCh37 naming) of ``--mbp / 2`` each: each record is the pieces
concatenated in a fixed order, repeated and cut at its length; the second record starts at
another piece so the two differ. Case and N runs are kept as in the sources. The sequence is
real but *tiled*: not a whole chromosome (a repeat period of ~7.5 Mbp, which gzip's 32 KiB window
cannot exploit, so it compresses like the sources).

Written with 60 bases a line and ``gzip -1`` (the system gzip), under a temporary name then
renamed, so a file at ``--out`` is always complete.

Example::

    python benchmarks/make_real_tiled_genome.py --out benchmarks/scratch/real_tiled_133.fa.gz
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_SOURCE = Path("/work/shared/data/human")
#: the pieces, in tiling order (file names under --source)
PIECES = (
    "GRCh37_chr22_20000001-21000000.fa.gz",
    "hg19_chr3.42M.fa.gz",
    "hg19_chr4.103M.fa.gz",
    "hg38_chr16_186964-397118.softmasked.fa.gz",
    "hg19_chr5.124M.fa.gz",
    "GRCh37_chr1_truncated_240kb.fa.gz",
    "chrM_rCRS.fa.gz",
)
LINE = 60


def read_sequence(path: Path) -> bytes:
    """All sequence lines of a (gzip) FASTA file, concatenated (headers and newlines dropped)."""
    with gzip.open(path, "rb") as fh:
        return b"".join(line.strip() for line in fh if not line.startswith(b">"))


def tiled(pieces: list[bytes], length: int, start: int) -> bytes:
    """``length`` bases of the pieces concatenated from piece ``start`` on, repeated."""
    order = pieces[start:] + pieces[:start]
    period = b"".join(order)
    reps = -(-length // len(period))
    return (period * reps)[:length]


def main(argv: list[str] | None = None) -> int:
    """Write the tiled genome; prints its records and size."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output .fa.gz")
    p.add_argument(
        "--mbp", type=float, default=133.0, help="total size in Mbp, split over records 1 and 2 (default 133)"
    )
    p.add_argument(
        "--source", type=Path, default=DEFAULT_SOURCE, help=f"folder of the real pieces (default {DEFAULT_SOURCE})"
    )
    a = p.parse_args(argv)
    pieces = [read_sequence(a.source / name) for name in PIECES]
    total = int(a.mbp * 1e6)
    lengths = {"1": total - total // 2, "2": total // 2}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".partial")
    with open(tmp, "wb") as raw:
        gz = subprocess.Popen(["gzip", "-1", "-c"], stdin=subprocess.PIPE, stdout=raw)
        assert gz.stdin is not None
        for i, (name, length) in enumerate(lengths.items()):
            seq = tiled(pieces, length, start=3 * i)
            gz.stdin.write(f">{name}\n".encode())
            for s in range(0, len(seq), LINE * 100_000):  # 6 Mbp of lines at a time
                block = seq[s : s + LINE * 100_000]
                gz.stdin.write(b"\n".join(block[j : j + LINE] for j in range(0, len(block), LINE)) + b"\n")
        gz.stdin.close()
        if gz.wait() != 0:
            raise SystemExit("gzip failed")
    os.replace(tmp, a.out)
    n = sum(piece.upper().count(b"N") for piece in pieces)
    print(
        f"{a.out}: records 1 ({lengths['1']:,} bp) and 2 ({lengths['2']:,} bp) tiled from {len(PIECES)} real pieces "
        f"({sum(map(len, pieces)):,} bp, {n:,} N); {a.out.stat().st_size:,} bytes gzip -1",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

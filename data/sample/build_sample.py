"""Rebuild the bundled sample genome (sample.fa.gz + .fai + .gzi) from the project's shared human DNA.

Usage: python data/sample/build_sample.py [--shared ../shared/data/human]

Each record is named ``chrN:START-END`` (UCSC chromosome name, 1-based inclusive coordinates, as
``samtools faidx`` writes regions), so that ``genolong prepare`` places every base at its true
genomic coordinate. Sequence is copied base for base (case kept), re-wrapped to 60 columns.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import tempfile
from pathlib import Path

import pysam

# (source file, record name, assembly, original header)
PIECES = [
    ("GRCh37_chr1_truncated_240kb.fa.gz", "chr1:1-239940", "GRCh37"),
    ("hg19_chr3.42M.fa.gz", "chr3:42000000-44000000", "hg19"),
    ("hg19_chr4.103M.fa.gz", "chr4:103000000-105000000", "hg19"),
    ("hg19_chr5.124M.fa.gz", "chr5:124000000-126000000", "hg19"),
    ("GRCh37_chr22_20000001-21000000.fa.gz", "chr22:20000001-21000000", "GRCh37"),
]


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=here.parents[2] / "shared" / "data" / "human")
    parser.add_argument("--out", type=Path, default=here / "sample.fa.gz")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "sample.fa"
        with open(plain, "w") as out:
            for filename, name, assembly in PIECES:
                with gzip.open(args.shared / filename, "rt") as handle:
                    header = handle.readline().strip()
                    sequence = "".join(line.strip() for line in handle)
                start, end = (int(x) for x in name.split(":")[1].split("-"))
                assert len(sequence) == end - start + 1, (name, len(sequence))
                out.write(f">{name} {assembly}; source {filename}; original header {header}\n")
                for i in range(0, len(sequence), 60):
                    out.write(sequence[i : i + 60] + "\n")
        pysam.tabix_compress(str(plain), str(args.out), force=True)
    for suffix in (".fai", ".gzi"):
        Path(f"{args.out}{suffix}").unlink(missing_ok=True)
    pysam.faidx(str(args.out))
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes, sha256 {digest})")


if __name__ == "__main__":
    main()

"""Test helpers: small FASTA writers, a naive reference segmenter, paths of the test data."""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable
from pathlib import Path

import pysam

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = Path(__file__).resolve().parent / "data"
SOFTMASKED_CHR16 = TEST_DATA / "hg38_chr16_186964-397118.softmasked.fa.gz"
CHRM = TEST_DATA / "chrM_rCRS.fa.gz"

_AMBIGUITY = re.compile(r"[RYSWKMBDHV]")


def fasta_text(records: Iterable[tuple[str, str]], width: int = 60, newline: str = "\n", final_newline: bool = True) -> str:
    """FASTA text of (header, sequence) records wrapped at ``width`` columns."""
    lines: list[str] = []
    for header, seq in records:
        lines.append(f">{header}")
        lines.extend(seq[i:i + width] for i in range(0, len(seq), width))
    text = newline.join(lines)
    return text + newline if final_newline else text


def write_fasta(path: Path, records: Iterable[tuple[str, str]], width: int = 60, compress: str | None = None,
                newline: str = "\n", index: bool = False) -> Path:
    """Write records as plain, gzip or bgzip FASTA (bgzip/plain optionally with .fai/.gzi)."""
    text = fasta_text(records, width, newline).encode()
    if compress == "gzip":
        with gzip.open(path, "wb") as handle:
            handle.write(text)
    elif compress == "bgzip":
        plain = path.with_name(path.name + ".plain")
        plain.write_bytes(text)
        pysam.tabix_compress(str(plain), str(path), force=True)
        plain.unlink()
    else:
        path.write_bytes(text)
    if index:
        pysam.faidx(str(path))
    return path


def reference_segments(seq: str, min_gap: int) -> list[tuple[int, int]]:
    """Naive segmentation: trim N at both ends, cut at N runs of at least ``min_gap``.

    Ambiguity codes count as N (they become N tokens). Returns half-open record coordinates.
    """
    as_n = _AMBIGUITY.sub("N", seq.upper())
    segments = []
    i = 0
    for m in re.finditer(r"N+", as_n):
        at_end = m.start() == 0 or m.end() == len(as_n)
        if at_end or m.end() - m.start() >= min_gap:
            if m.start() > i:
                segments.append((i, m.start()))
            i = m.end()
    if i < len(as_n):
        segments.append((i, len(as_n)))
    return segments


def expected_text(seq: str) -> str:
    """What decode() returns for ``seq``: ambiguity codes become N, case kept."""
    return re.sub(r"[ryswkmbdhv]", "n", _AMBIGUITY.sub("N", seq))


# transformers routes glm5_next's KDA to fla's Triton kernels whenever fla is importable, and those
# fail on CPU: every transformers reference runs in a child process that hides fla first.
_TRANSFORMERS_PRELUDE = 'import sys\nsys.modules["fla"] = None\n'


def run_transformers(script: str, *args: str, stdin: str = "") -> str:
    """Run a transformers reference ``script`` (with ``args`` in ``sys.argv[1:]`` and ``stdin``)
    in a child process where fla cannot be imported; returns its stdout.

    Raises:
        AssertionError: with the child's stderr if it fails.
    """
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _TRANSFORMERS_PRELUDE + script, *args], input=stdin,
                         text=True, capture_output=True)
    if run.returncode:
        raise AssertionError(f"the transformers reference failed:\n{run.stderr[-4000:]}")
    return run.stdout

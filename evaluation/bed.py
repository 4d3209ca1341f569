"""BED regions (``--regions``): the intervals of a BED file, merged per contig, and membership tests.

A BED line is ``chrom start end [...]``, 0-based half-open (``chr1 0 100`` is the first 100
bases); ``track``/``browser`` lines, ``#`` comments and blank lines are skipped; extra columns are
ignored; plain or gzip. Overlapping and touching intervals are merged.
"""

from __future__ import annotations

import bisect
import gzip
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

__all__ = ["Regions", "read_bed"]


@dataclass(frozen=True)
class Regions:
    """Merged intervals per contig.

    Attributes:
        path: the BED file they came from.
        intervals: contig -> sorted, disjoint, non-touching ``(start, end)`` (0-based, half-open).
    """

    path: Path
    intervals: dict[str, list[tuple[int, int]]]

    def contains(self, contig: str, pos0: int) -> bool:
        """Whether the 0-based base ``pos0`` of ``contig`` lies in a region."""
        spans = self.intervals.get(contig)
        if not spans:
            return False
        k = bisect.bisect_right(spans, (pos0, float("inf"))) - 1
        return k >= 0 and spans[k][0] <= pos0 < spans[k][1]

    @property
    def bases(self) -> int:
        """Bases covered, all contigs together."""
        return sum(e - s for spans in self.intervals.values() for s, e in spans)


def read_bed(path: str | os.PathLike[str]) -> Regions:
    """Read a BED file's intervals (see the module docstring).

    Args:
        path: BED, plain or gzip.

    Returns:
        The :class:`Regions`.

    Raises:
        InputError: a missing file, a line without three columns or with positions that are not
            integers with ``0 <= start <= end``, or no interval at all (one line naming the file,
            the line and the fix).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such BED file; check the path given to --regions")
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    raw: dict[str, list[tuple[int, int]]] = {}
    try:
        with (gzip.open(path, "rt") if gz else open(path)) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip() or line.startswith(("#", "track", "browser")):
                    continue
                cols = line.split()
                try:
                    if len(cols) < 3:
                        raise ValueError
                    start, end = int(cols[1]), int(cols[2])
                    if not 0 <= start <= end:
                        raise ValueError
                except ValueError:
                    raise InputError(f"{path}: line {number} is not 'chrom start end' with 0 <= start <= end "
                                     f"(0-based, half-open): {line.strip()[:80]!r}; fix the line") from None
                raw.setdefault(cols[0], []).append((start, end))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read as a BED text file ({exc}); give a plain or gzip BED") from None
    merged: dict[str, list[tuple[int, int]]] = {}
    for contig, spans in raw.items():
        out: list[tuple[int, int]] = []
        for s, e in sorted(spans):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            elif e > s:
                out.append((s, e))
        if out:
            merged[contig] = out
    if not merged:
        raise InputError(f"{path}: no interval of at least one base; give a BED with 'chrom start end' lines")
    return Regions(path, merged)

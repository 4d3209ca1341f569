"""BED regions (``--regions FILE``): which bases of a genome a command keeps.

A BED file lists ``chrom<TAB>start<TAB>end[<TAB>...]`` per line, 0-based and half-open (the
region ``chr20  100  200`` is the bases at 0-based positions 100 ... 199, 1-based 101 ... 200).
``track``, ``browser``, ``#`` and blank lines are skipped; columns past the third are ignored.
Regions may overlap and come in any order: they are merged per chromosome.

A region's chromosome is looked up among the names the caller knows (a store's contigs, a
``chrom.sizes`` file) through the aliases of :mod:`genolong.data.names`: ``20``, ``chr20`` and
``NC_000020.10`` all find a chromosome called ``20`` or ``chr20``. A region on a chromosome that is
not there, or reaching past its end, is an error naming the BED line, not a silent empty result.

This module is shared: ``genolong tracks``, ``evaluate`` and ``variants --regions`` use it (any
command that keeps a subset of the genome can) (:func:`read_bed` then :meth:`Regions.contains` / :meth:`Regions.overlaps`).
Importing it loads numpy only.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError
from .names import canonical_name

__all__ = ["Regions", "read_bed", "resolve_name"]


def resolve_name(name: str, known: Mapping[str, object] | list[str] | tuple[str, ...]) -> str | None:
    """The one name of ``known`` that denotes the same chromosome as ``name``.

    An exact match wins; otherwise the names whose :func:`~genolong.data.names.canonical_name`
    equals ``name``'s (``20`` finds ``chr20``, ``NC_000020.10`` finds ``20``).

    Returns:
        The name as ``known`` spells it, or None when none or several match.
    """
    if name in known:
        return name
    canon = canonical_name(name)
    hits = [k for k in known if canonical_name(k) == canon]
    return hits[0] if len(hits) == 1 else None


@dataclass(frozen=True)
class Regions:
    """Merged BED regions per chromosome.

    Attributes:
        intervals: chromosome (as the caller's names spell it) -> ``[k, 2]`` int64 array of
            0-based half-open ``(start, end)``, sorted, non-overlapping, non-adjacent.
        source: where they came from (the BED path), for messages.
    """

    intervals: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = "--regions"

    @property
    def bases(self) -> int:
        """The number of bases the regions cover."""
        return int(sum(int((iv[:, 1] - iv[:, 0]).sum()) for iv in self.intervals.values()))

    @property
    def digest(self) -> str:
        """sha256 of the merged intervals (names and coordinates): equal digests, equal regions."""
        h = hashlib.sha256()
        for name in sorted(self.intervals):
            h.update(name.encode() + b"\0" + self.intervals[name].astype("<i8").tobytes())
        return h.hexdigest()

    def contains(self, contig: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Whether each base lies inside a region.

        Args:
            contig: ``[n]`` chromosome names (the caller's spelling).
            position: ``[n]`` int64 0-based positions.

        Returns:
            ``[n]`` bool.
        """
        return self.overlaps(contig, position, np.asarray(position) + 1)

    def overlaps(self, contig: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Whether each half-open interval ``[start, end)`` shares at least one base with a region.

        Args:
            contig: ``[n]`` chromosome names; start, end: ``[n]`` int64, ``start < end``.

        Returns:
            ``[n]`` bool.
        """
        contig = np.asarray(contig, dtype=object)
        start, end = np.asarray(start, np.int64), np.asarray(end, np.int64)
        keep = np.zeros(contig.shape, bool)
        for name, iv in self.intervals.items():
            rows = np.flatnonzero(contig == name)
            if not rows.size:
                continue
            # the last region starting before `end`: it overlaps iff it ends after `start`
            i = np.searchsorted(iv[:, 0], end[rows], side="left") - 1
            keep[rows] = (i >= 0) & (iv[np.maximum(i, 0), 1] > start[rows])
        return keep


def read_bed(
    path: str | os.PathLike[str], sizes: Mapping[str, int], option: str = "--regions", where: str = "the store"
) -> Regions:
    """Read a BED file of regions against the chromosomes ``sizes`` names.

    Args:
        path: the BED file (plain or gzip text; 0-based half-open; ``track`` / ``browser`` / ``#`` lines skipped).
        sizes: chromosome name -> size of what the regions select from; each region's chromosome
            is resolved to one of these names (:func:`resolve_name`).
        option: the option to name in errors.
        where: what ``sizes`` describe, for errors (``"the store"``, ``"--chrom-sizes"``).

    Returns:
        The merged :class:`Regions`, keyed by the names of ``sizes``.

    Raises:
        InputError: the file is missing or empty, a line is not ``chrom start end`` with
            ``0 <= start < end``, or a region lies on a chromosome ``sizes`` lacks or past its end.
    """
    path = Path(path)
    try:
        with open(path, "rb") as probe:
            gz = probe.read(2) == b"\x1f\x8b"
        text = gzip.decompress(path.read_bytes()).decode() if gz else path.read_text()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise InputError(
            f"cannot read {option} {path} ({exc}); give a BED file (chrom<TAB>start<TAB>end per line)"
        ) from None
    found: dict[str, list[tuple[int, int]]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith(("#", "track", "browser")):
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 3 or not fields[1].strip().isdigit() or not fields[2].strip().isdigit():
            raise InputError(
                f"{option} {path} line {number} is not `chrom<TAB>start<TAB>end` ({line[:60]!r}); "
                "give a BED file (0-based, half-open)"
            )
        chrom, start, end = fields[0].strip(), int(fields[1]), int(fields[2])
        if start >= end:
            raise InputError(
                f"{option} {path} line {number}: start {start:,} is not below end {end:,} (BED is "
                "0-based, half-open: one base at 1-based p is `p-1  p`); fix the line"
            )
        name = resolve_name(chrom, sizes)
        if name is None:
            shown = ", ".join(list(sizes)[:10]) + (" ..." if len(sizes) > 10 else "")
            raise InputError(
                f"{option} {path} line {number}: chromosome {chrom} is not in {where} (it has {shown}); "
                "give regions of the evaluated chromosomes"
            )
        if end > sizes[name]:
            raise InputError(
                f"{option} {path} line {number}: {chrom}:{start:,}-{end:,} reaches past the end of {name} "
                f"({sizes[name]:,} bases in {where}); fix the region or the build"
            )
        found.setdefault(name, []).append((start, end))
    if not found:
        raise InputError(f"{option} {path} lists no region; give a BED file (chrom<TAB>start<TAB>end per line)")
    return Regions({name: _merge(pairs) for name, pairs in found.items()}, str(path))


def _merge(pairs: list[tuple[int, int]]) -> np.ndarray:
    """Sorted, merged ``[k, 2]`` intervals (overlapping or touching ones joined)."""
    iv = np.array(sorted(pairs), np.int64)  # [m, 2]
    merged = [iv[0].tolist()]
    for s, e in iv[1:].tolist():
        if s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return np.array(merged, np.int64).reshape(-1, 2)

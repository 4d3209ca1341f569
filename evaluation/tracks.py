"""Genome-browser tracks of evaluation results: per-base loss and per-base difference, as bigWig and bedGraph.

``genolong evaluate ... --tracks`` writes them into the result directory; ``genolong tracks
RESULT_DIR [OTHER_RESULT_DIR]`` builds them for saved results. Both read the per-token table
(``tokens/part-NNNNN.parquet``: contig, 0-based genomic position, nll) and write, under the
output directory (default ``RESULT_DIR/tracks``):

- ``<name>.nll.bw`` and ``<name>.nll.bedGraph``: the loss (nats) of every scored base of one
  result, ``name`` its label made file-safe (:func:`track_name`);
- with a second result B over the same tiles (same fingerprint): also B's two files and
  ``<nameB>-minus-<nameA>.diff.bw`` / ``.diff.bedGraph``, the per-base ``B - A`` in nats
  (negative: B predicts the base better than A);
- ``chrom.sizes``: the chromosome names and sizes the files were written with (UCSC format).

``--formats`` chooses bigWig, bedGraph or both (default both); ``--bin N`` writes the mean of each
``N``-base bin (:func:`bin_track`); ``--regions BED`` keeps the bases inside the regions
(:func:`restrict_track`, :mod:`genolong.data.regions`). The bigWig is written by
:mod:`genolong.evaluation.bigwig`, whose zoom levels are exact (pyBigWig's and pybigtools' are not).

Names: the files name each chromosome as the sizes do (:func:`rename_to_sizes`): the store's
output names (the source FASTA's, ``20`` for a b37 ``>20``, unless prepared with ``--names
ucsc``) or a ``--chrom-sizes`` file's (a UCSC ``chrom.sizes`` or the FASTA's ``.fai``), matched
to the per-token table's store names (UCSC, ``chr20``) through the aliases.

Coordinates are the store's genomic ones (a base at 0-based position ``p`` is the bedGraph
interval ``p  p+1``, displayed 1-based as ``p + 1``). The chromosome sizes are those of the source
FASTA as the store's manifest records them: a whole-chromosome record's length, and for a
``NAME:START-END`` slice record the slice's end (the FASTA tells nothing beyond it); a UCSC
``chrom.sizes`` file (``--chrom-sizes``) replaces them, e.g. an assembly's full sizes.

A base that was not scored (an N, a tile's first base, a base outside the scored tiles) has no
value: no bigWig entry and no bedGraph line. The tiles of one result partition the held-out
segments (:class:`~genolong.data.windows.EvalTiles`), so a result scores each position at most
once, with or without ``--context-cut``; a per-token table that holds a position twice is damaged
and refused. The bigWig stores float32, as the table does, so its values equal the table's; the
bedGraph writes each as the shortest decimal that reads back as the same float32.

Importing this module does not import torch (``genolong tracks`` is a light command).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..data.names import parse_record_name, source_name
from ..data.regions import Regions, read_bed, resolve_name
from ..errors import InputError, StoreError
from ..files import replace_dir, unique_sibling, writing
from .results import EvalResult

__all__ = [
    "TRACKS_DIR",
    "FORMATS",
    "Track",
    "chrom_sizes_from_contigs",
    "read_chrom_sizes",
    "result_chrom_sizes",
    "result_track",
    "difference_track",
    "track_name",
    "rename_to_sizes",
    "restrict_track",
    "bin_track",
    "parse_formats",
    "write_bigwig",
    "write_bedgraph",
    "write_tracks",
    "tracks_for_results",
    "write_result_tracks",
]

#: the folder of a result directory that ``evaluate --tracks`` and ``genolong tracks`` write
TRACKS_DIR = "tracks"
#: the file formats a track is written in, and their suffixes (``--formats``; default both)
FORMATS: dict[str, str] = {"bigwig": ".bw", "bedgraph": ".bedGraph"}
_CHROM_SIZES_FIX = "pass --chrom-sizes FILE (a UCSC chrom.sizes file: name<TAB>length per line)"


@dataclass(frozen=True)
class Track:
    """Per-base values of one track, sorted by (contig, position), each position once.

    Attributes:
        name: file stem (``<name>.nll.bw`` ...), file-safe.
        kind: ``"nll"`` (loss of one result) or ``"diff"`` (B - A).
        title: the UCSC ``name=`` of the track (short, shown beside it).
        description: the UCSC ``description=`` (says what the value is and its sign).
        contig: ``[n]`` object array of chromosome names.
        position: ``[n]`` int64 0-based genomic positions.
        value: ``[n]`` float32 values (nats).
        end: ``[n]`` int64 0-based exclusive ends of each value's interval (a binned track,
            :func:`bin_track`); default None: one base each, ``position + 1``.
        bin_size: the bin size of a binned track (each interval inside ``[k*bin_size,
            (k+1)*bin_size)``); 1 for a per-base track.
    """

    name: str
    kind: str
    title: str
    description: str
    contig: np.ndarray
    position: np.ndarray
    value: np.ndarray
    end: np.ndarray | None = None
    bin_size: int = 1

    @property
    def ends(self) -> np.ndarray:
        """``[n]`` int64 exclusive ends: :attr:`end`, or ``position + 1`` for a per-base track."""
        return self.end if self.end is not None else self.position + 1

    def subset(self, keep: np.ndarray) -> Track:
        """The rows where ``keep`` (``[n]`` bool) is true, with the same names."""
        return replace(
            self,
            contig=self.contig[keep],
            position=self.position[keep],
            value=self.value[keep],
            end=None if self.end is None else self.end[keep],
        )

    @property
    def stem(self) -> str:
        """``<name>.<kind>``: the files are ``<stem>.bw`` and ``<stem>.bedGraph``."""
        return f"{self.name}.{self.kind}"


def track_name(label: str) -> str:
    """A file-safe form of a result label: every run of characters other than letters, digits,
    ``.``, ``_``, ``+`` and ``-`` becomes one ``_`` (``"fine-tuned, cut at 1,024"`` ->
    ``"fine-tuned_cut_at_1_024"``); an empty result is ``"result"``."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "_", label).strip("_.")
    return name or "result"


def chrom_sizes_from_contigs(contigs: Sequence[Mapping[str, Any]], where: str = "the store") -> dict[str, int]:
    """Chromosome sizes from a store split's contig records (:attr:`genolong.data.store.Split.contigs`).

    A record's size is ``start + length``: its length for a whole chromosome (``start`` 0), the
    end of the slice for a ``NAME:START-END`` record. It is keyed by the record's ``output_name``
    (the source FASTA's name, or the UCSC one for a store prepared with ``--names ucsc``; stores
    prepared before genolong recorded it keep their ``name``, the UCSC one).

    Args:
        contigs: the manifest's per-contig records (``name``, ``start``, ``length``).
        where: what to name in an error (the store's path).

    Raises:
        InputError: a record lacks ``name`` / ``start`` / ``length``.
    """
    sizes: dict[str, int] = {}
    for record in contigs:
        try:
            name = str(record.get("output_name", record["name"]))
            end = int(record["start"]) + int(record["length"])
        except (KeyError, TypeError, ValueError):
            raise InputError(
                f"{where} does not record its contigs' start and length; re-run `genolong prepare` "
                f"to rebuild it, or {_CHROM_SIZES_FIX}"
            ) from None
        sizes[name] = max(end, sizes.get(name, 0))
    return sizes


def read_chrom_sizes(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read a UCSC ``chrom.sizes`` file: ``name<TAB>length`` per line (more columns, blank and
    ``#`` lines ignored), or a FASTA's ``.fai`` index (the same two first columns).

    A ``NAME:START-END`` record of a ``.fai`` whose length is the slice's (``samtools faidx``
    slices, as in the bundled sample) counts as chromosome ``NAME`` reaching to ``END``.

    Raises:
        InputError: the file is missing, or a line is not a name and a positive length.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(
            f"cannot read --chrom-sizes {path} ({exc}); give a UCSC chrom.sizes file (name<TAB>length per line)"
        ) from None
    sizes: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2 or not fields[1].isdigit() or int(fields[1]) < 1:
            raise InputError(
                f"--chrom-sizes {path} line {number} is not `name<TAB>length` ({line[:60]!r}); "
                "give a UCSC chrom.sizes file"
            )
        name, size = fields[0], int(fields[1])
        region = parse_record_name(name)
        if region.length == size:  # a slice record: its chromosome reaches at least to the slice's end
            name, size = source_name(name), region.start + size
        sizes[name] = max(size, sizes.get(name, 0))
    if not sizes:
        raise InputError(
            f"--chrom-sizes {path} lists no chromosome; give a UCSC chrom.sizes file (name<TAB>length per line)"
        )
    return sizes


def result_chrom_sizes(result: EvalResult, store: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """The chromosome sizes of a result's store split (:func:`chrom_sizes_from_contigs`).

    Args:
        result: the evaluation result; its ``meta["store"]`` and ``meta["split"]`` name the store.
        store: the store directory instead of the one in the result's meta (a moved store).

    Raises:
        InputError: the store cannot be opened (missing, moved, evaluated in memory) or records no sizes.
    """
    from ..data.store import GenomeStore  # zarr: only when sizes come from a store

    path = Path(store) if store is not None else Path(str(result.meta.get("store", "")))
    where = result.source if result.source is not None else result.label
    if not str(path) or not path.is_dir():
        raise InputError(
            f"the genome store of {where} ({path}) is not there; pass --store DIR (the store it was "
            f"evaluated on) or {_CHROM_SIZES_FIX}"
        )
    try:
        split = GenomeStore.open(path, verify=False).split(str(result.meta["split"]))
    except StoreError as exc:
        raise InputError(f"{exc} (needed for the chromosome sizes of {where}; or {_CHROM_SIZES_FIX})") from None
    return chrom_sizes_from_contigs(split.contigs, str(path))


def _token_columns(result_dir: Path) -> pd.DataFrame:
    """contig (str), position (int64), nll (float32) of a result's per-token table, in tile order."""
    parts = sorted((result_dir / "tokens").glob("part-*.parquet"))
    if not parts:
        raise InputError(
            f"{result_dir} has no per-token table (tokens/part-*.parquet); re-run `genolong evaluate` "
            "without --no-tokens"
        )
    try:
        table = pa.concat_tables(
            [pq.read_table(p, columns=["contig", "position", "nll"]) for p in parts], promote_options="permissive"
        )
    except (OSError, pa.ArrowException) as exc:
        raise InputError(
            f"the per-token table of {result_dir} cannot be read ({exc}); re-run `genolong evaluate`"
        ) from None
    return pd.DataFrame(
        {
            "contig": table["contig"].cast(pa.string()).to_numpy(zero_copy_only=False).astype(object),
            "position": table["position"].to_numpy().astype(np.int64),
            "nll": table["nll"].to_numpy().astype(np.float32),
        }
    )


def _sorted_unique(frame: pd.DataFrame, where: str) -> pd.DataFrame:
    """``frame`` sorted by (contig, position); a position twice is a damaged result."""
    frame = frame.sort_values(["contig", "position"], kind="stable", ignore_index=True)
    contig, position = frame["contig"].to_numpy(), frame["position"].to_numpy()
    twice = np.flatnonzero((contig[1:] == contig[:-1]) & (position[1:] == position[:-1]))
    if twice.size:
        i = int(twice[0])
        raise InputError(
            f"{where}: the per-token table scores {contig[i]}:{position[i] + 1} more than once (a tile "
            "layout evaluate never writes: a damaged or hand-merged result); re-run `genolong evaluate`"
        )
    return frame


def result_track(result: EvalResult, directory: str | os.PathLike[str] | None = None, name: str | None = None) -> Track:
    """The per-base loss track of one result.

    Args:
        result: the result (its label names the track).
        directory: where its ``tokens/`` is (default: ``result.source``).
        name: the file stem (default: :func:`track_name` of the label).

    Raises:
        InputError: no per-token table, or a position scored twice.
    """
    directory = Path(directory) if directory is not None else result.source
    if directory is None:
        raise InputError(f"result {result.label} was not loaded from a directory; save it and pass its directory")
    frame = _sorted_unique(_token_columns(directory), str(directory))
    cut = result.context_cut
    seen = f"tiles of {result.context:,}" + (f", context cut at {cut:,}" if cut is not None else "")
    return Track(
        name=name or track_name(result.label),
        kind="nll",
        title=f"{result.label} loss",
        description=f"genolong per-base loss (nats) of {result.label} ({seen})",
        contig=frame["contig"].to_numpy(),
        position=frame["position"].to_numpy(),
        value=frame["nll"].to_numpy(),
    )


def difference_track(a: Track, b: Track, label_a: str, label_b: str) -> Track:
    """The per-base ``B - A`` (float32, nats) of two loss tracks over the same positions.

    Raises:
        InputError: the tracks do not cover the same positions.
    """
    if not (np.array_equal(a.contig, b.contig) and np.array_equal(a.position, b.position)):
        raise InputError(
            f"{label_a} and {label_b} scored different positions though their fingerprints match "
            "(a damaged per-token table); re-run `genolong evaluate` for both"
        )
    return Track(
        name=f"{b.name}-minus-{a.name}",
        kind="diff",
        title=f"{label_b} - {label_a}",
        description=f"genolong per-base loss difference B - A (nats): B = {label_b}, A = {label_a}; "
        "negative = B predicts the base better",
        contig=a.contig,
        position=a.position,
        value=b.value - a.value,
    )


def _check_sizes(track: Track, sizes: Mapping[str, int], source: str) -> None:
    """Every interval of ``track`` lies inside its chromosome."""
    for contig in pd.unique(track.contig):
        if contig not in sizes:
            raise InputError(
                f"the chromosome sizes ({source}) lack {contig}, which track {track.name} covers; {_CHROM_SIZES_FIX}"
            )
    if len(track.position):
        limit = np.array([sizes[c] for c in track.contig], np.int64)  # [n]
        outside = np.flatnonzero(track.ends > limit)
        if outside.size:
            i = int(outside[0])
            raise InputError(
                f"{track.contig[i]}:{track.position[i] + 1} of track {track.name} lies beyond "
                f"{track.contig[i]}'s size {sizes[track.contig[i]]:,} ({source}); {_CHROM_SIZES_FIX}"
            )


def rename_to_sizes(track: Track, sizes: Mapping[str, int], source: str = "the store") -> Track:
    """``track`` with each chromosome named as ``sizes`` names it (the names the files are written with).

    The per-token table names chromosomes as the store looks them up (UCSC: ``chr20``); the sizes
    name them as the outputs should (the source FASTA's ``20``, or a ``--chrom-sizes`` file's own
    names). A name is matched exactly, else through the aliases (:func:`genolong.data.regions.resolve_name`).

    Raises:
        InputError: a chromosome of the track has no (or several) counterparts in ``sizes``.
    """
    mapping: dict[str, str] = {}
    for contig in pd.unique(track.contig):
        name = resolve_name(str(contig), sizes)
        if name is None:
            raise InputError(
                f"the chromosome sizes ({source}) lack {contig}, which track {track.name} covers; {_CHROM_SIZES_FIX}"
            )
        mapping[str(contig)] = name
    if all(k == v for k, v in mapping.items()):
        return track
    contig = np.array([mapping[c] for c in track.contig], dtype=object)
    return replace(track, contig=contig)


def restrict_track(track: Track, regions: Regions) -> Track:
    """The bases of a per-base ``track`` inside ``regions`` (keyed by the track's chromosome names).

    Raises:
        InputError: no scored base lies inside the regions.
    """
    keep = regions.contains(track.contig, track.position)
    if not keep.any():
        raise InputError(
            f"no scored base of track {track.name} lies inside --regions {regions.source} "
            f"({regions.bases:,} bases); give regions of the evaluated tiles"
        )
    return track.subset(keep)


def bin_track(track: Track, size: int, sizes: Mapping[str, int]) -> Track:
    """The mean value per bin of ``size`` bases: bins ``[k*size, (k+1)*size)`` of each chromosome,
    aligned to its start (as deepTools' ``--binSize``), the last one cut at the chromosome's end.

    A bin holding at least one value gets one interval over the whole bin (bases without a value
    inside it included), its value the float32 mean of the bin's values (summed in float64); a bin
    with none has no interval. ``size`` 1 returns the track as it is.

    Args:
        track: a per-base track (sorted by chromosome, then position).
        size: bin size in bases (>= 1).
        sizes: chromosome sizes (the track's names), to cut the last bin.

    Raises:
        InputError: ``size`` < 1.
    """
    if size < 1:
        raise InputError(f"--bin must be at least 1 base, got {size}")
    if size == 1 or not len(track.position):
        return track
    if track.end is not None:
        raise InputError(f"track {track.name} is binned already")
    bin_index = track.position // size  # [n]
    first = np.r_[True, (track.contig[1:] != track.contig[:-1]) | (bin_index[1:] != bin_index[:-1])]  # [n]
    starts = np.flatnonzero(first)  # [m] first row of each bin
    total = np.add.reduceat(track.value.astype(np.float64), starts)  # [m]
    count = np.diff(np.r_[starts, len(track.value)])  # [m]
    contig = track.contig[starts]
    begin = bin_index[starts] * size
    limit = np.array([sizes[c] for c in contig], np.int64)
    return replace(
        track,
        contig=contig,
        position=begin,
        end=np.minimum(begin + size, limit),
        bin_size=size,
        value=(total / count).astype(np.float32),
        title=f"{track.title} ({size:,}-base mean)",
        description=f"{track.description}; mean per {size:,}-base bin",
    )


def _runs(contig: np.ndarray) -> list[tuple[str, int, int]]:
    """``(name, first, stop)`` of each run of one chromosome in a sorted ``[n]`` array."""
    if not len(contig):
        return []
    cuts = np.flatnonzero(contig[1:] != contig[:-1]) + 1
    bounds = np.r_[0, cuts, len(contig)]
    return [(str(contig[s]), int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]


def _header_order(sizes: Mapping[str, int]) -> list[str]:
    """Chromosomes in byte order of their names: the order bedGraphToBigWig expects (``sort -k1,1``)."""
    return sorted(sizes, key=lambda name: name.encode())


def write_bigwig(path: str | os.PathLike[str], track: Track, sizes: Mapping[str, int]) -> None:
    """Write ``track`` as bigWig (:func:`genolong.evaluation.bigwig.write_bigwig_file`): one
    interval per value (per base, or per bin), float32, every chromosome of ``sizes`` in the header
    (byte order of the name), and zoom levels computed exactly from the values: each zoom bin's
    bases, minimum, maximum, sum and sum of squares are those of its bases (pyBigWig's and
    pybigtools' writers get them wrong; see that module).

    Raises:
        InputError: the track holds no value (a bigWig must hold one).
    """
    from .bigwig import write_bigwig_file

    if not len(track.position):
        raise InputError(f"track {track.name} holds no value; nothing to write")
    rank = {name: i for i, name in enumerate(_header_order(sizes))}
    runs = sorted(_runs(track.contig), key=lambda run: rank[run[0]])
    order = np.concatenate([np.arange(first, stop) for _, first, stop in runs])  # chromosomes in byte order
    write_bigwig_file(
        path,
        sizes,
        track.contig[order],
        track.position[order],
        track.ends[order],
        track.value[order],
        bin_size=track.bin_size,
    )


def write_bedgraph(path: str | os.PathLike[str], track: Track) -> None:
    """Write ``track`` as bedGraph: a UCSC ``track type=bedGraph`` line, then one
    ``chrom<TAB>start<TAB>end<TAB>value`` line per value (per base: about 35 bytes a base),
    sorted as ``sort -k1,1 -k2,2n`` sorts (chromosome names in byte order), each value the
    shortest decimal that reads back as the same float32."""
    rank = {name: i for i, name in enumerate(_header_order(dict.fromkeys(pd.unique(track.contig), 0)))}
    runs = sorted(_runs(track.contig), key=lambda run: rank[run[0]])
    ends = track.ends
    with open(path, "w") as handle:
        handle.write(
            f'track type=bedGraph name="{_quote(track.title)}" description="{_quote(track.description)}" '
            "visibility=full autoScale=on alwaysZero=on\n"
        )
        for name, first, stop in runs:
            # numpy's shortest float32 repr (reads back as the same float32), formatted in C: a
            # per-value "%.9g" in Python took 1.5x as long
            values = track.value[first:stop].astype(np.float32).astype(str)
            pd.DataFrame(
                {"chrom": name, "start": track.position[first:stop], "end": ends[first:stop], "value": values}
            ).to_csv(handle, sep="\t", header=False, index=False, lineterminator="\n")


def _quote(text: str) -> str:
    """Text for a double-quoted UCSC track-line value (no double quotes, one line)."""
    return " ".join(text.replace('"', "'").split())


def parse_formats(text: str) -> tuple[str, ...]:
    """``"bigwig,bedgraph"`` -> ``("bigwig", "bedgraph")`` (case-insensitive, each once).

    Raises:
        InputError: an unknown or repeated format, or none.
    """
    formats = tuple(f.strip().lower() for f in text.split(",") if f.strip())
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats or len(set(formats)) != len(formats):
        raise InputError(f"--formats {text!r}: give a comma-separated list of {', '.join(FORMATS)} (each once)")
    return formats


def write_tracks(
    out: str | os.PathLike[str],
    tracks: Sequence[Track],
    sizes: Mapping[str, int],
    sizes_source: str = "the store",
    formats: Sequence[str] = tuple(FORMATS),
) -> list[Path]:
    """Write every track as ``<stem>.bw`` and/or ``<stem>.bedGraph`` plus ``chrom.sizes`` into the
    directory ``out``, built in a hidden sibling and renamed into place (replacing ``out``).

    Args:
        out: the output directory (its parent must exist).
        tracks: the tracks (distinct stems), chromosomes named as ``sizes`` names them
            (:func:`rename_to_sizes`).
        sizes: chromosome name -> size; must hold every interval of every track.
        sizes_source: where the sizes came from, for errors.
        formats: which files to write (default both: ``("bigwig", "bedgraph")``).

    Returns:
        The written files, under ``out``.

    Raises:
        InputError: an interval outside ``sizes``, two tracks with one stem, an unknown format.
    """
    out = Path(out)
    stems = [t.stem for t in tracks]
    if len(set(stems)) != len(stems):
        raise InputError(f"two tracks would both be {out}/{stems[0]}.bw; give the results distinct labels")
    if not formats or any(f not in FORMATS for f in formats):
        raise InputError(f"formats {list(formats)}: give some of {', '.join(FORMATS)}")
    for track in tracks:
        _check_sizes(track, sizes, sizes_source)
    work = unique_sibling(out, "tmp")
    try:
        with writing(out, work=work):
            work.mkdir()
            (work / "chrom.sizes").write_text("".join(f"{n}\t{sizes[n]}\n" for n in _header_order(sizes)))
            for track in tracks:
                if "bigwig" in formats:
                    write_bigwig(work / f"{track.stem}.bw", track, sizes)
                if "bedgraph" in formats:
                    write_bedgraph(work / f"{track.stem}.bedGraph", track)
        replace_dir(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return sorted(out / p.name for p in out.iterdir())


def tracks_for_results(
    results: Sequence[EvalResult],
    sizes: Mapping[str, int] | None = None,
    store: str | os.PathLike[str] | None = None,
    regions: str | os.PathLike[str] | None = None,
    bin_size: int = 1,
) -> tuple[list[Track], dict[str, int], str]:
    """The tracks of one result (its loss) or two (A's and B's loss and ``B - A``) and the sizes to
    write them with, chromosomes named as the sizes name them.

    Args:
        results: ``[A]`` or ``[A, B]`` loaded from their directories (B compared with A: same tiles).
        sizes: chromosome sizes (a ``--chrom-sizes`` file or ``.fai`` read by :func:`read_chrom_sizes`);
            default None: from A's store (:func:`result_chrom_sizes`, the store's output names).
        store: the store directory instead of the one in A's meta.
        regions: a BED file (:func:`genolong.data.regions.read_bed`): keep only the bases inside
            (default None: every scored base).
        bin_size: mean per bin of this many bases (:func:`bin_track`; default 1: per base).

    Returns:
        ``(tracks, sizes, where the sizes came from)``.

    Raises:
        InputError: not one or two results, results of other tiles, no per-token table, no sizes,
            a region outside the sizes, no scored base inside the regions.
    """
    from .stats import check_comparable

    if len(results) not in (1, 2):
        raise InputError(f"tracks are of one result or of two (B - A), got {len(results)}")
    if bin_size < 1:
        raise InputError(f"--bin must be at least 1 base, got {bin_size}")
    if len(results) == 2:
        check_comparable(*results)
    source = "--chrom-sizes" if sizes is not None else f"the store of {results[0].source or results[0].label}"
    names = [track_name(r.label) for r in results]
    if len(names) == 2 and names[0] == names[1]:  # the same label twice: keep both files apart
        names = [f"{names[0]}.A", f"{names[1]}.B"]
    if sizes is None:
        sizes = result_chrom_sizes(results[0], store)
    found = read_bed(regions, sizes, where=source) if regions is not None else None  # before the tables are read
    tracks = [rename_to_sizes(result_track(r, name=n), sizes, source) for r, n in zip(results, names)]
    if len(results) == 2:
        tracks.append(difference_track(tracks[0], tracks[1], results[0].label, results[1].label))
    if found is not None:
        tracks = [restrict_track(t, found) for t in tracks]
    tracks = [bin_track(t, bin_size, sizes) for t in tracks]
    return tracks, dict(sizes), source


def write_result_tracks(directory: str | os.PathLike[str], result: EvalResult, sizes: Mapping[str, int]) -> list[Path]:
    """Write the loss track of the result saved in ``directory`` into ``directory/tracks``
    (``evaluate --tracks``; the directory is still the unfinished one, renamed afterwards).

    Args:
        directory: the result directory (with its ``tokens/``).
        result: the result saved there.
        sizes: chromosome sizes (:func:`chrom_sizes_from_contigs` of the evaluated split's contigs).

    Returns:
        The written files.
    """
    directory = Path(directory)
    for stale in directory.glob(f".{TRACKS_DIR}.tmp-*"):  # a write killed before a resumed evaluation
        shutil.rmtree(stale, ignore_errors=True)
    track = rename_to_sizes(result_track(result, directory), sizes, "the evaluated store")
    return write_tracks(directory / TRACKS_DIR, [track], sizes, "the evaluated store")

"""GenomeStore: the on-disk layout of a prepared genome, and its validating reader.

Layout (zarr v3, readable by any zarr v3 client)::

    DIR/manifest.json            written last; its presence marks a complete store
    DIR/<split>.zarr/            zarr group, one per split (e.g. train, eval)
        tokens                   1-D uint8 token ids (genolong.data.alphabet), all segments of the
                                 split back to back; chunks of 1 Mi tokens (a 1M-token window
                                 reads 2 chunks) inside shards of 64 Mi tokens (a chromosome is
                                 a handful of files); zstd, crc32c per chunk
        segments/{contig,start,end,offset}
                                 the segment table: int32 index into the group attribute
                                 ``contigs``, then int64 0-based half-open genomic coordinates and
                                 the segment's first index in ``tokens``

``split.tokens[offset + i]`` is the base at ``contig:start + i``. The manifest also lists every
file of the split groups with its size and sha256, so that :meth:`GenomeStore.open` refuses a
store that was damaged after it was written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from ..errors import StoreError

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "CHUNK_TOKENS",
    "SHARD_TOKENS",
    "SEGMENT_COLUMNS",
    "GenomeStore",
    "Split",
    "create_split_group",
    "write_segments",
    "file_digests",
    "sha256_file",
]

SCHEMA = "genolong.genome_store"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
CHUNK_TOKENS = 1 << 20  # 1 Mi tokens per chunk: a 1M window touches 2 chunks (zarr's per-chunk
# overhead made 256 Ki chunks write at 0.47x the raw compressor speed, 1 Mi chunks at 0.72x)
SHARD_TOKENS = 1 << 26  # 64 Mi tokens per shard file: chr1 (248 Mbp) is 4 files
SEGMENT_COLUMNS = ("contig", "start", "end", "offset")


def _token_compressors() -> list[Any]:
    # zstd level 1: 2.39 bits/base on real sequence, 228 MB/s to compress and 695 MB/s to
    # decompress per core (blosc-zstd level 1: 2.48 bits/base at 194 MB/s, and zarr wrote it at
    # 0.7x the speed); crc32c lets a reader detect a flipped byte.
    return [ZstdCodec(level=1), Crc32cCodec()]


def create_split_group(path: str | Path, contigs: list[str]) -> tuple[zarr.Group, zarr.Array]:
    """Create an empty split group with a zero-length ``tokens`` array.

    Args:
        path: the ``<split>.zarr`` directory to create (must not exist).
        contigs: contig names; the segment table indexes into this list.

    Returns:
        The open, writable zarr group and its ``tokens`` array, configured for fast writing (grow
        it with ``resize``, then assign shard-aligned blocks).
    """
    group = zarr.open_group(str(path), mode="w-", zarr_format=3)
    group.attrs.update({"contigs": list(contigs)})
    tokens = group.create_array(
        "tokens",
        shape=(0,),
        dtype="uint8",
        chunks=(CHUNK_TOKENS,),
        shards=(SHARD_TOKENS,),
        compressors=_token_compressors(),
        fill_value=0,
        # Tokens are never 0 (PAD), so no chunk is empty; skipping zarr's per-chunk "equals the
        # fill value?" check took writing from 180 to 334 MB/s.
        config={"write_empty_chunks": True},
    )
    return group, tokens


def write_segments(group: zarr.Group, segments: Sequence[tuple[str, int, int, int]]) -> None:
    """Write the segment table into a split group.

    Args:
        group: a group made by :func:`create_split_group`.
        segments: one ``(contig name, start, end, offset)`` row per segment, in token order.
    """
    names = list(group.attrs["contigs"])
    index = {name: i for i, name in enumerate(names)}
    sub = group.create_group("segments")
    numbers = np.array([row[1:] for row in segments], dtype=np.int64).reshape(-1, 3)
    columns = {
        "contig": np.array([index[row[0]] for row in segments], dtype=np.int32),
        "start": numbers[:, 0],
        "end": numbers[:, 1],
        "offset": numbers[:, 2],
    }
    for name, values in columns.items():
        array = sub.create_array(name, shape=values.shape, dtype=values.dtype, chunks=(max(1, len(values)),))
        if len(values):
            array[:] = values


def sha256_file(path: str | Path, block: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in blocks of ``block`` bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(
    root: str | Path, subdir: str, known: Mapping[str, tuple[int, int, str]] | None = None
) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``root/subdir``, keyed by path relative to ``root``.

    Args:
        root: the store directory.
        subdir: the folder below it to walk (e.g. ``train.zarr``).
        known: digests computed earlier, ``rel path -> (size, mtime_ns, sha256)``; reused for a
            file whose size and mtime still match.
    """
    root = Path(root)
    known = known or {}
    out: dict[str, dict[str, Any]] = {}
    for dirpath, _, filenames in os.walk(root / subdir):
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            rel = path.relative_to(root).as_posix()
            stat = path.stat()
            cached = known.get(rel)
            same = cached is not None and cached[:2] == (stat.st_size, stat.st_mtime_ns)
            out[rel] = {"size": stat.st_size, "sha256": cached[2] if same else sha256_file(path)}  # type: ignore[index]
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Split:
    """One split of a store (e.g. ``train`` or ``eval``).

    Attributes:
        name: the split's name.
        tokens: 1-D uint8 zarr array of token ids; slicing returns a numpy array.
        segments: DataFrame with columns contig (str), start, end, offset (int64), one row per
            segment, in token order. ``tokens[offset + i]`` is the base at ``contig:start + i``.
        contigs: per-contig records from the manifest (name, record, length, kept, n, ...).
    """

    name: str
    tokens: zarr.Array
    segments: pd.DataFrame
    contigs: tuple[Mapping[str, Any], ...]

    @property
    def n_tokens(self) -> int:
        """Number of tokens in the split."""
        return int(self.tokens.shape[0])

    @property
    def segment_lengths(self) -> np.ndarray:
        """``[num_segments]`` int64 segment lengths."""
        return (self.segments["end"] - self.segments["start"]).to_numpy(dtype=np.int64)

    def fetch(self, contig: str, start: int, end: int) -> np.ndarray:
        """Token ids of ``contig:[start, end)`` (0-based, half-open), inside one segment.

        Raises:
            StoreError: if the interval is not inside one segment of this split.
        """
        seg = self.segments
        hit = seg[(seg["contig"] == contig) & (seg["start"] <= start) & (seg["end"] >= end)]
        if hit.empty or end < start:
            raise StoreError(
                f"{contig}:{start}-{end} is not inside one segment of split {self.name!r}; "
                "see split.segments for the kept intervals"
            )
        row = hit.iloc[0]
        first = int(row["offset"]) + start - int(row["start"])
        return np.asarray(self.tokens[first : first + end - start])


class GenomeStore:
    """A prepared genome: a manifest and one zarr group per split.

    Open with :meth:`open`, which validates the manifest, the arrays and (by default) every file's
    sha256 against the manifest.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], splits: dict[str, Split]):
        self.path = path
        self.manifest = manifest
        self._splits = splits

    @classmethod
    def open(cls, path: str | os.PathLike[str], verify: bool = True) -> GenomeStore:
        """Open and validate a store.

        Args:
            path: the store directory (the ``--out`` of ``genolong prepare``).
            verify: also compare every file's sha256 with the manifest (reads each file once;
                about 0.3 s for chr1 + chr2 + chr22). Sizes are always compared.

        Raises:
            StoreError: naming what is missing, damaged or of another schema version, and the fix.
        """
        store = cls._load(Path(path), MANIFEST_NAME, verify)
        assert store is not None
        return store

    @classmethod
    def _load(cls, root: Path, manifest_name: str, verify: bool, build: bool = True) -> GenomeStore | None:
        """Open ``root`` reading its manifest from ``manifest_name`` (prepare verifies a store
        under a temporary manifest name, so that it never looks complete before its rename).
        With ``build=False`` only validate, and return None."""
        fix = f"re-run `genolong prepare ... --out {root} --force`"
        manifest_path = root / manifest_name
        if not root.is_dir():
            raise StoreError(
                f"genome store {root} does not exist; create it with `genolong prepare FASTA --out {root}`"
            )
        if not manifest_path.is_file():
            raise StoreError(
                f"genome store {root} is incomplete: {MANIFEST_NAME} is missing (an interrupted prepare?); {fix}"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"genome store {root}: {MANIFEST_NAME} is not valid JSON ({exc}); {fix}") from None
        if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
            raise StoreError(f"{manifest_path} is not a genolong genome store manifest; {fix}")
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"genome store {root} has schema version {version!r}, this genolong reads version "
                f"{SCHEMA_VERSION}; {fix}"
            )
        try:
            files = manifest["files"]
            split_meta = manifest["splits"]
        except KeyError as exc:
            raise StoreError(f"{manifest_path} lacks the key {exc}; {fix}") from None
        for rel, meta in files.items():
            file = root / rel
            if not file.is_file():
                raise StoreError(f"genome store {root} is damaged: {rel} is missing; {fix}")
            if file.stat().st_size != meta["size"]:
                raise StoreError(
                    f"genome store {root} is damaged: {rel} has {file.stat().st_size} bytes, the manifest says {meta['size']}; {fix}"
                )
            if verify and sha256_file(file) != meta["sha256"]:
                raise StoreError(
                    f"genome store {root} is damaged: {rel} does not match its sha256 in the manifest; {fix}"
                )
        splits = {name: cls._open_split(root, name, meta, fix, build) for name, meta in split_meta.items()}
        return cls(root, manifest, splits) if build else None  # type: ignore[arg-type]

    @staticmethod
    def _open_split(root: Path, name: str, meta: Mapping[str, Any], fix: str, build: bool = True) -> Split | None:
        group_path = root / meta["path"]
        try:
            group = zarr.open_group(str(group_path), mode="r", zarr_format=3)
            tokens = group["tokens"]
            names = list(group.attrs["contigs"])
            columns = {c: np.asarray(group["segments"][c][:]) for c in SEGMENT_COLUMNS}
        except Exception as exc:  # zarr raises many types for a broken group
            raise StoreError(
                f"genome store {root}: split {name!r} ({meta['path']}) cannot be read ({type(exc).__name__}: {exc}); {fix}"
            ) from None
        if not isinstance(tokens, zarr.Array) or tokens.dtype != np.uint8 or tokens.ndim != 1:
            raise StoreError(f"genome store {root}: {meta['path']}/tokens is not a 1-D uint8 array; {fix}")
        if tokens.shape[0] != meta["tokens"]:
            raise StoreError(
                f"genome store {root}: {meta['path']}/tokens has {tokens.shape[0]} tokens, the manifest says {meta['tokens']}; {fix}"
            )
        try:
            contig_names = [names[i] for i in columns["contig"]]
        except IndexError:
            raise StoreError(
                f"genome store {root}: the segment table of split {name!r} names an unknown contig; {fix}"
            ) from None
        start, end, offset = (columns[c].astype(np.int64) for c in ("start", "end", "offset"))
        expected = meta["segments"]
        expected_numbers = np.array([row[1:] for row in expected], dtype=np.int64).reshape(-1, 3)
        if (
            contig_names != [row[0] for row in expected]
            or expected_numbers.shape[0] != start.size
            or not np.array_equal(expected_numbers, np.stack([start, end, offset], axis=1))
        ):
            raise StoreError(
                f"genome store {root}: the segment table of split {name!r} disagrees with the manifest; {fix}"
            )
        lengths = end - start
        if start.size and (
            (lengths <= 0).any()
            or offset[0] != 0
            or (offset[1:] != np.cumsum(lengths)[:-1]).any()
            or int(lengths.sum()) != tokens.shape[0]
        ):
            raise StoreError(
                f"genome store {root}: the segment table of split {name!r} does not tile its tokens; {fix}"
            )
        if not build:
            return None
        import pandas as pd  # only readers need the frame (prepare verifies without importing pandas)

        segments = pd.DataFrame(
            {"contig": pd.Series(contig_names, dtype=object), "start": start, "end": end, "offset": offset}
        )
        return Split(name=name, tokens=tokens, segments=segments, contigs=tuple(meta["contigs"]))

    @property
    def splits(self) -> tuple[str, ...]:
        """Split names in manifest order, e.g. ``("train", "eval")``."""
        return tuple(self._splits)

    def split(self, name: str) -> Split:
        """One split by name.

        Raises:
            StoreError: if the store has no such split (the message lists those it has).
        """
        try:
            return self._splits[name]
        except KeyError:
            raise StoreError(
                f"genome store {self.path} has no split {name!r}; it has {', '.join(self._splits) or 'none'}"
            ) from None

    def __iter__(self) -> Iterator[Split]:
        return iter(self._splits.values())

    def summary(self) -> pd.DataFrame:
        """One row per (split, contig): length, kept bases, N, soft-masked, ambiguity codes,
        segments and dropped bases."""
        rows = []
        for split in self:
            for contig in split.contigs:
                rows.append(
                    {"split": split.name, **{k: v for k, v in contig.items() if not isinstance(v, (list, dict))}}
                )
        import pandas as pd

        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s.name}={s.n_tokens:,}" for s in self)
        return f"GenomeStore({str(self.path)!r}, {sizes})"

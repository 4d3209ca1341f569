"""FASTA -> GenomeStore: ``genolong prepare``.

The pipeline streams each input (see :mod:`genolong.data.fasta`), encodes bases to token ids,
splits chromosomes into segments at long N runs, and writes one zarr group per split into a
temporary directory beside the output. Shards are compressed and written by a background thread
while the next block is being encoded. After every array is written and fsynced, the manifest is
written, the temporary store is opened and verified, and only then renamed into place.

Why ``min_gap = 1000`` by default: assembly gaps of unknown size are written as 100 N in
GRCh38/hg38 and stay inside a segment (a window may span them; N tokens never count in the loss,
and they cost at most 0.1% of a 1M-token window). Telomeres (10 kb), clone and contig gaps
(typically 50 kb) and centromeres (Mb) are at least 1 kb and split the chromosome: the distance
across them is unknown or the sequence is missing, so context across them would be fiction.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..defaults import DEFAULT_MIN_GAP, DEFAULT_SPLITS
from ..errors import InputError
from ..files import fsync, fsync_tree, writing
from ..units import format_bytes
from .alphabet import BASE_MASK, SOFTMASK, STORE_ALPHABET, N
from .fasta import BLOCK_BYTES, RecordInfo, SequenceSource, open_source
from .names import canonical_name, source_name
from .store import (
    CHUNK_TOKENS,
    MANIFEST_NAME,
    SCHEMA,
    SCHEMA_VERSION,
    SHARD_TOKENS,
    GenomeStore,
    create_split_group,
    file_digests,
    sha256_file,
    write_segments,
)

__all__ = ["DEFAULT_MIN_GAP", "DEFAULT_SPLITS", "NAMES", "PrepareResult", "prepare_genome", "format_summary"]

#: ``--names``: which chromosome names a store's outputs use. ``source``: the input's own (``20``
#: stays ``20``); ``ucsc``: the UCSC form (``chr20``). Either way every alias finds the chromosome.
NAMES = ("source", "ucsc")


#: Tokens a split writer stages before handing them to the writer thread: a quarter shard (16 whole
#: chunks), so that compression overlaps encoding even when a split is under one shard (64 Mi
#: tokens; a 66 Mbp chromosome was encoded whole and only then compressed). zarr rewrites a shard
#: file on each partial write (copying the chunks already in it, not recompressing them), and a
#: shard is hashed once, when complete.
FLUSH_TOKENS = SHARD_TOKENS // 4
assert FLUSH_TOKENS % CHUNK_TOKENS == 0 and SHARD_TOKENS % FLUSH_TOKENS == 0

_TMP_MARK = ".genolong-tmp-"
_OLD_MARK = ".genolong-old-"
_PARTIAL_MANIFEST = MANIFEST_NAME + ".partial"


@dataclass
class _ContigStats:
    """What one record contributed to a split."""

    name: str
    record: str
    source: str
    start: int  # genomic coordinate of the record's first base
    output_name: str = ""  # the name outputs (tracks) use: the record's own, or the UCSC one (--names)
    length: int = 0
    kept: int = 0
    n: int = 0
    softmasked: int = 0
    ambiguous: int = 0
    dropped: int = 0
    gaps: int = 0
    segments: int = 0
    seconds: float = 0.0
    raw_bytes: int = 0

    def as_manifest(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "output_name": self.output_name or self.name,
            "record": self.record,
            "source": self.source,
            "start": self.start,
            "length": self.length,
            "kept": self.kept,
            "n": self.n,
            "softmasked": self.softmasked,
            "ambiguous": self.ambiguous,
            "dropped": self.dropped,
            "gaps": self.gaps,
            "segments": self.segments,
        }


class _SplitWriter:
    """Appends one split's kept tokens to its zarr array and cuts segments at long N runs.

    Tokens are staged in a buffer of :data:`FLUSH_TOKENS`; each full buffer is written by the
    shared writer thread while the caller keeps encoding into the other buffer. A shard is fsynced
    and hashed once complete (the writer thread) or at :meth:`close` (the last, partial one).
    """

    def __init__(self, path: Path, min_gap: int, executor: concurrent.futures.Executor):
        self.path = path
        self.min_gap = min_gap
        self.executor = executor
        self.group, self.array = create_split_group(path, contigs=[])
        self.buffers = [np.empty(FLUSH_TOKENS, dtype=np.uint8) for _ in range(2)]
        self.pending_write: list[concurrent.futures.Future[None] | None] = [None, None]
        self.active = 0
        self.fill = 0
        self.flushed = 0  # tokens handed to the writer
        self.segments: list[tuple[str, int, int, int]] = []
        self.contigs: list[_ContigStats] = []
        self.digests: dict[str, tuple[int, int, str]] = {}  # shard files hashed by the writer
        # per-contig state
        self._stats: _ContigStats | None = None
        self._pos = 0  # record position of the next incoming token
        self._seg_start: int | None = None  # record position where the open segment starts
        self._seg_offset = 0
        self._emitted_end = 0
        self._pending_start: int | None = None  # record position where a trailing N run starts
        self._pending_len = 0
        self._pending_tokens: list[np.ndarray] = []

    # -- token sink ------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.flushed + self.fill

    def _write(self, data: np.ndarray, start: int) -> None:
        """Write ``data`` at ``start`` (chunk-aligned); then fsync and hash the shard files it
        completed, here on the writer thread rather than at the end on the main one."""
        end = start + data.size
        if self.array.shape[0] < end:
            self.array.resize((end,))
        self.array[start:end] = data
        for shard in range(start // SHARD_TOKENS, end // SHARD_TOKENS):  # complete shards only: no later rewrite
            self._digest(shard)

    def _digest(self, shard: int) -> None:
        """fsync shard file ``shard`` and record its size, mtime and SHA-256 for the manifest."""
        path = self.path / "tokens" / "c" / str(shard)  # zarr v3 default chunk key encoding
        if path.is_file():
            fsync(path)
            stat = path.stat()
            rel = f"{self.path.name}/tokens/c/{shard}"
            self.digests[rel] = (stat.st_size, stat.st_mtime_ns, sha256_file(path))

    def _flush(self) -> None:
        buf = self.buffers[self.active][: self.fill]
        self.pending_write[self.active] = self.executor.submit(self._write, buf, self.flushed)
        self.flushed += self.fill
        self.fill = 0
        self.active ^= 1
        previous = self.pending_write[self.active]
        if previous is not None:  # the other buffer must be on disk before we refill it
            previous.result()
            self.pending_write[self.active] = None

    def _append(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(tokens.size, FLUSH_TOKENS - self.fill)
            self.buffers[self.active][self.fill : self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == FLUSH_TOKENS:
                self._flush()

    # -- segments --------------------------------------------------------------------------------
    def begin(self, stats: _ContigStats) -> None:
        self._stats = stats
        self._pos = 0
        self._seg_start = None
        self._pending_start = None
        self._pending_len = 0
        self._pending_tokens = []

    def _emit(self, tokens: np.ndarray, pos: int, has_n: bool = True) -> None:
        """Keep ``tokens`` (record positions ``pos``...) in the open segment, opening one if needed.

        ``has_n=False`` promises that no token is N, which skips two passes.
        """
        stats = self._stats
        assert stats is not None
        if tokens.size == 0:
            return
        is_n = (tokens & BASE_MASK) == N if has_n else None
        if self._seg_start is None:  # a segment never starts with N: trim them
            lead = int(np.argmin(is_n)) if is_n is not None else 0
            if is_n is not None and is_n[lead]:  # all N
                stats.dropped += tokens.size
                return
            stats.dropped += lead
            tokens, pos = tokens[lead:], pos + lead
            is_n = is_n[lead:] if is_n is not None else None
            self._seg_start, self._seg_offset = pos, self.total
        if is_n is not None:
            stats.n += int(np.count_nonzero(is_n))
        stats.softmasked += int(np.count_nonzero(tokens >= SOFTMASK))
        stats.kept += tokens.size
        self._append(tokens)
        self._emitted_end = pos + tokens.size

    def _close_segment(self) -> None:
        if self._seg_start is None:
            return
        stats = self._stats
        assert stats is not None
        self.segments.append(
            (stats.name, stats.start + self._seg_start, stats.start + self._emitted_end, self._seg_offset)
        )
        stats.segments += 1
        self._seg_start = None

    def _resolve_pending(self, at_contig_end: bool = False) -> None:
        """The trailing N run has ended (a base followed it, or the contig ended): keep or drop it."""
        stats = self._stats
        assert stats is not None
        if self._pending_start is None:
            return
        length = self._pending_len
        if self._seg_start is None or at_contig_end or length >= self.min_gap:
            stats.dropped += length  # leading, trailing, or a gap
            if self._seg_start is not None and not at_contig_end:
                stats.gaps += 1
                self._close_segment()
        else:
            for piece in self._pending_tokens:  # a short run stays inside the segment as N tokens
                self._emit(piece, self._pending_start)
                self._pending_start += piece.size
        self._pending_start = None
        self._pending_len = 0
        self._pending_tokens = []

    def feed(self, tokens: np.ndarray, has_n: bool = True) -> None:
        """Add the next tokens of the current contig.

        Args:
            tokens: ``[L]`` uint8 token ids.
            has_n: False promises that no token is N (skips the N-run search).
        """
        m = tokens.size
        if m == 0:
            return
        p0 = self._pos
        self._pos += m
        if has_n:
            is_n = (tokens & BASE_MASK) == N
            change = np.flatnonzero(is_n[1:] != is_n[:-1]) + 1
            edges = np.concatenate(([0] if is_n[0] else [], change, [m] if is_n[-1] else [])).astype(np.int64)
            starts, ends = edges[0::2], edges[1::2]  # N runs [starts[i], ends[i]) in block coordinates
            has_n = starts.size > 0
        if not has_n:
            if self._pending_start is not None:
                self._resolve_pending()
            self._emit(tokens, p0, has_n=False)
            return
        cursor = 0
        i = 0
        if self._pending_start is not None:
            if starts.size and starts[0] == 0:
                if ends[0] == m:  # the whole block continues the pending run
                    self._extend_pending(tokens)
                    return
                self._extend_pending(tokens[: ends[0]])
                cursor = int(ends[0])
                i = 1
            self._resolve_pending()
        last = starts.size
        open_run = last > i and ends[-1] == m
        if open_run:
            last -= 1
        long_runs = np.flatnonzero(ends[i:last] - starts[i:last] >= self.min_gap) + i
        for j in long_runs:
            s, e = int(starts[j]), int(ends[j])
            if s > cursor:
                self._emit(tokens[cursor:s], p0 + cursor)
            self._stats.dropped += e - s  # type: ignore[union-attr]
            if self._seg_start is not None:
                self._stats.gaps += 1  # type: ignore[union-attr]
            self._close_segment()
            cursor = e
        if open_run:
            s = int(starts[-1])
            if s > cursor:
                self._emit(tokens[cursor:s], p0 + cursor)
            self._pending_start = p0 + s
            self._extend_pending(tokens[s:])
        elif cursor < m:
            self._emit(tokens[cursor:], p0 + cursor)

    def _extend_pending(self, run: np.ndarray) -> None:
        if self._pending_start is None:
            self._pending_start = self._pos - run.size
        # Only a run shorter than min_gap can end up kept, so nothing beyond that is buffered.
        if self._pending_len < self.min_gap:
            self._pending_tokens.append(run[: self.min_gap - self._pending_len].copy())
        self._pending_len += run.size

    def end(self) -> _ContigStats:
        """Finish the current contig (trailing N are dropped) and return its statistics."""
        stats = self._stats
        assert stats is not None
        self._resolve_pending(at_contig_end=True)
        self._close_segment()
        stats.length = self._pos
        assert stats.kept + stats.dropped == stats.length, (stats.kept, stats.dropped, stats.length)
        self.contigs.append(stats)
        self._stats = None
        return stats

    def close(self) -> dict[str, Any]:
        """Write the last partial shard and the segment table; returns the split's manifest entry."""
        if self.fill:
            self._flush()
        for future in self.pending_write:
            if future is not None:
                future.result()
        self.pending_write = [None, None]
        if self.array.shape[0] != self.flushed:
            self.array.resize((self.flushed,))
        if self.flushed % SHARD_TOKENS:  # the last shard is partial: the writer left it to be hashed here
            self._digest(self.flushed // SHARD_TOKENS)
        names = list(dict.fromkeys(c.name for c in self.contigs))
        self.group.attrs.update({"contigs": names})
        write_segments(self.group, self.segments)
        self.buffers = []
        return {
            "path": self.path.name,
            "tokens": self.flushed,
            "dropped": sum(c.dropped for c in self.contigs),
            "contigs": [c.as_manifest() for c in self.contigs],
            "segments": [list(s) for s in self.segments],
        }


@dataclass
class PrepareResult:
    """What :func:`prepare_genome` made.

    Attributes:
        path: the store directory.
        manifest: the manifest written into it.
        seconds: wall time.
        input_bytes: bytes of all input files.
        contigs: one dict per contig: split, name, record, source, start, length, kept, n,
            softmasked, ambiguous, dropped, gaps, segments, seconds, raw_bytes.
    """

    path: Path
    manifest: dict[str, Any]
    seconds: float
    input_bytes: int
    contigs: list[dict[str, Any]] = field(default_factory=list)


def _parse_names(names: Sequence[str] | str) -> list[str]:
    if isinstance(names, str):
        names = [n for n in names.split(",")]
    out = [n.strip() for n in names]
    if any(not n for n in out):
        raise InputError(
            f"empty chromosome name in {','.join(names)!r}; give names separated by commas, e.g. chr1,chr2"
        )
    return out


def _cleanup_stale(out: Path) -> None:
    """Remove temporary directories left by killed runs for the same output."""
    for mark in (_TMP_MARK, _OLD_MARK):
        for leftover in out.parent.glob(f".{out.name}{mark}*"):
            pid_text = leftover.name.rsplit(mark, 1)[-1].split("-", 1)[0]
            try:
                os.kill(int(pid_text), 0)
                continue  # its run is alive
            except (ValueError, ProcessLookupError):
                shutil.rmtree(leftover, ignore_errors=True)
            except PermissionError:
                continue
    # a run killed between the final renames leaves DIR with the partial manifest only
    if (out / _PARTIAL_MANIFEST).is_file() and not (out / MANIFEST_NAME).exists():
        shutil.rmtree(out, ignore_errors=True)


def _is_store(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST_NAME).read_text()).get("schema") == SCHEMA
    except (OSError, ValueError, AttributeError):
        return False


class _Progress:
    """A per-chromosome tqdm bar on a terminal; silent otherwise."""

    def __init__(self, enabled: bool | None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.bar: Any = None

    def start(self, label: str, total: int | None) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, desc=label, unit="b", unit_scale=True, unit_divisor=1000, leave=True, file=sys.stderr
        )

    def update(self, bases: int) -> None:
        if self.bar is not None:
            self.bar.update(bases)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def prepare_genome(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    train: Sequence[str] | str = DEFAULT_SPLITS["train"],
    eval: Sequence[str] | str = DEFAULT_SPLITS["eval"],  # noqa: A002 - the split is called eval
    min_gap: int = DEFAULT_MIN_GAP,
    force: bool = False,
    progress: bool | None = None,
    block_bytes: int = BLOCK_BYTES,
    names: str = "source",
) -> PrepareResult:
    """Build a genome store from FASTA (or GenBank/EMBL) files.

    Args:
        inputs: one or more sequence files (plain/gzip/bgzip FASTA, GenBank, EMBL).
        out: the store directory to create.
        train: chromosomes of the train split, in any naming convention (default chr1, chr2).
        eval: chromosomes of the held-out split (default chr22).
        min_gap: N runs at least this long split a chromosome into segments and are dropped;
            shorter runs stay as N tokens (default 1000; see the module docstring).
        force: replace an existing store at ``out``.
        progress: show a progress bar (default: when stderr is a terminal).
        block_bytes: input bytes handled per step (default 2 MiB; small values only for tests).
        names: the chromosome names the store's outputs use, recorded per contig as
            ``output_name`` (:data:`NAMES`; default ``"source"``: the record's name without a
            ``:START-END`` suffix, ``20`` for ``>20``; ``"ucsc"``: ``chr20``). The store looks
            chromosomes up by their UCSC ``name`` and every alias either way.

    Returns:
        A :class:`PrepareResult`.

    Raises:
        InputError: bad arguments or input data; nothing is left at ``out``.
    """
    started = time.perf_counter()
    out = Path(out)
    paths = [Path(p) for p in inputs]
    if not paths:
        raise InputError("no input files; give at least one FASTA file")
    if min_gap < 1:
        raise InputError(f"--min-gap must be at least 1, got {min_gap}")
    if names not in NAMES:
        raise InputError(f"--names must be one of {', '.join(NAMES)}, got {names!r}")
    requested = {"train": _parse_names(train), "eval": _parse_names(eval)}
    assignment: dict[str, str] = {}
    for split, listed in requested.items():
        for name in listed:
            canon = canonical_name(name)
            if canon in assignment:
                other = assignment[canon]
                if other != split:
                    shown = name if name == canon else f"{name} ({canon})"
                    raise InputError(
                        f"{shown} is in both --{other} and --{split}; a chromosome may be in one split only"
                    )
                raise InputError(f"{name} is listed twice in --{split}; list each chromosome once")
            assignment[canon] = split
    sources: list[SequenceSource] = [open_source(p, block_bytes) for p in paths]  # validates each file's format
    if len(set(p.resolve() for p in paths)) != len(paths):
        raise InputError("the same input file is given twice; give each file once")

    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory; choose another path")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"--out {out}: the parent directory {parent} does not exist; create it first")
    _cleanup_stale(out)
    if out.exists():
        if not force:
            raise InputError(f"--out {out} already exists; pass --force to replace it or choose another path")
        if not _is_store(out):
            raise InputError(
                f"--out {out} exists and is not a genolong genome store; refusing to replace it, even with --force"
            )

    tmp = parent / f".{out.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise InputError(
            f"--out {out}: cannot create a directory in {parent} ({exc.strerror}); choose a writable location"
        ) from None
    # Hash the inputs on a side thread (hashlib releases the GIL) while the main thread encodes.
    hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="genolong-sha256")
    source_digests = [hasher.submit(sha256_file, p) for p in paths]
    hasher.shutdown(wait=False)
    try:
        # a full disk or a file-size limit: one error naming --out and the store's expected size
        with writing(out, needed=_expected_store_bytes(paths), work=tmp):
            manifest, stats = _build(tmp, sources, paths, requested, assignment, min_gap, progress, names)
            for entry, digest in zip(manifest["sources"], source_digests):
                entry["sha256"] = digest.result()
            fsync_tree(tmp)
            partial = tmp / _PARTIAL_MANIFEST
            partial.write_text(json.dumps(manifest, indent=1))
            fsync(partial)
            fsync(tmp)
            # Verify under the temporary manifest name: until the last rename nothing opens as a store.
            # The file digests were just computed from these files, so structure and sizes suffice.
            GenomeStore._load(tmp, _PARTIAL_MANIFEST, verify=False, build=False)
            old = None
            if out.exists():
                old = parent / f".{out.name}{_OLD_MARK}{os.getpid()}-{secrets.token_hex(4)}"
                out.rename(old)
            tmp.rename(out)
            (out / _PARTIAL_MANIFEST).rename(out / MANIFEST_NAME)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        for digest in source_digests:
            digest.cancel()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - started
    frame = [{"split": split, **s.as_manifest(), "seconds": s.seconds, "raw_bytes": s.raw_bytes} for split, s in stats]
    input_bytes = sum(p.stat().st_size for p in paths)
    return PrepareResult(path=out, manifest=manifest, seconds=seconds, input_bytes=input_bytes, contigs=frame)


def _expected_store_bytes(paths: list[Path]) -> int:
    """About the bytes of the store built from ``paths``: zstd stores a base in about 2.4 bits, about
    what gzip spends on a FASTA base (the sample: 2.18 MB of gzip, a 2.20 MB store), and a third of a
    plain text file's byte per base (with its newlines)."""
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        size = path.stat().st_size
        total += size if gzipped else size * 3 // 10
    return total


def _build(
    tmp: Path,
    sources: list[SequenceSource],
    paths: list[Path],
    requested: dict[str, list[str]],
    assignment: dict[str, str],
    min_gap: int,
    progress: bool | None,
    name_style: str = "source",
) -> tuple[dict[str, Any], list[tuple[str, _ContigStats]]]:
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="genolong-write")
    writers = {split: _SplitWriter(tmp / f"{split}.zarr", min_gap, executor) for split in requested}
    seen: dict[str, RecordInfo] = {}
    found: dict[str, RecordInfo] = {}
    stats: list[tuple[str, _ContigStats]] = []
    bar = _Progress(progress)

    def check_record(info: RecordInfo) -> bool:
        contig = info.region.contig
        if contig in seen:
            first = seen[contig]
            same = "" if first.name == info.name else f" (both are {contig})"
            raise InputError(f"duplicate record: {info.where()} and {first.where()}{same}; keep one of them")
        seen[contig] = info
        return contig in assignment

    try:
        for source in sources:
            for info, blocks in source.records(check_record):
                if blocks is None:
                    continue
                split = assignment[info.region.contig]
                writer = writers[split]
                output = source_name(info.name) if name_style == "source" else info.region.contig
                contig = _ContigStats(
                    name=info.region.contig,
                    record=info.name,
                    source=source.path.name,
                    start=info.region.start,
                    output_name=output,
                )
                t0 = time.perf_counter()
                bar.start(f"{split}:{contig.name}", info.length)
                writer.begin(contig)
                for block in blocks:
                    contig.ambiguous += block.ambiguous
                    contig.raw_bytes += block.raw_bytes
                    writer.feed(block.tokens, block.has_n)
                    bar.update(block.tokens.size)
                writer.end()
                bar.stop()
                if info.region.length is not None and info.region.length != contig.length:
                    raise InputError(
                        f"{info.where()}: the name says {info.region.length:,} bases but the record has "
                        f"{contig.length:,}; fix the name or the sequence"
                    )
                contig.seconds = time.perf_counter() - t0
                found[info.region.contig] = info
                stats.append((split, contig))
        missing = [name for names in requested.values() for name in names if canonical_name(name) not in found]
        if missing:
            have = sorted({i.name for s in sources for i in s.names})
            shown = ", ".join(have[:40]) + (f", ... ({len(have)} records)" if len(have) > 40 else "")
            raise InputError(
                f"{', '.join(missing)} not found in {', '.join(str(p) for p in paths)}; the input has: {shown}"
            )
        splits = {split: writers[split].close() for split in requested}
    finally:
        bar.stop()
        executor.shutdown(wait=True)
    files: dict[str, Any] = {}
    for split in requested:
        files.update(file_digests(tmp, f"{split}.zarr", writers[split].digests))
    from .. import __version__  # read here, not at import: importlib.metadata slows every command's startup

    manifest = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "genolong_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sources": [
            {"name": p.name, "path": str(p.resolve()), "size": p.stat().st_size, "sha256": None, "format": s.kind}
            for p, s in zip(paths, sources)
        ],
        "alphabet": {str(k): v for k, v in STORE_ALPHABET.items()},
        "softmask_flag": SOFTMASK,
        "min_gap": min_gap,
        "names": name_style,
        "chunk_tokens": CHUNK_TOKENS,
        "shard_tokens": SHARD_TOKENS,
        "requested": requested,
        "unused_records": [i.name for i in seen.values() if i.region.contig not in assignment],
        "splits": splits,
        "files": files,
    }
    return manifest, stats


def format_summary(result: PrepareResult) -> str:
    """A human-readable table of what :func:`prepare_genome` kept and dropped."""
    columns = ("length", "kept", "n", "softmasked", "ambiguous", "dropped", "segments")
    rows = [
        [
            c["split"],
            c["name"],
            *(f"{c[k]:,}" for k in columns),
            f"{c['seconds']:.2f}",
            f"{c['length'] / max(c['seconds'], 1e-9) / 1e6:,.1f}",
        ]
        for c in result.contigs
    ]
    if not rows:
        return "(no contigs)"
    seconds = sum(c["seconds"] for c in result.contigs)
    length = sum(c["length"] for c in result.contigs)
    rows.append(
        [
            "all",
            "",
            *(f"{sum(c[k] for c in result.contigs):,}" for k in columns),
            f"{seconds:.2f}",
            f"{length / max(seconds, 1e-9) / 1e6:,.1f}",
        ]
    )
    header = ["split", "name", *columns, "seconds", "Mbp/s"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in [header, *rows]]
    rate = result.input_bytes / max(result.seconds, 1e-9)
    lines += [
        "",
        f"store {result.path}: {format_bytes(result.input_bytes)} of input in {result.seconds:.2f} s ({format_bytes(rate)}/s); "
        f"min_gap {result.manifest['min_gap']:,}",
    ]
    unused = result.manifest.get("unused_records", [])
    if unused:
        lines.append(
            f"{len(unused)} record(s) not in any split: {', '.join(unused[:10])}{' ...' if len(unused) > 10 else ''}"
        )
    return "\n".join(lines)

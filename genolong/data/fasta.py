"""Sequence readers: stream records from FASTA (plain, gzip, bgzip; indexed or not), GenBank and EMBL.

Every reader yields, per record, its :class:`RecordInfo` and an iterator of encoded blocks: uint8
token ids (``genolong.data.alphabet``), case kept, IUPAC ambiguity codes already turned into N.
Readers validate what they read and raise :class:`genolong.errors.InputError` with a one-line
message naming the file, the record, the line and the fix.

- Plain or gzip-compressed FASTA (UCSC's ``hg38.fa.gz`` is plain gzip) is streamed: decompressed
  by python-isal in a background thread, never to disk, in blocks of a few MiB; line breaks are
  removed and bytes mapped to token ids in one C pass (``bytes.translate``); the line layout is
  checked with vectorised numpy on the newline positions.
- bgzip FASTA with its ``.fai`` and ``.gzi`` (or plain FASTA with a ``.fai``) is read by random
  access: only the requested chromosomes are decompressed (python-isal, from the bgzip member
  that holds each record's first base) and then checked like a streamed file. The index is checked
  against the file before it is trusted.
- GenBank and EMBL (optionally gzipped) go through Biopython's ``SeqIO``.
"""

from __future__ import annotations

import bisect
import gzip
import io
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import InputError
from .alphabet import AMBIGUOUS, ENCODE_LUT, ENCODE_TABLE, INVALID, SOFTMASK, N, resolve_ambiguous
from .names import Region, parse_record_name

__all__ = [
    "BLOCK_BYTES",
    "RecordInfo",
    "EncodedBlock",
    "SequenceSource",
    "detect_format",
    "open_source",
]

#: Bytes of decompressed input handled per step. 2 MiB keeps a block in cache across the passes
#: over it (translate, N search, soft-mask count, copy): 500 Mbp prepared in 3.05 s against 3.55 s
#: with 8 MiB blocks (2 cores, whole command).
BLOCK_BYTES = 1 << 21

_GZIP_MAGIC = b"\x1f\x8b"
_FIX_WRAP = "re-wrap it to one width, e.g. `samtools faidx` or `seqkit seq -w 60`"


@dataclass(frozen=True)
class RecordInfo:
    """One sequence record of an input file.

    Attributes:
        name: the record name (first word of the FASTA header; the id of a GenBank/EMBL record).
        description: the rest of the header line.
        region: chromosome and coordinates the name implies (:func:`parse_record_name`).
        source: the file it came from.
        line: 1-based line number of its header, where known.
        length: its length in bases, where known before reading (indexed input), else ``None``.
    """

    name: str
    description: str
    region: Region
    source: Path
    line: int | None = None
    length: int | None = None

    def where(self) -> str:
        """``file: record 'name' (line N)`` for messages."""
        at = f" (line {self.line})" if self.line is not None else " (lines counted from its header)"
        return f"{self.source}: record {self.name!r}{at}"


@dataclass(frozen=True)
class EncodedBlock:
    """A run of consecutive bases of one record.

    Attributes:
        tokens: ``[L]`` uint8 token ids (case kept, ambiguity codes already N); may be read-only.
        ambiguous: how many of them were IUPAC ambiguity codes.
        raw_bytes: input bytes this block consumed (for throughput reporting).
        has_n: whether any token is N (False lets consumers skip a pass).
    """

    tokens: np.ndarray
    ambiguous: int
    raw_bytes: int
    has_n: bool = True


BlockIterator = Iterator[EncodedBlock]


class SequenceSource:
    """An input file; iterate :meth:`records` once.

    Attributes:
        path: the file.
        kind: ``fasta``, ``fasta-gzip``, ``fasta-bgzip``, ``fasta-indexed``, ``fasta-bgzip-indexed``,
            ``genbank`` or ``embl``.
        names: names of every record seen so far (complete after :meth:`records` is exhausted).
    """

    kind: str = ""

    def __init__(self, path: Path):
        self.path = path
        self.names: list[RecordInfo] = []

    def records(self, wanted: Callable[[RecordInfo], bool]) -> Iterator[tuple[RecordInfo, BlockIterator | None]]:
        """Yield every record with, when ``wanted(info)``, an iterator over its encoded blocks.

        The consumer must exhaust a record's block iterator before asking for the next record.
        Records that are not wanted are skipped as cheaply as the format allows (``None``).
        """
        raise NotImplementedError


_INVALID_BYTE = bytes([INVALID])
_N_BYTES = (bytes([N]), bytes([N | SOFTMASK]))
_AMBIGUOUS_BYTES = (bytes([AMBIGUOUS]), bytes([AMBIGUOUS | SOFTMASK]))


def _encode_piece(piece: bytes, delete: bytes = b"\r\n") -> tuple[EncodedBlock, int]:
    """Map raw sequence bytes to token ids, dropping line breaks, in one C pass.

    Returns:
        (the encoded block, index of the first invalid token or -1).
    """
    translated = piece.translate(ENCODE_TABLE, delete)
    bad = translated.find(_INVALID_BYTE)
    tokens = np.frombuffer(translated, dtype=np.uint8)
    ambiguous = 0
    if bad < 0 and (_AMBIGUOUS_BYTES[0] in translated or _AMBIGUOUS_BYTES[1] in translated):
        tokens = tokens.copy()
        ambiguous = resolve_ambiguous(tokens)
        has_n = True
    else:
        has_n = _N_BYTES[0] in translated or _N_BYTES[1] in translated  # memchr: cheap when absent
    return EncodedBlock(tokens=tokens, ambiguous=ambiguous, raw_bytes=len(piece), has_n=has_n), bad


def _invalid_message(where: str, char: int, line: int | None, column: int | None) -> str:
    at = f", line {line}" if line is not None else ""
    col = f", column {column}" if column is not None else ""
    shown = repr(chr(char)) if 32 <= char < 127 else f"byte 0x{char:02x}"
    return (
        f"{where}{at}{col}: invalid character {shown}; sequence lines may hold only A, C, G, T, N, "
        "IUPAC ambiguity codes (R, Y, S, W, K, M, B, D, H, V) and their lowercase: fix or remove the record"
    )


# ------------------------------------------------------------------------------------------------
# Streaming FASTA


class _LineLayout:
    """Incremental check that a record's lines all have one width except a shorter last line.

    Blank lines are allowed only at the end of a record. Works on raw pieces cut anywhere
    (mid-line included); CRLF line ends are accepted.
    """

    def __init__(self, info: RecordInfo, first_line: int):
        self.info = info
        self.line = first_line  # number of the line the next byte belongs to
        self.width: int | None = None  # content width of full lines
        self.tail_from: int | None = None  # line after which only blank lines may follow
        self.tail_len = 0  # content length of the line that ended the full-width run
        self.col = 0  # raw bytes of the current unfinished line
        self.pending_cr = False  # the previous piece ended with '\r'
        self.crlf: bool | None = None  # whether the first line ended with CRLF

    def feed(self, piece: bytes, deleted: int | None = None) -> None:
        """Check the complete lines of ``piece`` (``[L]`` raw bytes) and carry the unfinished one.

        Args:
            piece: raw bytes of the record's sequence, cut anywhere.
            deleted: how many line-break bytes (CR and LF) the piece holds, if known (the encoder
                deleted them); enables the fast path.
        """
        arr = np.frombuffer(piece, dtype=np.uint8)
        if deleted is not None and self._all_full_width(piece, arr, deleted):
            return
        newlines = np.flatnonzero(arr == 10)
        cr_total = piece.count(b"\r")
        if newlines.size == 0:
            self.col += len(piece)
            if cr_total and (cr_total > 1 or piece[-1:] != b"\r"):
                self._stray_cr(piece, arr)
            self.pending_cr = piece.endswith(b"\r")
            return
        raw = np.diff(newlines, prepend=-1)  # raw bytes per completed line, newline included
        raw[0] += self.col
        content = raw - 1
        if cr_total or self.pending_cr:
            before = newlines - 1
            ends_cr = np.zeros(newlines.size, dtype=bool)
            inside = before >= 0
            ends_cr[inside] = arr[before[inside]] == 13
            if not inside[0]:
                ends_cr[0] = self.pending_cr
            if int(ends_cr[inside].sum()) + int(piece.endswith(b"\r")) != cr_total:
                self._stray_cr(piece, arr)
            content = content - ends_cr
        else:
            ends_cr = np.zeros(1, dtype=bool)
        if self.width is None and self.tail_from is None:
            self.crlf = bool(ends_cr[0])
        self._check(content)
        self.line += int(newlines.size)
        self.col = len(piece) - int(newlines[-1]) - 1
        self.pending_cr = piece.endswith(b"\r")

    def _all_full_width(self, piece: bytes, arr: np.ndarray, deleted: int) -> bool:
        """Fast path: True when every line break of ``piece`` sits exactly where full-width lines
        put it. Strided checks confirm the expected breaks; ``deleted`` (all CR/LF bytes of the
        piece) equal to their number proves there are no others. No pass over the whole piece."""
        if self.width is None or self.tail_from is not None or self.crlf is None:
            return False
        stride = self.width + 1 + int(self.crlf)
        first = stride - 1 - self.col  # index of the next expected '\n'
        if first < 0:
            return False
        size = len(piece)
        count = 0 if first >= size else (size - 1 - first) // stride + 1
        if count and not (arr[first::stride] == 10).all():
            return False
        breaks = count
        if self.crlf:
            start = first - 1
            if start < 0:
                if not self.pending_cr:
                    return False
                start += stride
            expected = arr[start::stride]
            if not (expected == 13).all():
                return False
            breaks += expected.size
        if deleted != breaks:
            return False
        self.line += count
        self.col = size - (first + (count - 1) * stride) - 1 if count else self.col + size
        self.pending_cr = piece.endswith(b"\r")
        return True

    def finish(self) -> None:
        """Account for an unterminated last line at the end of the record."""
        if self.col:
            self._check(np.array([self.col - int(self.pending_cr)], dtype=np.int64))
            self.line += 1
            self.col = 0

    def _check(self, content: np.ndarray) -> None:
        lines = content
        first = self.line
        if self.tail_from is None and self.width is None:
            self.width = int(lines[0])
            if self.width == 0:
                self.tail_from, self.tail_len = first, 0
        if self.tail_from is None:
            off = np.flatnonzero(lines != self.width)
            if off.size == 0:
                return
            i = int(off[0])
            if lines[i] > self.width:
                raise InputError(
                    f"{self.info.where()}: line {first + i} has {int(lines[i])} bases but the record's lines "
                    f"have {self.width}: inconsistent line widths; {_FIX_WRAP}"
                )
            self.tail_from, self.tail_len = first + i, int(lines[i])
            lines, first = lines[i + 1 :], first + i + 1
        extra = np.flatnonzero(lines)
        if extra.size:
            i = int(extra[0])
            what = "a blank line" if self.tail_len == 0 else f"a shorter line ({self.tail_len} bases)"
            raise InputError(
                f"{self.info.where()}: line {first + i} has {int(lines[i])} bases after {what} at line "
                f"{self.tail_from}: inconsistent line widths; {_FIX_WRAP}"
            )

    def _stray_cr(self, piece: bytes, arr: np.ndarray) -> None:
        for pos in np.flatnonzero(arr == 13):
            nxt = piece[pos + 1 : pos + 2]
            if nxt not in (b"\n", b""):
                line = self.line + piece.count(b"\n", 0, int(pos))
                raise InputError(_invalid_message(self.info.where(), 13, line, None))


class _StreamingFasta(SequenceSource):
    """Plain, gzip or bgzip FASTA read front to back (gzip decompressed in a background thread)."""

    def __init__(self, path: Path, kind: str, block_bytes: int = BLOCK_BYTES):
        super().__init__(path)
        self.kind = kind
        self.block_bytes = block_bytes

    def _open(self) -> BinaryIO:
        if self.kind == "fasta":
            return open(self.path, "rb")  # noqa: SIM115 - closed by records()
        from isal import igzip_threaded

        return igzip_threaded.open(self.path, "rb", threads=1, block_size=1 << 20)

    def records(self, wanted: Callable[[RecordInfo], bool]) -> Iterator[tuple[RecordInfo, BlockIterator | None]]:
        with self._open() as handle:
            reader = _FastaScanner(handle, self.path, self.block_bytes)
            yield from reader.records(wanted, self.names)


class _FastaScanner:
    """The streaming FASTA state machine over a binary handle."""

    def __init__(self, handle: BinaryIO, path: Path, block_bytes: int):
        self.handle = handle
        self.path = path
        self.block_bytes = block_bytes
        self.buf = b""
        self.pos = 0
        self.line = 1  # line number of buf[pos]
        self.eof = False
        self._at_line_start = True  # buf[pos] (after a refill) begins a line

    def _fill(self) -> bool:
        """Append the next block to the unread part of the buffer; False at end of file."""
        if self.eof:
            return False
        try:
            block = self.handle.read(self.block_bytes)
        except EOFError:
            raise InputError(
                f"{self.path}: the gzip stream ends early (a truncated download?); fetch the file again "
                "and check it with `gzip -t`"
            ) from None
        except (OSError, gzip.BadGzipFile) as exc:
            raise InputError(
                f"{self.path}: cannot decompress ({exc}); check it with `gzip -t` or fetch it again"
            ) from None
        if not block:
            self.eof = True
            return False
        self.buf = self.buf[self.pos :] + block
        self.pos = 0
        return True

    def skip(self, count: int) -> None:
        """Discard the next ``count`` bytes of the stream."""
        while len(self.buf) - self.pos < count:
            if not self._fill():
                raise InputError(f"{self.path}: the file ends early; fetch it again and re-index it")
        self.pos += count

    def _header(self, seen: list[RecordInfo]) -> RecordInfo:
        """Read the header line at ``pos`` (which holds '>')."""
        while (end := self.buf.find(b"\n", self.pos)) < 0:
            if len(self.buf) - self.pos > (1 << 24):
                raise InputError(
                    f"{self.path}, line {self.line}: header line longer than 16 MiB; is this a FASTA file?"
                )
            if not self._fill():
                end = len(self.buf)
                break
        raw = self.buf[self.pos + 1 : end].rstrip(b"\r")
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        parts = text.split(maxsplit=1)
        if not parts:
            raise InputError(f"{self.path}, line {self.line}: a header line ('>') with no record name; name the record")
        info = RecordInfo(
            name=parts[0],
            description=parts[1] if len(parts) > 1 else "",
            region=parse_record_name(parts[0]),
            source=self.path,
            line=self.line,
        )
        seen.append(info)
        self.pos = min(end + 1, len(self.buf))
        self.line += 1
        self._at_line_start = True
        return info

    def _pieces(self) -> Iterator[bytes]:
        """Raw byte pieces of the current record's sequence, up to the next header or EOF."""
        while True:
            if self.pos >= len(self.buf) and not self._fill():
                return
            if self.buf[self.pos : self.pos + 1] == b">" and (self.pos > 0 or self._at_line_start):
                return
            cut = self._next_header(self.pos)
            if cut >= 0:
                piece = self.buf[self.pos : cut + 1]
                self.pos = cut + 1
                self._at_line_start = True
                yield piece
                return
            piece = self.buf[self.pos :]
            self.pos = len(self.buf)
            self._at_line_start = piece.endswith(b"\n")
            yield piece

    def _next_header(self, start: int) -> int:
        """Index of the newline before the next header line at or after ``start``, or -1.

        Searches for the rare '>' (memchr speed; a two-byte search for "\\n>" is 5x slower because
        newlines are everywhere) and checks the byte before it; a '>' inside a line is left for the
        sequence check to report.
        """
        buf = self.buf
        while (gt := buf.find(b">", start + 1)) >= 0:
            if buf[gt - 1] == 10:
                return gt - 1
            start = gt
        return -1

    def records(
        self, wanted: Callable[[RecordInfo], bool], seen: list[RecordInfo]
    ) -> Iterator[tuple[RecordInfo, BlockIterator | None]]:
        if not self._fill():
            raise InputError(f"{self.path}: the file is empty; give a FASTA file with at least one record")
        if self.buf[:1] != b">":
            binary = any(b < 9 or 13 < b < 32 for b in self.buf[:512])
            what = "a binary file" if binary else "text that does not start with '>'"
            raise InputError(f"{self.path}: not a FASTA file ({what}); give a FASTA, GenBank or EMBL file")
        while self.pos < len(self.buf) or self._fill():
            info = self._header(seen)
            if wanted(info):
                blocks = self.sequence_blocks(info)
                yield info, blocks
                for _ in blocks:  # the consumer stopped early: skip the rest of the record
                    pass
            else:
                yield info, None
                for piece in self._pieces():
                    self.line += piece.count(b"\n")

    def sequence_blocks(self, info: RecordInfo) -> BlockIterator:
        """Encoded blocks of the record whose sequence starts at the current position."""
        layout = _LineLayout(info, self.line)
        total = 0
        for piece in self._pieces():
            start_line = layout.line
            block, bad = _encode_piece(piece)
            layout.feed(piece, deleted=len(piece) - block.tokens.size)
            if bad >= 0:
                self._raise_invalid(info, piece, start_line, layout)
            total += block.tokens.size
            if block.tokens.size:
                yield block
        layout.finish()
        self.line = layout.line
        if total == 0:
            raise InputError(f"{info.where()}: the record has no sequence; remove it or fill it in")

    @staticmethod
    def _raise_invalid(info: RecordInfo, piece: bytes, start_line: int, layout: _LineLayout) -> None:
        arr = np.frombuffer(piece, dtype=np.uint8)
        mask = (ENCODE_LUT[arr] == INVALID) & (arr != 10) & (arr != 13)
        pos = int(np.flatnonzero(mask)[0])
        line = start_line + piece.count(b"\n", 0, pos)
        last_nl = piece.rfind(b"\n", 0, pos)
        column = pos - last_nl if last_nl >= 0 else pos + 1
        raise InputError(_invalid_message(info.where(), int(arr[pos]), line, column))


# ------------------------------------------------------------------------------------------------
# Indexed FASTA (.fai, and .gzi for bgzip)


@dataclass(frozen=True)
class _FaiEntry:
    name: str
    length: int
    offset: int
    line_bases: int
    line_bytes: int


def _read_fai(path: Path, fasta: Path) -> list[_FaiEntry]:
    entries = []
    fix = f"delete it and re-index with `samtools faidx {fasta}`"
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the FASTA index ({exc}); {fix}") from None
    for number, text in enumerate(lines, 1):
        cols = text.split("\t")
        try:
            name, length, offset, line_bases, line_bytes = cols[0], *map(int, cols[1:5])
        except (ValueError, TypeError):
            raise InputError(
                f"{path}, line {number}: not a .fai line (name, length, offset, linebases, linewidth); {fix}"
            ) from None
        entries.append(_FaiEntry(name, length, offset, line_bases, line_bytes))
    if not entries:
        raise InputError(f"{path}: the FASTA index is empty; {fix}")
    return entries


class _ByteRange(io.RawIOBase):
    """The bytes ``[start, end)`` of a file as a read-only stream."""

    def __init__(self, path: Path, start: int, end: int):
        super().__init__()
        self._handle = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._handle.seek(start)
        self._left = max(0, end - start)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        count = self._handle.readinto(view)
        self._left -= count
        return count

    def close(self) -> None:
        self._handle.close()
        super().close()


class _RawAccess:
    """Uncompressed byte ranges of plain or bgzip FASTA (bgzip through its .gzi block index).

    A bgzip file is a series of gzip members; the .gzi lists where each starts in both the
    compressed and the uncompressed stream, so a range decompresses from the member at or before
    its start, with python-isal (about 3x faster than htslib's zlib here).
    """

    def __init__(self, path: Path, gzi: Path | None):
        self.path = path
        self.gzi = gzi
        self.size = path.stat().st_size
        if gzi is not None:
            data = gzi.read_bytes()
            (count,) = struct.unpack_from("<Q", data, 0)
            pairs = struct.unpack_from(f"<{2 * count}Q", data, 8)
            self.blocks = [(0, 0)] + [(pairs[2 * i], pairs[2 * i + 1]) for i in range(count)]
            self.ustarts = [u for _, u in self.blocks]

    def open_range(self, start: int, end: int, threads: int = 1) -> tuple[BinaryIO, int]:
        """A stream that covers uncompressed bytes ``[start, end)`` and the bytes to skip first."""
        start = max(0, start)
        if self.gzi is None:
            return io.BufferedReader(_ByteRange(self.path, start, end)), 0
        from isal import igzip_threaded

        first = bisect.bisect_right(self.ustarts, start) - 1
        last = bisect.bisect_right(self.ustarts, max(start, end - 1)) - 1
        cstart = self.blocks[first][0]
        cend = self.blocks[last + 1][0] if last + 1 < len(self.blocks) else self.size
        compressed = io.BufferedReader(_ByteRange(self.path, cstart, cend))
        handle = igzip_threaded.open(compressed, "rb", threads=threads, block_size=1 << 20)
        return handle, start - self.blocks[first][1]

    def read(self, offset: int, size: int) -> bytes:
        """Uncompressed bytes ``[offset, offset + size)`` (fewer at the end of the file)."""
        handle, skip = self.open_range(offset, offset + size, threads=0)
        with handle:
            return handle.read(skip + size)[skip:]


class _IndexedFasta(SequenceSource):
    """bgzip (+ .fai + .gzi) or plain (+ .fai) FASTA: only the wanted records are read.

    The index is checked against the file, then each wanted record is decompressed from the
    bgzip member that holds its first base and scanned like a streamed file (same checks).
    """

    def __init__(self, path: Path, kind: str, fai: Path, gzi: Path | None, block_bytes: int = BLOCK_BYTES):
        super().__init__(path)
        self.kind = kind
        self.fai = fai
        self.gzi = gzi
        self.block_bytes = block_bytes

    def _mismatch(self, why: str) -> InputError:
        return InputError(
            f"the index {self.fai} does not match {self.path} ({why}): delete it (and any .gzi) and "
            "re-index with `samtools faidx`"
        )

    def _check_entry(self, raw: _RawAccess, entry: _FaiEntry) -> None:
        """Refuse an index whose offsets or lengths do not fit the file."""
        start = max(0, entry.offset - len(entry.name) - 4096)
        head = raw.read(start, entry.offset - start)
        last_line = head.rstrip(b"\n").rstrip(b"\r").rsplit(b"\n", 1)[-1]
        name = last_line[1:].split(maxsplit=1)[:1]
        if not head.endswith(b"\n") or not last_line.startswith(b">") or name != [entry.name.encode()]:
            raise self._mismatch(f"no header '>{entry.name}' before offset {entry.offset}")
        if entry.line_bases <= 0 or entry.line_bytes < entry.line_bases:
            raise self._mismatch(f"record {entry.name!r} has line lengths {entry.line_bases}/{entry.line_bytes}")
        last = entry.length - 1
        pos = entry.offset + (last // entry.line_bases) * entry.line_bytes + last % entry.line_bases
        tail = raw.read(pos, 2)
        if len(tail) < 1 or ENCODE_LUT[tail[0]] == INVALID or tail[1:2] not in (b"", b"\n", b"\r"):
            raise self._mismatch(f"record {entry.name!r} does not end after {entry.length:,} bases")

    def records(self, wanted: Callable[[RecordInfo], bool]) -> Iterator[tuple[RecordInfo, BlockIterator | None]]:
        entries = _read_fai(self.fai, self.path)
        try:
            raw = _RawAccess(self.path, self.gzi)
        except (OSError, struct.error) as exc:
            raise InputError(
                f"{self.gzi}: not a readable .gzi index ({exc}); delete it and re-index with `samtools faidx`"
            ) from None
        for entry in entries:
            info = RecordInfo(
                name=entry.name,
                description="",
                region=parse_record_name(entry.name),
                source=self.path,
                length=entry.length,
            )
            self.names.append(info)
            if not wanted(info):
                yield info, None
                continue
            self._check_entry(raw, entry)
            yield info, self._blocks(raw, info, entry)

    def _blocks(self, raw: _RawAccess, info: RecordInfo, entry: _FaiEntry) -> BlockIterator:
        lines = -(-entry.length // entry.line_bases)
        handle, skip = raw.open_range(entry.offset, entry.offset + lines * entry.line_bytes)
        total = 0
        with handle:
            scanner = _FastaScanner(handle, self.path, self.block_bytes)
            scanner.skip(skip)
            scanner.line = 2  # the record's first sequence line; lines count from its header
            for block in scanner.sequence_blocks(info):
                total += block.tokens.size
                yield block
        if total != entry.length:
            raise self._mismatch(f"record {entry.name!r} has {total:,} bases, the index says {entry.length:,}")


# ------------------------------------------------------------------------------------------------
# GenBank / EMBL (Biopython)


class _SeqIOSource(SequenceSource):
    """GenBank or EMBL through Biopython's SeqIO (records are read whole)."""

    def __init__(self, path: Path, kind: str, compressed: bool, block_bases: int = BLOCK_BYTES):
        super().__init__(path)
        self.kind = kind
        self.compressed = compressed
        self.block_bases = block_bases

    def records(self, wanted: Callable[[RecordInfo], bool]) -> Iterator[tuple[RecordInfo, BlockIterator | None]]:
        from Bio import SeqIO
        from Bio.Seq import UndefinedSequenceError

        opener = gzip.open if self.compressed else open
        with opener(self.path, "rt") as handle:  # type: ignore[operator]
            try:
                for record in SeqIO.parse(handle, self.kind):
                    info = RecordInfo(
                        name=record.id,
                        description=record.description,
                        region=parse_record_name(record.id),
                        source=self.path,
                    )
                    self.names.append(info)
                    if not wanted(info):
                        yield info, None
                        continue
                    try:
                        sequence = bytes(record.seq).upper()  # GenBank/EMBL write lowercase; no soft-masking
                    except UndefinedSequenceError:
                        sequence = b""
                    yield info, self._blocks(info, sequence)
            except (ValueError, EOFError, OSError) as exc:
                raise InputError(
                    f"{self.path}: cannot parse as {self.kind} ({exc}); check the file or convert it to FASTA"
                ) from None

    def _blocks(self, info: RecordInfo, sequence: bytes) -> BlockIterator:
        if not sequence:
            raise InputError(
                f"{info.where()}: the record has no sequence (a CONTIG-only or master record?); remove it or use a record with sequence"
            )
        for start in range(0, len(sequence), self.block_bases):
            piece = sequence[start : start + self.block_bases]
            block, bad = _encode_piece(piece, b"")
            if bad >= 0:
                raise InputError(_invalid_message(f"{info.where()}, base {start + bad + 1:,}", piece[bad], None, None))
            yield block


# ------------------------------------------------------------------------------------------------


def _sniff(path: Path) -> tuple[bytes, bool, bool]:
    """(first decompressed bytes, gzip?, bgzip?)."""
    with open(path, "rb") as handle:
        head = handle.read(18)
    if head[:2] != _GZIP_MAGIC:
        with open(path, "rb") as handle:
            return handle.read(64), False, False
    # bgzip: FEXTRA set and a 'BC' subfield (SAM/BAM spec, section 4.1)
    bgzip = len(head) >= 14 and head[3] & 4 and head[12:14] == b"BC"
    try:
        with gzip.open(path, "rb") as handle:
            first = handle.read(64)
    except EOFError:
        raise InputError(
            f"{path}: the gzip stream ends early (a truncated download?); fetch the file again and check it with `gzip -t`"
        ) from None
    except (OSError, gzip.BadGzipFile) as exc:
        raise InputError(f"{path}: cannot decompress ({exc}); check it with `gzip -t` or fetch it again") from None
    return first, True, bool(bgzip)


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of an input file, from its content (not its name).

    Returns:
        ``fasta``, ``fasta-gzip`` (plain gzip), ``fasta-bgzip``, ``genbank`` or ``embl``.

    Raises:
        InputError: missing, empty, unreadable, or not one of those formats.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file; check the path")
    if not path.is_file():
        raise InputError(f"{path}: not a regular file; give a FASTA, GenBank or EMBL file")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty; give a FASTA file with at least one record")
    head, gz, bgz = _sniff(path)
    if head.startswith(b"LOCUS"):
        return "genbank"
    if head.startswith(b"ID   "):
        return "embl"
    if not head:
        raise InputError(f"{path}: the file is empty; give a FASTA file with at least one record")
    if head.startswith(b">"):
        return "fasta-bgzip" if bgz else "fasta-gzip" if gz else "fasta"
    binary = any(b < 9 or 13 < b < 32 for b in head)
    what = "a binary file" if binary else "text that does not start with '>'"
    raise InputError(f"{path}: not a FASTA file ({what}); give a FASTA, GenBank or EMBL file")


def open_source(path: str | os.PathLike[str], block_bytes: int = BLOCK_BYTES) -> SequenceSource:
    """Open an input file with the best reader for it.

    Indexed reading is used when a bgzip FASTA has both ``.fai`` and ``.gzi`` beside it, or a
    plain FASTA has a ``.fai``; otherwise the file is streamed.

    Args:
        path: FASTA (plain, gzip, bgzip), GenBank or EMBL (plain or gzip).
        block_bytes: bytes (or bases) handled per step.

    Raises:
        InputError: as :func:`detect_format`.
    """
    path = Path(path)
    kind = detect_format(path)
    if kind in ("genbank", "embl"):
        with open(path, "rb") as handle:
            compressed = handle.read(2) == _GZIP_MAGIC
        return _SeqIOSource(path, kind, compressed, block_bytes)
    fai = Path(f"{path}.fai")
    gzi = Path(f"{path}.gzi")
    if kind == "fasta-bgzip" and fai.is_file() and gzi.is_file():
        return _IndexedFasta(path, "fasta-bgzip-indexed", fai, gzi, block_bytes)
    if kind == "fasta" and fai.is_file():
        return _IndexedFasta(path, "fasta-indexed", fai, None, block_bytes)
    return _StreamingFasta(path, kind, block_bytes)

"""Checksums written with every checkpoint, and the checks that name a damaged weights file in one line.

Three kinds of files hold weights, and each gets the same treatment:

- a GLM-5.3-Flash-format directory (``config.json`` + ``*.safetensors`` [+ index]): an export,
  the bundled base, a downloaded model;
- the one-process Lightning checkpoint file ``step*.ckpt`` (a torch zip archive);
- the sharded checkpoint directory ``step*.ckpt/`` of a multi-process run
  (torch.distributed.checkpoint: ``.metadata``, ``__R_0.distcp`` shards, Lightning's ``meta.pt``).

**The manifest.** When genolong writes one of them it also writes, once the data is complete and
before the checkpoint appears under its name, a small JSON manifest of each file's size and
checksum: ``checksums.json`` inside a directory, ``NAME.checksums.json`` beside a file. In a
safetensors directory it covers the weights and their index, not ``config.json`` or the tokenizer
files (small text that people edit by hand, checked by parsing it); in a checkpoint, every file. The
manifest carries a checksum of itself, so a damaged manifest is told apart from a damaged data
file. The checksum is CRC-32 (zlib) by default: it catches truncation and bit rot, which is what a
checkpoint needs (nobody forges one), and runs at ~3 GB/s on one core where sha256 runs at
~0.7 GB/s (benchmarks/checkpoint_checksum.py; BENCHMARKS.md); readers accept either.

**The checks.** :func:`check_weights` first compares sizes with the manifest (a precise "truncated:
N of M bytes"), then the checksums (any changed byte), then reads each file's own structure (the
safetensors header and the byte ranges it promises, the zip directory of a torch file, the DCP
``.metadata`` and the byte ranges it names). A checkpoint without a manifest (written by an older genolong, or downloaded)
is checked for structure only, with a note in the log (a debug line for a model directory: a
downloaded model has none). Every problem is a
:class:`DamagedFileError` (an :class:`~genolong.errors.InputError`): one line naming the file and
what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .errors import InputError
from .files import replace_file

__all__ = [
    "ALGORITHM",
    "DamagedFileError",
    "MANIFEST_NAME",
    "check_weights",
    "manifest_path",
    "remove_manifest",
    "shard_entries",
    "write_manifest",
]

log = logging.getLogger("genolong")

#: the manifest inside a checkpoint or export directory
MANIFEST_NAME = "checksums.json"
#: the suffix of the manifest beside a checkpoint file (``step0000020.ckpt.checksums.json``)
FILE_MANIFEST_SUFFIX = ".checksums.json"
#: the checksum written (readers accept any of :data:`_ALGORITHMS`)
ALGORITHM = "crc32"
_FORMAT = "genolong-checksums"
_VERSION = 1
_CHUNK = 16 << 20
#: safetensors refuses headers over 100 MB; a length field above it is not a safetensors file
_MAX_SAFETENSORS_HEADER = 100_000_000
_SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
DCP_METADATA = ".metadata"
LIGHTNING_META = "meta.pt"
#: a rank's shard file in a DCP directory (FileSystemWriter: ``__<rank>_<file>.distcp``)
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


class DamagedFileError(InputError):
    """A weights or checkpoint file that is truncated, of another format, or changed since written.

    Attributes:
        file: the damaged file (inside a checkpoint directory, the file itself).
        problem: what is wrong, without the file name (``truncated: 100 of 2,000 bytes``).
    """

    def __init__(self, file: Path, problem: str, fix: str = "write it again, or use another checkpoint"):
        self.file = Path(file)
        self.problem = problem
        super().__init__(f"{self.file} is damaged ({problem}); {fix}")


class _Crc32:
    """zlib's CRC-32 behind hashlib's update/hexdigest interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_ALGORITHMS: dict[str, Callable[[], Any]] = {"crc32": _Crc32, "sha256": hashlib.sha256}


def file_checksum(path: Path, algorithm: str = ALGORITHM, chunk: int = _CHUNK) -> str:
    """The hex checksum of a file, read in ``chunk``-byte pieces (default 16 MiB, into one reused buffer)."""
    digest = _ALGORITHMS[algorithm]()
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _checksums(files: list[Path], algorithm: str) -> list[str]:
    """The checksums of ``files``, several files at a time: zlib and hashlib release the GIL on
    large buffers, so the shards of a multi-process checkpoint hash on several cores."""
    if len(files) <= 1:
        return [file_checksum(file, algorithm) for file in files]
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(lambda file: file_checksum(file, algorithm), files))


def manifest_path(checkpoint: str | os.PathLike[str]) -> Path:
    """Where the manifest of ``checkpoint`` lives: inside a directory, beside a file."""
    path = Path(checkpoint)
    return path / MANIFEST_NAME if path.is_dir() else path.with_name(path.name + FILE_MANIFEST_SUFFIX)


def _data_files(path: Path, name: str | None = None) -> Iterator[tuple[str, Path]]:
    """(name in the manifest, file) of a checkpoint: the file itself (under ``name``, default its
    own), or every file under a directory but the manifest, relative with ``/``, sorted."""
    if not path.is_dir():
        yield name or path.name, path
        return
    weights_only = not (path / DCP_METADATA).is_file()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        # a safetensors directory: the weights and their index; config.json, the tokenizer files
        # are small, human-edited text, checked by parsing them
        if name != MANIFEST_NAME and (not weights_only or name.endswith((".safetensors", ".safetensors.index.json"))):
            yield name, file


def _self_checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _shard_rank(name: str) -> int | None:
    """The rank that wrote a DCP shard file of this name, or None for any other file."""
    m = _SHARD.match(name)
    return int(m.group(1)) if m else None


def _entry(file: Path, digest: str, algorithm: str) -> dict[str, Any]:
    return {"bytes": file.stat().st_size, algorithm: digest}


def shard_entries(
    directory: str | os.PathLike[str], rank: int, algorithm: str = ALGORITHM
) -> dict[str, dict[str, Any]]:
    """The manifest entries (name -> size and checksum) of the shard files ``rank`` wrote into a DCP
    directory: what each rank of a job computes for its own shard, for rank 0's
    :func:`write_manifest` (``known=``), so that no rank reads another's shard back."""
    path = Path(directory)
    files = sorted(p for p in path.iterdir() if p.is_file() and _shard_rank(p.name) == rank)
    return {f.name: _entry(f, d, algorithm) for f, d in zip(files, _checksums(files, algorithm))}


def write_manifest(
    checkpoint: str | os.PathLike[str],
    final: str | os.PathLike[str] | None = None,
    algorithm: str = ALGORITHM,
    known: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write the checksum manifest of a complete checkpoint (file or directory), atomically.

    Args:
        checkpoint: the checkpoint file or directory, fully written.
        final: the name a checkpoint *file* written under a temporary name will be renamed to:
            its manifest is written beside that name (a directory's goes inside it, and moves
            with it). Default: ``checkpoint`` itself.
        algorithm: ``crc32`` (default) or ``sha256``.
        known: entries already computed (:func:`shard_entries`: the shards each rank hashed); the
            files not in it are hashed here. Every file of the checkpoint is listed either way.

    Returns:
        The manifest's path.
    """
    path = Path(checkpoint)
    final_path = Path(final) if final is not None and not path.is_dir() else path
    known = dict(known or {})
    listed = list(_data_files(path, final_path.name))
    missing = set(known) - {name for name, _ in listed}
    assert not missing, f"manifest entries for files not in {path}: {sorted(missing)}"
    todo = [(name, file) for name, file in listed if name not in known or algorithm not in known[name]]
    sums = _checksums([file for _, file in todo], algorithm)
    known.update({name: _entry(file, digest, algorithm) for (name, file), digest in zip(todo, sums)})
    files = {name: known[name] for name, _ in listed}
    body = {"format": _FORMAT, "version": _VERSION, "algorithm": algorithm, "files": files}
    text = json.dumps({**body, "manifest_sha256": _self_checksum(body)}, indent=1) + "\n"
    out = manifest_path(path) if path.is_dir() else final_path.with_name(final_path.name + FILE_MANIFEST_SUFFIX)
    replace_file(out, lambda tmp: tmp.write_text(text), durable=True)
    return out


def remove_manifest(checkpoint: str | os.PathLike[str]) -> None:
    """Remove the manifest beside a checkpoint file (one inside a directory goes with it)."""
    path = Path(checkpoint)
    path.with_name(path.name + FILE_MANIFEST_SUFFIX).unlink(missing_ok=True)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of ``path``, or None when there is none.

    Raises:
        DamagedFileError: the manifest is unreadable, of another format, or fails its own checksum.
    """
    where = manifest_path(path)
    if not where.is_file():
        return None
    fix = f"delete {where.name} to load the checkpoint unverified, or use another checkpoint"
    try:
        data = json.loads(where.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedFileError(where, f"checksum manifest is not JSON: {exc}", fix) from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise DamagedFileError(where, "not a genolong checksum manifest", fix)
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    if data.get("manifest_sha256") != _self_checksum(body):
        raise DamagedFileError(where, "checksum manifest fails its own checksum: it changed after it was written", fix)
    if data.get("algorithm") not in _ALGORITHMS or not isinstance(data.get("files"), dict):
        raise DamagedFileError(where, f"checksum manifest of an unknown algorithm {data.get('algorithm')!r}", fix)
    return data


def _target(path: Path, name: str) -> Path:
    return path / name if path.is_dir() else path


def _truncated(size: int, expected: int, basis: str) -> str:
    return f"truncated: {size:,} of the {expected:,} bytes {basis}"


# -- the formats' own structure ---------------------------------------------------------------------
def check_safetensors(file: Path) -> None:
    """The safetensors header is JSON and the file holds every byte range it promises.

    Raises:
        DamagedFileError: truncated (shorter than the header says), not a safetensors file.
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DamagedFileError(file, f"not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_SAFETENSORS_HEADER:
            raise DamagedFileError(file, "not a safetensors file: its first 8 bytes are not a header length")
        if 8 + length > size:
            raise DamagedFileError(file, _truncated(size, 8 + length, "its header length says (the header alone)"))
        raw = f.read(length)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise DamagedFileError(file, f"not a safetensors file: its header is not a JSON object ({exc})") from None
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            bits = _SAFETENSORS_DTYPE_BITS[info["dtype"]]
            numel = math.prod(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise DamagedFileError(
                file, f"not a safetensors file: tensor {name}'s header entry is unreadable"
            ) from None
        if stop - start != (numel * bits + 7) // 8 or start < 0:
            raise DamagedFileError(
                file,
                f"tensor {name}: its shape {info['shape']} and dtype {info['dtype']} do not "
                f"fit its {stop - start:,} bytes (the header is damaged)",
            )
        end = max(end, stop)
    expected = 8 + length + end
    if size < expected:
        raise DamagedFileError(file, _truncated(size, expected, "its header says"))
    if size > expected:
        raise DamagedFileError(file, f"{size - expected:,} bytes after the last tensor its header names")


def check_torch_zip(file: Path, crc: bool) -> None:
    """A torch checkpoint file (zip archive): the zip directory is whole and every member lies
    within the file; with ``crc`` every member's CRC-32 is checked too (reads the whole file).

    Raises:
        DamagedFileError: truncated, not a torch zip file, a member that fails its CRC.
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        raise DamagedFileError(file, "not a torch checkpoint: not a zip archive (torch.save's format)")
    try:
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
            for info in members:
                if info.header_offset + len(info.FileHeader()) + info.compress_size > size:
                    raise DamagedFileError(
                        file, f"truncated: member {info.filename} ends past the file's {size:,} bytes"
                    )
            bad = archive.testzip() if crc else None
    except zipfile.BadZipFile as exc:
        # a torch zip starts with a member and ends with the directory: no directory = cut short
        raise DamagedFileError(file, f"truncated: {size:,} bytes and no zip directory at its end ({exc})") from None
    except (OSError, zlib.error, EOFError) as exc:
        raise DamagedFileError(file, f"a zip member is unreadable ({exc})") from None
    if bad is not None:
        raise DamagedFileError(file, f"member {bad} fails its CRC-32: the file changed after it was written")


def check_dcp(directory: Path) -> None:
    """A torch.distributed.checkpoint directory: ``.metadata`` reads, and every shard file holds
    the byte ranges it names; Lightning's ``meta.pt`` (when present) is a whole torch file.

    Raises:
        DamagedFileError: ``.metadata`` missing or unreadable, a shard missing or truncated.
    """
    from torch.distributed.checkpoint import FileSystemReader

    meta = directory / DCP_METADATA
    if not meta.is_file():
        raise DamagedFileError(directory, f"not a torch.distributed.checkpoint directory: no {DCP_METADATA}")
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
        storage = metadata.storage_data
        extents: dict[str, int] = {}
        for info in storage.values():
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as exc:  # pickle raises anything on damaged bytes (EOFError, UnpicklingError, ...)
        what = "truncated" if isinstance(exc, EOFError) or "truncated" in str(exc) else "unreadable"
        raise DamagedFileError(meta, f"DCP metadata is {what} ({type(exc).__name__}: {str(exc)[:100]})") from None
    for name, needed in sorted(extents.items()):
        shard = directory / name
        if not shard.is_file():
            raise DamagedFileError(shard, f"missing: {DCP_METADATA} names it")
        size = shard.stat().st_size
        if size < needed:
            raise DamagedFileError(shard, _truncated(size, needed, f"{DCP_METADATA} says"))
    if (directory / LIGHTNING_META).is_file():
        check_torch_zip(directory / LIGHTNING_META, crc=False)


def _kind(path: Path) -> str:
    if path.is_dir():
        if (path / DCP_METADATA).is_file() or path.suffix == ".ckpt":
            return "dcp"
        return "safetensors"
    return "safetensors" if path.suffix == ".safetensors" else "torch"


# checks already passed in this process: (path, stat of every file) -> None (evaluate reads the
# recipe, then the weights: one verification)
_VERIFIED: set[tuple[Any, ...]] = set()


def _signature(path: Path) -> tuple[Any, ...]:
    files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*") if p.is_file())
    where = manifest_path(path)
    files.extend([where] if where.is_file() and not path.is_dir() else [])
    return (str(path.resolve()), *((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def check_weights(checkpoint: str | os.PathLike[str], shards: tuple[int, int] | None = None) -> bool:
    """Check a weights directory or checkpoint (file or DCP directory) before it is read.

    Sizes against the manifest, then the checksums, then the format's structure (see the module
    docstring). A checkpoint that passed in this process, unchanged since, is not read again.

    ``shards=(rank, world)`` (a rank of a multi-process job, on a DCP directory): the checksums of
    the shard files of the ranks ``i`` with ``i % world == rank`` only (its own shard when the job
    has the writer's size; ``world=0``: no shard), every other file and every size checked as usual;
    together the ranks of a job read each shard once. On a safetensors directory (a base model
    every rank reads slices of) the same with ``i`` the file's position in the manifest. Default:
    every file.

    Returns:
        True when a manifest vouched for every file, False when there was none (logged).

    Raises:
        DamagedFileError: the one-line description of the first problem found.
    """
    path = Path(checkpoint)
    signature = (*_signature(path), shards)
    manifest = _read_manifest(path)
    if signature in _VERIFIED:
        return manifest is not None
    algorithm = manifest["algorithm"] if manifest else ALGORITHM
    listed: dict[str, dict[str, Any]] = manifest["files"] if manifest else {}
    for name, entry in listed.items():
        file = _target(path, name)
        if not file.is_file():
            raise DamagedFileError(file, f"missing: {manifest_path(path).name} lists it")
        size, expected = file.stat().st_size, int(entry.get("bytes", -1))
        if size < expected:
            raise DamagedFileError(file, _truncated(size, expected, "written (checksum manifest)"))
        if size > expected:
            raise DamagedFileError(file, f"{size:,} bytes where {expected:,} were written (checksum manifest)")
    # the weights files of a safetensors directory (a base model) are shared out by their position
    # in the manifest, so that the ranks of a job that all read slices of every file hash each once
    position = {name: i for i, name in enumerate(sorted(listed))} if _kind(path) == "safetensors" else {}

    def mine(name: str) -> bool:
        owner = _shard_rank(name)
        owner = position.get(name) if owner is None else owner
        return shards is None or owner is None or (shards[1] > 0 and owner % shards[1] == shards[0])

    hashed = {name: entry for name, entry in listed.items() if mine(name)}
    files = [_target(path, name) for name in hashed]
    for entry, file, digest in zip(hashed.values(), files, _checksums(files, algorithm)):
        if digest != entry.get(algorithm):
            raise DamagedFileError(
                file,
                f"{algorithm} checksum differs from the one written: the file changed after "
                "it was written (bit rot, a bad copy or an edit)",
            )
    kind = _kind(path)
    if kind == "dcp":
        check_dcp(path)
    elif kind == "torch":
        check_torch_zip(path, crc=manifest is None)
    else:
        for file in [path] if path.is_file() else sorted(path.glob("*.safetensors")):
            check_safetensors(file)
    if manifest is None:
        # a checkpoint is genolong's own (an older genolong's): say so; a model directory without
        # one is usually downloaded, where no manifest is the rule (a debug line only)
        log.log(
            logging.DEBUG if kind == "safetensors" else logging.INFO,
            "genolong: %s has no checksum manifest (written by an older genolong, or not by genolong); "
            "checked its structure only",
            path,
        )
    _VERIFIED.add(signature)
    return manifest is not None

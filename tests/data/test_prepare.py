"""genolong prepare: exact round trips, segmentation, formats and naming conventions."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pysam
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genolong.data import GenomeStore, decode
from genolong.data.alphabet import SOFTMASK
from genolong.data.prepare import prepare_genome
from genolong.quickstart import sample_fasta
from tests.helpers import SOFTMASKED_CHR16, expected_text, reference_segments, write_fasta


def _record_text(split, contig: str) -> dict[tuple[int, int], str]:
    seg = split.segments[split.segments["contig"] == contig]
    return {
        (int(r.start), int(r.end)): decode(split.tokens[int(r.offset) : int(r.offset) + int(r.end - r.start)])
        for r in seg.itertuples()
    }


def test_sample_round_trip_against_pysam(sample_store: Path) -> None:
    """Every kept base equals pysam's fetch of the bundled sample; every dropped base is N."""
    store = GenomeStore.open(sample_store)
    assert store.splits == ("train", "eval")
    fasta = pysam.FastaFile(str(sample_fasta()))
    checked = 0
    for split in store:
        for contig in split.contigs:
            record = contig["record"]
            full = fasta.fetch(record)
            offset = contig["start"]
            covered = np.zeros(len(full), dtype=bool)
            for (start, end), text in _record_text(split, contig["name"]).items():
                assert text == full[start - offset : end - offset]
                covered[start - offset : end - offset] = True
                checked += end - start
            dropped = "".join(c for c, keep in zip(full, covered) if not keep)
            assert set(dropped) <= {"N"} and len(dropped) == contig["dropped"]
    assert checked == 6_179_943 + 900_000


def test_sample_genomic_coordinates(sample_store: Path) -> None:
    """Region-style record names place segments at their true coordinates."""
    store = GenomeStore.open(sample_store)
    eval_segments = store.split("eval").segments
    assert set(eval_segments["contig"]) == {"chr22"}
    assert eval_segments["start"].min() >= 20_000_000 and eval_segments["end"].max() <= 21_000_000
    chr3 = store.split("train").segments.query("contig == 'chr3'").iloc[0]
    assert (chr3.start, chr3.end) == (41_999_999, 44_000_000)
    # the documented promise: tokens[offset + i] is the base at contig:start + i
    fasta = pysam.FastaFile(str(sample_fasta()))
    i = 123_456
    assert decode(store.split("train").tokens[int(chr3.offset) + i : int(chr3.offset) + i + 1]) == fasta.fetch(
        "chr3:42000000-44000000", i, i + 1
    )


def test_streaming_equals_indexed(sample_store: Path, tmp_path: Path) -> None:
    """The same sample as plain gzip (streamed) gives byte-identical tokens and segments."""
    plain_gz = tmp_path / "sample.fa.gz"
    with gzip.open(sample_fasta(), "rb") as src, gzip.open(plain_gz, "wb") as dst:
        dst.write(src.read())
    out = tmp_path / "streamed"
    result = prepare_genome(
        [plain_gz], out, train="chr1,chr3,chr4,chr5", eval="chr22", progress=False, block_bytes=100_003
    )
    assert result.manifest["sources"][0]["format"] == "fasta-gzip"
    a, b = GenomeStore.open(sample_store), GenomeStore.open(out)
    assert GenomeStore.open(sample_store).manifest["sources"][0]["format"] == "fasta-bgzip-indexed"
    for name in ("train", "eval"):
        sa, sb = a.split(name), b.split(name)
        assert sa.segments.equals(sb.segments)
        assert np.array_equal(sa.tokens[:], sb.tokens[:])  # exact: tokens


def test_staged_writes_across_shards(sample_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With shards of 4 Mi tokens written 1 Mi at a time (the train split spans two shards, the
    second partial), the store holds the same tokens and segments, and opening it verifies every
    shard's sha256 (each hashed once: complete shards by the writer, the last at close)."""
    import genolong.data.prepare as prepare_module
    import genolong.data.store as store_module

    monkeypatch.setattr(store_module, "SHARD_TOKENS", 4 << 20)
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 4 << 20)
    monkeypatch.setattr(prepare_module, "FLUSH_TOKENS", 1 << 20)
    out = tmp_path / "small-shards"
    prepare_genome([sample_fasta()], out, train="chr1,chr3,chr4,chr5", eval="chr22", progress=False)
    a, b = GenomeStore.open(sample_store), GenomeStore.open(out, verify=True)
    assert sorted(p.name for p in (out / "train.zarr" / "tokens" / "c").iterdir()) == ["0", "1"]
    for name in ("train", "eval"):
        sa, sb = a.split(name), b.split(name)
        assert sa.segments.equals(sb.segments)
        assert np.array_equal(sa.tokens[:], sb.tokens[:])  # exact: integer token ids


def test_softmask_kept_and_counted(tmp_path: Path) -> None:
    """hg38 soft-masked sequence keeps its case; the manifest counts lowercase bases exactly."""
    with gzip.open(SOFTMASKED_CHR16, "rt") as handle:
        handle.readline()
        seq = "".join(line.strip() for line in handle)
    out = tmp_path / "s"
    other = write_fasta(tmp_path / "m.fa", [("chrM", "ACGT" * 10)])
    prepare_genome([SOFTMASKED_CHR16, other], out, train="16", eval="MT", progress=False)
    split = GenomeStore.open(out).split("train")
    tokens = split.tokens[:]
    assert decode(tokens) == seq  # no N in this slice: one segment, the whole record
    contig = split.contigs[0]
    lower = sum(c.islower() for c in seq)
    assert contig["softmasked"] == lower == int(np.count_nonzero(tokens & SOFTMASK))
    assert 0.4 < lower / len(seq) < 0.45


@pytest.mark.parametrize("name", ["1", "chr1", "Chr1", "NC_000001.11", "NC_000001.10", "CM000663.2"])
def test_name_conventions(tmp_path: Path, name: str) -> None:
    path = write_fasta(tmp_path / "g.fa", [(f"{name} some description", "ACGT" * 30), ("NC_000022.11", "GGCC" * 20)])
    out = tmp_path / "out"
    prepare_genome([path], out, train="chr1", eval="22", progress=False)
    store = GenomeStore.open(out)
    assert store.split("train").contigs[0]["name"] == "chr1"
    assert store.split("train").contigs[0]["record"] == name
    assert store.split("eval").contigs[0]["name"] == "chr22"


def test_crlf_single_line_multiple_files_and_min_gap(tmp_path: Path) -> None:
    seq1 = "ACGT" * 50 + "N" * 10 + "acgt" * 50 + "N" * 9 + "TTTT"
    a = tmp_path / "a.fa"
    a.write_bytes(f">chr1\r\n{seq1[:141]}\r\n{seq1[141:282]}\r\n{seq1[282:]}\r\n".encode())
    b = write_fasta(tmp_path / "b.fa", [("chr2", "C" * 5000)], width=10_000)  # one unwrapped line
    out = tmp_path / "o"
    prepare_genome([a, b], out, train="chr1", eval="chr2", min_gap=10, progress=False)
    store = GenomeStore.open(out)
    train = store.split("train")
    assert (
        [(r.start, r.end) for r in train.segments.itertuples()]
        == reference_segments(seq1, 10)
        == [(0, 200), (210, len(seq1))]
    )
    assert decode(train.tokens[:]) == seq1[:200] + seq1[210:]
    assert train.contigs[0]["dropped"] == 10 and train.contigs[0]["n"] == 9 and train.contigs[0]["gaps"] == 1
    assert decode(store.split("eval").tokens[:]) == "C" * 5000


def test_genbank_and_embl(tmp_path: Path) -> None:
    from Bio import SeqIO
    from Bio.Seq import Seq
    from Bio.SeqRecord import SeqRecord

    seq1, seq22 = "ACGTTGCA" * 40 + "RYN" + "GATTACA" * 30, "TTAGGG" * 50
    for fmt in ("genbank", "embl"):
        path = tmp_path / f"g.{fmt}"
        records = [
            SeqRecord(Seq(s), id=i, name=i.split(".")[0], description="test", annotations={"molecule_type": "DNA"})
            for i, s in (("NC_000001.11", seq1), ("NC_000022.11", seq22))
        ]
        SeqIO.write(records, path, fmt)
        out = tmp_path / fmt
        result = prepare_genome([path], out, train="chr1", eval="chr22", progress=False)
        assert result.manifest["sources"][0]["format"] == fmt
        store = GenomeStore.open(out)
        assert decode(store.split("train").tokens[:]) == expected_text(seq1)
        assert store.split("train").contigs[0]["ambiguous"] == 2
        assert decode(store.split("eval").tokens[:]) == seq22


def test_store_readable_by_plain_zarr(sample_store: Path) -> None:
    """No genolong needed to read a store: zarr v3 metadata, uint8 tokens, the segment table."""
    manifest = json.loads((sample_store / "manifest.json").read_text())
    meta = json.loads((sample_store / "eval.zarr" / "tokens" / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["data_type"] == "uint8"
    group = zarr.open_group(str(sample_store / "eval.zarr"), mode="r")
    starts = group["segments"]["start"][:]
    offsets = group["segments"]["offset"][:]
    assert list(group.attrs["contigs"]) == ["chr22"]
    assert [[c["name"] for c in manifest["splits"]["eval"]["contigs"]]] == [["chr22"]]
    assert group["tokens"].shape == (900_000,) and starts[0] == 20_000_000 + 0 and offsets[0] == 0


def test_force_replaces_and_keeps_store_valid(tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", [("chr1", "ACGT" * 100), ("chr22", "GG" * 100)])
    out = tmp_path / "o"
    prepare_genome([path], out, train="chr1", progress=False)
    first = GenomeStore.open(out).manifest["created"]
    path2 = write_fasta(tmp_path / "h.fa", [("chr1", "TTTT" * 100), ("chr22", "CC" * 100)])
    prepare_genome([path2], out, force=True, progress=False, train="chr1")
    store = GenomeStore.open(out)
    assert decode(store.split("train").tokens[:4]) == "TTTT" and store.manifest["created"] >= first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.fa", "h.fa", "o"]


_BASES = st.sampled_from(list("ACGTacgtRYKMSWBDHVrykmswbdhvNn"))


@st.composite
def _genome(draw: st.DrawFn) -> tuple[list[tuple[str, str]], int, int, int, str]:
    min_gap = draw(st.integers(1, 12))
    records = []
    for name in ("chr1", "chr2", "chr22")[: draw(st.integers(2, 3))]:
        parts = []
        for _ in range(draw(st.integers(1, 8))):
            if draw(st.booleans()):
                parts.append(
                    draw(st.sampled_from("Nn"))
                    * draw(st.sampled_from([1, min_gap - 1, min_gap, min_gap + 1, 3 * min_gap]))
                )
            else:
                parts.append("".join(draw(st.lists(_BASES, min_size=1, max_size=40))))
        seq = "".join(parts) or "A"
        records.append((name, seq))
    width = draw(st.integers(1, 70))
    block = draw(st.integers(3, 400))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    return records, min_gap, width, block, newline


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_genome(), st.sampled_from(["plain", "gzip", "bgzip", "bgzip-indexed", "plain-indexed"]))
def test_property_round_trip(tmp_path_factory: pytest.TempPathFactory, genome, compress: str) -> None:
    """Random FASTA -> prepare -> decode gives the input back (IUPAC -> N) in the reference segments."""
    records, min_gap, width, block, newline = genome
    tmp = tmp_path_factory.mktemp("prop")
    path = tmp / "g.fa"
    if compress.startswith("bgzip") or compress == "plain-indexed":
        newline = "\n"  # samtools faidx indexes LF files only
        write_fasta(
            path,
            records,
            width=width,
            compress=None if compress == "plain-indexed" else "bgzip",
            index=compress.endswith("indexed"),
        )
    else:
        write_fasta(path, records, width=width, compress=None if compress == "plain" else "gzip", newline=newline)
    expected = {canon: seq for canon, seq in records}
    has_bases = {name: reference_segments(seq, min_gap) for name, seq in expected.items()}
    names = list(expected)
    out = tmp / "o"
    prepare_genome([path], out, train=names[:-1], eval=names[-1:], min_gap=min_gap, progress=False, block_bytes=block)
    store = GenomeStore.open(out)
    for split in store:
        for contig in split.contigs:
            seq = expected[contig["name"]]
            want = has_bases[contig["name"]]
            got = _record_text(split, contig["name"])
            assert list(got) == want
            for (s, e), text in got.items():
                assert text == expected_text(seq[s:e])
            assert contig["length"] == len(seq)
            assert contig["kept"] + contig["dropped"] == len(seq)
            assert contig["ambiguous"] == sum(c in "RYKMSWBDHVrykmswbdhv" for c in seq)


def test_plain_indexed_round_trip_against_pyfaidx(tmp_path: Path) -> None:
    """Plain FASTA + .fai (read by random access) agrees base for base with pyfaidx."""
    import pyfaidx

    rng = np.random.default_rng(7)
    letters = np.array(list("ACGTacgtN"))
    records = [
        (name, "".join(rng.choice(letters, size)))
        for name, size in (("chr1", 50_001), ("chr2", 777), ("chr22", 12_345))
    ]
    path = write_fasta(tmp_path / "g.fa", records, width=70, index=True)
    out = tmp_path / "o"
    result = prepare_genome([path], out, min_gap=3, progress=False, block_bytes=4096)
    assert result.manifest["sources"][0]["format"] == "fasta-indexed"
    reference = pyfaidx.Fasta(str(path), sequence_always_upper=False)
    store = GenomeStore.open(out)
    for split in store:
        for contig in split.contigs:
            for (start, end), text in _record_text(split, contig["name"]).items():
                assert text == str(reference[contig["record"]][start:end])

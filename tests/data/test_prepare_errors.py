"""Bad input: a clear one-line error naming the input and the fix, exit code 2, nothing left behind."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from genolong.cli import main
from genolong.data import GenomeStore
from genolong.errors import InputError, StoreError
from tests.helpers import write_fasta

GOOD = [("chr1", "ACGT" * 40), ("chr2", "GGCCA" * 20), ("chr22", "TTGCA" * 30)]


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["prepare", *args, "--quiet"])
    err = capsys.readouterr().err.strip()
    return code, err


def _assert_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, inputs: list[Path], *needles: str, extra: tuple[str, ...] = ()
) -> str:
    out = tmp_path / "genome"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = _run_cli(capsys, *map(str, inputs), "--out", str(out), *extra)
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("genolong prepare: error: ")
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary directory left
    return err


def test_missing_file(capsys, tmp_path: Path) -> None:
    _assert_fails(capsys, tmp_path, [tmp_path / "nope.fa"], "nope.fa", "no such file")


def test_empty_file(capsys, tmp_path: Path) -> None:
    empty = tmp_path / "empty.fa"
    empty.write_bytes(b"")
    _assert_fails(capsys, tmp_path, [empty], "empty.fa", "empty")
    empty_gz = tmp_path / "empty.fa.gz"
    with gzip.open(empty_gz, "wb"):
        pass
    _assert_fails(capsys, tmp_path, [empty_gz], "empty.fa.gz", "empty")


def test_not_fasta_text(capsys, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("chromosome 1\nACGT\n")
    _assert_fails(capsys, tmp_path, [text], "notes.txt", "not a FASTA file", "does not start with '>'")


def test_binary_file(capsys, tmp_path: Path) -> None:
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    _assert_fails(capsys, tmp_path, [binary], "blob.bin", "binary")


def test_record_without_sequence(capsys, tmp_path: Path) -> None:
    path = tmp_path / "g.fa"
    path.write_text(">chr1\nACGT\n>chr2\n>chr22\nACGT\n")
    _assert_fails(capsys, tmp_path, [path], "'chr2'", "line 3", "no sequence")


@pytest.mark.parametrize("second", ["chr1", "1", "NC_000001.11"])
def test_duplicate_records(capsys, tmp_path: Path, second: str) -> None:
    path = write_fasta(tmp_path / "g.fa", [*GOOD, (second, "ACGT")])
    err = _assert_fails(capsys, tmp_path, [path], "duplicate record", "'chr1'", f"'{second}'")
    if second != "chr1":
        assert "both are chr1" in err


def test_duplicate_across_files(capsys, tmp_path: Path) -> None:
    a = write_fasta(tmp_path / "a.fa", GOOD)
    b = write_fasta(tmp_path / "b.fa", [("chr22", "ACGT")])
    _assert_fails(capsys, tmp_path, [a, b], "duplicate record", "a.fa", "b.fa")


def test_requested_chromosome_absent_lists_records(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD)
    _assert_fails(
        capsys, tmp_path, [path], "chrX not found", "the input has: chr1, chr2, chr22", extra=("--eval", "chrX")
    )


def test_chromosome_in_both_splits(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD)
    _assert_fails(capsys, tmp_path, [path], "1 (chr1) is in both --train and --eval", extra=("--eval", "1"))


def test_invalid_character_names_record_and_line(capsys, tmp_path: Path) -> None:
    path = tmp_path / "g.fa"
    path.write_text(">chr1\nACGT\n>chr2 desc\nACGTACGT\nACGTAC-T\nAC\n>chr22\nA\n")
    _assert_fails(capsys, tmp_path, [path], "record 'chr2'", "line 5", "column 7", "invalid character '-'")


def test_invalid_character_gzip_and_indexed(capsys, tmp_path: Path) -> None:
    records = [("chr1", "ACGT" * 30 + "E" + "ACGT"), ("chr2", "ACGT"), ("chr22", "ACGT")]
    gz = write_fasta(tmp_path / "g.fa.gz", records, compress="gzip")
    _assert_fails(capsys, tmp_path, [gz], "record 'chr1'", "line 4", "invalid character 'E'")
    bgz = write_fasta(tmp_path / "h.fa.gz", records, compress="bgzip", index=True)
    _assert_fails(
        capsys, tmp_path, [bgz], "record 'chr1' (lines counted from its header)", "line 4", "invalid character 'E'"
    )


def test_truncated_gzip(capsys, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    seq = "".join(rng.choice(list("ACGT"), 200_000))
    full = write_fasta(tmp_path / "full.fa.gz", [("chr1", seq), ("chr2", seq), ("chr22", seq)], compress="gzip")
    cut = tmp_path / "cut.fa.gz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    full.unlink()
    _assert_fails(capsys, tmp_path, [cut], "cut.fa.gz", "truncated", "gzip -t")


def test_fai_that_does_not_match(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD, index=True)
    other = write_fasta(
        tmp_path / "other.fa", [("chr1", "A" * 1000), ("chr2", "C" * 10), ("chr22", "G" * 10)], index=True
    )
    shutil.copy(Path(f"{other}.fai"), Path(f"{path}.fai"))
    _assert_fails(capsys, tmp_path, [path], "g.fa.fai", "does not match", "samtools faidx")


def test_bgzip_fai_that_does_not_match(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa.gz", GOOD, compress="bgzip", index=True)
    fai = Path(f"{path}.fai")
    lines = fai.read_text().splitlines()
    name, length, *rest = lines[1].split("\t")
    lines[1] = "\t".join([name, str(int(length) + 7), *rest])  # chr2 longer than it is
    fai.write_text("\n".join(lines) + "\n")
    _assert_fails(capsys, tmp_path, [path], "g.fa.gz.fai", "does not match", "'chr2'")


@pytest.mark.parametrize(
    ("body", "line"),
    [
        ("ACGTACGT\nACGTAC\nACGTACGT\n", 4),  # a short line in the middle
        ("ACGTACGT\nACGTACGTA\n", 3),  # a longer line
        ("ACGTACGT\n\nACGT\n", 4),  # a blank line in the middle
    ],
)
def test_inconsistent_line_widths(capsys, tmp_path: Path, body: str, line: int) -> None:
    path = tmp_path / "g.fa"
    path.write_text(f">chr1\n{body}>chr2\nACGT\n>chr22\nACGT\n")
    _assert_fails(capsys, tmp_path, [path], "record 'chr1'", f"line {line}", "inconsistent line widths")


def test_trailing_blank_lines_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "g.fa"
    path.write_text(">chr1\nACGTACGT\nACG\n\n\n>chr2\nACGT\n>chr22\nACGT\n\n")
    assert main(["prepare", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 0


def test_output_exists_without_force(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD)
    out = tmp_path / "genome"
    assert main(["prepare", str(path), "--out", str(out), "--quiet"]) == 0
    created = GenomeStore.open(out).manifest["created"]
    code, err = _run_cli(capsys, str(path), "--out", str(out))
    assert code == 2 and "already exists" in err and "--force" in err
    assert GenomeStore.open(out).manifest["created"] == created


def test_force_refuses_foreign_directory(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD)
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    code, err = _run_cli(capsys, str(path), "--out", str(foreign), "--force")
    assert code == 2 and "not a genolong genome store" in err
    assert (foreign / "thesis.tex").read_text() == "precious"


def test_output_not_writable(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD)
    # /proc refuses new directories even for root, unlike a chmod-ed directory
    code, err = _run_cli(capsys, str(path), "--out", "/proc/genolong-store")
    assert code == 2 and "/proc/genolong-store" in err and "writable" in err
    code, err = _run_cli(capsys, str(path), "--out", str(tmp_path / "missing" / "genome"))
    assert code == 2 and "does not exist" in err


def _damage(store: Path, how: str) -> None:
    if how == "manifest-json":
        (store / "manifest.json").write_text("{ not json")
    elif how == "manifest-missing":
        (store / "manifest.json").unlink()
    elif how == "schema":
        manifest = json.loads((store / "manifest.json").read_text())
        manifest["schema_version"] = 99
        (store / "manifest.json").write_text(json.dumps(manifest))
    elif how == "shard-byte":
        shard = next((store / "train.zarr" / "tokens" / "c").iterdir())
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "shard-missing":
        next((store / "train.zarr" / "tokens" / "c").iterdir()).unlink()
    elif how == "segments":
        manifest = json.loads((store / "manifest.json").read_text())
        manifest["splits"]["train"]["segments"][0][2] += 1
        (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "how", ["manifest-json", "manifest-missing", "schema", "shard-byte", "shard-missing", "segments"]
)
def test_damaged_store_is_refused(tmp_path: Path, how: str) -> None:
    path = write_fasta(tmp_path / "g.fa", GOOD)
    out = tmp_path / "genome"
    assert main(["prepare", str(path), "--out", str(out), "--quiet"]) == 0
    GenomeStore.open(out)
    _damage(out, how)
    with pytest.raises(StoreError, match="genome store .*(prepare|schema version)"):
        GenomeStore.open(out)


def test_region_name_length_mismatch(capsys, tmp_path: Path) -> None:
    path = write_fasta(tmp_path / "g.fa", [("chr1:101-200", "ACGT" * 10), ("chr22", "ACGT")])
    _assert_fails(capsys, tmp_path, [path], "'chr1:101-200'", "100 bases", "has 40", extra=("--train", "chr1"))


def test_input_error_is_value_error() -> None:
    assert issubclass(InputError, ValueError)


_KILL_SCRIPT = """
import sys
from genolong.data.prepare import prepare_genome
prepare_genome([sys.argv[1]], sys.argv[2], train="chr1,chr2", eval="chr22", progress=False, block_bytes=1 << 16)
"""


@pytest.mark.slow
def test_sigkill_leaves_no_valid_store_and_next_run_succeeds(tmp_path: Path) -> None:
    """SIGKILL at several points of a run: --out is either absent or the complete store, no
    temporary directory opens as a store, and the next run cleans up and succeeds."""
    rng = np.random.default_rng(1)
    seq = "".join(rng.choice(list("ACGTacgtN"), 3_000_000))
    path = write_fasta(tmp_path / "g.fa", [("chr1", seq), ("chr2", seq[::-1]), ("chr22", seq[:500_000])])
    work = tmp_path / "work"
    work.mkdir()
    out = work / "genome"
    reference = tmp_path / "reference"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(path), str(reference)], check=True)
    full = time.perf_counter() - t0
    expected = GenomeStore.open(reference).split("train").tokens[:]
    outcomes = []
    for fraction in (0.2, 0.45, 0.7, 0.85, 0.95, 1.0):
        proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(path), str(out)])
        time.sleep(full * fraction)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for leftover in work.iterdir():
            if leftover != out:
                with pytest.raises(StoreError):
                    GenomeStore.open(leftover)
        try:
            store = GenomeStore.open(out)
        except StoreError:
            outcomes.append("killed")
        else:  # the kill came after the final rename: the store must be whole
            assert np.array_equal(store.split("train").tokens[:], expected)  # exact: tokens
            outcomes.append("complete")
            shutil.rmtree(out)
    assert "killed" in outcomes
    subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(path), str(out)], check=True)
    assert np.array_equal(GenomeStore.open(out).split("train").tokens[:], expected)  # exact: tokens
    assert [p.name for p in work.iterdir()] == ["genome"]  # leftovers of killed runs are cleaned up

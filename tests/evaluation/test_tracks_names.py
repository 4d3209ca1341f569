"""The user's own chromosome names in, the same names out (issue 46, item 5).

A b37 / Ensembl genome names chromosome 22 ``22``. ``prepare`` keeps looking it up by any alias
(``chr22``, ``22``, ``NC_000022.10``) and records ``22`` as the name its outputs use (``--names
source``, the default); ``--names ucsc`` writes ``chr22``. ``genolong tracks`` takes the FASTA's own
``.fai`` (made by pysam / samtools, the oracle here) as ``--chrom-sizes``.

Real DNA: the first 120 kb of GRCh37 chr22:20,000,001-21,000,000 written as ``>22`` (a whole
chromosome 22 of that length, as a b37 FASTA names it), and GRCh37 chr1's start (header ``>1``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyBigWig
import pysam
import pytest
import torch

from genolong.cli import main
from genolong.model import PRESETS, GenoLM
from tests.helpers import write_fasta

pytestmark = pytest.mark.usefixtures("one_thread")

_HUMAN = Path("/work/shared/data/human")
_COMMON = ["--max-tiles", "2", "--context", "256", "--first-bucket", "64", "--quiet"]


def _sequence(name: str, limit: int) -> str:
    """The first ``limit`` bases of a one-record gzip FASTA of the shared human data."""
    with gzip.open(_HUMAN / name, "rt") as handle:
        lines = [line.strip() for line in handle if not line.startswith(">")]
    return "".join(lines)[:limit]


@pytest.fixture(scope="module")
def b37(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A b37-named FASTA (``>1``, ``>22``) with its pysam ``.fai``, and a tiny random model."""
    root = tmp_path_factory.mktemp("b37")
    seq22 = _sequence("GRCh37_chr22_20000001-21000000.fa.gz", 120_000)
    assert seq22.count("N") < len(seq22) // 2
    fasta = write_fasta(
        root / "ref.fa", [("22", seq22), ("1 dna:chromosome", _sequence("GRCh37_chr1_truncated_240kb.fa.gz", 50_000))]
    )
    pysam.faidx(str(fasta))
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(root / "model")
    return root


def test_b37_names_round_trip(b37: Path, tmp_path: Path) -> None:
    fasta = b37 / "ref.fa"
    assert (b37 / "ref.fa.fai").read_text().splitlines()[0].split("\t")[:2] == ["22", "120000"]
    # prepare looks 22 up as chr22 (an alias) and records 22 as the name outputs use
    assert (
        main(
            [
                "prepare",
                str(fasta),
                "--out",
                str(tmp_path / "store"),
                "--train",
                "chr1",
                "--eval",
                "NC_000022.10",
                "--quiet",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["names"] == "source"
    (contig,) = manifest["splits"]["eval"]["contigs"]
    assert (contig["name"], contig["output_name"], contig["record"]) == ("chr22", "22", "22")
    assert [c["output_name"] for c in manifest["splits"]["train"]["contigs"]] == ["1"]
    # evaluate --tracks: the files say 22, as the user's FASTA does
    out = tmp_path / "eval"
    assert (
        main(
            [
                "evaluate",
                str(b37 / "model"),
                "--store",
                str(tmp_path / "store"),
                *_COMMON,
                "--tracks",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    tracks = out / "tracks"
    assert (tracks / "chrom.sizes").read_text() == "22\t120000\n"
    name = next(p.stem for p in tracks.glob("*.bw"))
    bw = pyBigWig.open(str(tracks / f"{name}.bw"))
    assert bw.chroms() == {"22": 120_000} and len(bw.intervals("22")) > 400
    bw.close()
    lines = (tracks / f"{name}.bedGraph").read_text().splitlines()[1:]
    assert lines and all(line.startswith("22\t") for line in lines)
    # genolong tracks with the FASTA's own .fai as the chromosome sizes: accepted, the names kept
    assert main(["tracks", str(out), "--chrom-sizes", f"{fasta}.fai", "--out", str(tmp_path / "fai")]) == 0
    assert (tmp_path / "fai" / "chrom.sizes").read_text() == "1\t50000\n22\t120000\n"
    bw = pyBigWig.open(str(tmp_path / "fai" / f"{name}.bw"))
    assert bw.chroms() == {"1": 50_000, "22": 120_000}
    bw.close()
    # a UCSC chrom.sizes: its names are the names written (chr22), found through the aliases
    sizes = tmp_path / "hg19.sizes"
    sizes.write_text("chr22\t51304566\n")
    assert main(["tracks", str(out), "--chrom-sizes", str(sizes), "--out", str(tmp_path / "ucsc")]) == 0
    assert (tmp_path / "ucsc" / f"{name}.bedGraph").read_text().splitlines()[1].startswith("chr22\t")


def test_prepare_names_ucsc(b37: Path, tmp_path: Path) -> None:
    assert (
        main(
            [
                "prepare",
                str(b37 / "ref.fa"),
                "--out",
                str(tmp_path / "store"),
                "--train",
                "1",
                "--eval",
                "22",
                "--names",
                "ucsc",
                "--quiet",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["names"] == "ucsc"
    assert [(c["name"], c["output_name"]) for c in manifest["splits"]["eval"]["contigs"]] == [("chr22", "chr22")]
    out = tmp_path / "eval"
    assert (
        main(
            [
                "evaluate",
                str(b37 / "model"),
                "--store",
                str(tmp_path / "store"),
                *_COMMON,
                "--tracks",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "tracks" / "chrom.sizes").read_text() == "chr22\t120000\n"

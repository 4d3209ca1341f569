"""Browser tracks of evaluation results (genolong tracks, evaluate --tracks): bigWig and bedGraph.

A 2-process ``evaluate --tracks`` (``parallel.devices=2``, Lightning starts rank 1) writes the
tracks of the one-process run, from rank 0 alone.

Oracles: the per-token parquet table (read with pyarrow, not through the tracks module), the
sample FASTA's own ``.fai`` index for the chromosome sizes, pyBigWig reading the files back, and
pandas parsing the bedGraph.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pyBigWig
import pytest
import torch

from genolong.cli import main
from genolong.data.names import parse_record_name
from genolong.errors import InputError
from genolong.evaluation.tracks import Track, track_name, write_tracks
from genolong.model import PRESETS, GenoLM
from genolong.quickstart import SAMPLE_EVAL, sample_fasta

pytestmark = pytest.mark.usefixtures("one_thread")

_COMMON = ["--max-tiles", "3", "--first-bucket", "64", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, sample_store: Path) -> Path:
    """A tiny random model evaluated on the sample's first 3 held-out tiles of 256: full context
    with --tracks, the same tiles with the context cut at 32, other tiles (L 128), no tokens."""
    root = tmp_path_factory.mktemp("tracks")
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(root / "model")
    common = [str(root / "model"), "--store", str(sample_store), *_COMMON]
    assert (
        main(["evaluate", *common, "--context", "256", "--label", "tiny full", "--tracks", "--out", str(root / "full")])
        == 0
    )
    assert main(["evaluate", *common, "--context", "256", "--context-cut", "32", "--out", str(root / "cut")]) == 0
    assert main(["evaluate", *common, "--context", "128", "--out", str(root / "short")]) == 0
    assert main(["evaluate", *common, "--context", "256", "--no-tokens", "--out", str(root / "bare")]) == 0
    return root


def _tokens(result: Path) -> pd.DataFrame:
    """The per-token table, read directly: contig, position, nll (float32)."""
    parts = sorted((result / "tokens").glob("part-*.parquet"))
    frame = pd.concat(
        [pq.read_table(p, columns=["contig", "position", "nll"]).to_pandas() for p in parts], ignore_index=True
    )
    frame["contig"] = frame["contig"].astype(str)
    return frame


def _fasta_sizes(contigs: tuple[str, ...]) -> dict[str, int]:
    """Chromosome sizes from the sample FASTA's .fai: a ``NAME:START-END`` record reaches START - 1 + its length."""
    sizes = {}
    for line in Path(f"{sample_fasta()}.fai").read_text().splitlines():
        record, length = line.split("\t")[:2]
        region = parse_record_name(record)
        if region.contig in contigs:
            sizes[region.contig] = region.start + int(length)
    return sizes


def _bigwig(path: Path) -> tuple[dict[str, int], pd.DataFrame]:
    """Header and every entry of a bigWig file."""
    bw = pyBigWig.open(str(path))
    try:
        chroms = dict(bw.chroms())
        rows = [(c, s, e, v) for c in chroms for s, e, v in (bw.intervals(c) or [])]
    finally:
        bw.close()
    return chroms, pd.DataFrame(rows, columns=["contig", "start", "end", "value"])


def _bedgraph(path: Path) -> tuple[str, pd.DataFrame]:
    """The track line and the data lines of a bedGraph file."""
    first, *_ = path.read_text().splitlines()[:1]
    frame = pd.read_csv(
        path,
        sep="\t",
        skiprows=1,
        header=None,
        names=["contig", "start", "end", "value"],
        dtype={"contig": str, "start": np.int64, "end": np.int64, "value": np.float64},
    )
    return first, frame


def test_evaluate_tracks_hold_the_per_token_loss_at_its_position(runs: Path) -> None:
    table = _tokens(runs / "full")
    tracks = runs / "full" / "tracks"
    assert sorted(p.name for p in tracks.iterdir()) == ["chrom.sizes", "tiny_full.nll.bedGraph", "tiny_full.nll.bw"]
    chroms, entries = _bigwig(tracks / "tiny_full.nll.bw")
    # the sizes of the source FASTA (chr22:20000001-21000000 ends at 21,000,000), also in chrom.sizes
    assert chroms == _fasta_sizes(SAMPLE_EVAL) == {"chr22": 21_000_000}
    assert (tracks / "chrom.sizes").read_text() == "chr22\t21000000\n"
    # one span-1 entry per scored base, its value the table's float32 exactly
    assert (entries["end"] - entries["start"] == 1).all() and len(entries) == len(table) > 700
    assert entries["contig"].tolist() == table["contig"].tolist()
    np.testing.assert_array_equal(entries["start"].to_numpy(), table["position"].to_numpy())
    np.testing.assert_array_equal(entries["value"].to_numpy(np.float32), table["nll"].to_numpy())
    # unscored bases (each tile's first, any N) read back as no value
    bw = pyBigWig.open(str(tracks / "tiny_full.nll.bw"))
    lo, hi = int(table["position"].min()) - 5, int(table["position"].max()) + 5
    values = np.asarray(bw.values("chr22", lo, hi, numpy=True))
    bw.close()
    scored = np.zeros(hi - lo, bool)
    scored[table["position"].to_numpy() - lo] = True
    assert (~scored).sum() >= 5 + 4 + 2  # the padding either side and the 2nd and 3rd tiles' first bases
    assert np.isnan(values[~scored]).all()
    np.testing.assert_array_equal(values[scored].astype(np.float32), table["nll"].to_numpy())
    # the bedGraph: a UCSC track line, then the same bases and values, sorted
    line, bed = _bedgraph(tracks / "tiny_full.nll.bedGraph")
    assert line.startswith(
        'track type=bedGraph name="tiny full loss" description="genolong per-base loss (nats) of tiny full'
    )
    assert bed["contig"].tolist() == table["contig"].tolist()
    np.testing.assert_array_equal(bed["start"].to_numpy(), table["position"].to_numpy())
    assert (bed["end"] == bed["start"] + 1).all() and (np.diff(bed["start"].to_numpy()) > 0).all()
    np.testing.assert_array_equal(
        bed["value"].to_numpy().astype(np.float32), table["nll"].to_numpy()
    )  # shortest float32 repr round-trips


def test_tracks_of_two_results_hold_b_minus_a(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = runs / "pair"
    assert main(["tracks", str(runs / "full"), str(runs / "cut"), "--out", str(out)]) == 0
    assert "7 files" in capsys.readouterr().out
    cut_name = track_name(json.loads((runs / "cut" / "meta.json").read_text())["label"])
    assert cut_name == "model_cut_32"
    stem = f"{cut_name}-minus-tiny_full.diff"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "chrom.sizes",
            f"{stem}.bw",
            f"{stem}.bedGraph",
            "tiny_full.nll.bw",
            "tiny_full.nll.bedGraph",
            f"{cut_name}.nll.bw",
            f"{cut_name}.nll.bedGraph",
        ]
    )
    a, b = _tokens(runs / "full"), _tokens(runs / "cut")
    assert a[["contig", "position"]].equals(b[["contig", "position"]])
    expected = b["nll"].to_numpy() - a["nll"].to_numpy()  # float32 - float32: the correctly rounded difference
    assert (expected != 0).any() and (expected == 0).any()  # bases past 32 of context differ, the first 32 do not
    chroms, entries = _bigwig(out / f"{stem}.bw")
    assert chroms == {"chr22": 21_000_000}
    np.testing.assert_array_equal(entries["start"].to_numpy(), a["position"].to_numpy())
    np.testing.assert_array_equal(entries["value"].to_numpy(np.float32), expected)
    line, bed = _bedgraph(out / f"{stem}.bedGraph")
    assert (
        "B - A" in line
        and "B = model cut 32, A = tiny full" in line
        and "negative = B predicts the base better" in line
    )
    np.testing.assert_array_equal(bed["value"].to_numpy().astype(np.float32), expected)
    # each result's own loss track is there too, equal to its table
    _, own = _bigwig(out / f"{cut_name}.nll.bw")
    np.testing.assert_array_equal(own["value"].to_numpy(np.float32), b["nll"].to_numpy())
    # the default output is the (last) result's tracks/; an existing one needs --force
    assert main(["tracks", str(runs / "cut")]) == 0
    assert (runs / "cut" / "tracks" / f"{cut_name}.nll.bw").is_file()
    assert main(["tracks", str(runs / "cut")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["tracks", str(runs / "cut"), "--force"]) == 0
    # --chrom-sizes replaces the store's sizes (an assembly's full chromosome)
    sizes = runs / "hg19.chrom.sizes"
    sizes.write_text("chr1\t249250621\nchr22\t51304566\n")
    assert main(["tracks", str(runs / "full"), "--chrom-sizes", str(sizes), "--out", str(runs / "hg19")]) == 0
    assert _bigwig(runs / "hg19" / "tiny_full.nll.bw")[0] == {"chr1": 249_250_621, "chr22": 51_304_566}


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> None:
    capsys.readouterr()  # what earlier steps of the test printed (a fixture's model loading) is not this command's
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    for word in words:
        assert word in err, (word, err)


def test_bad_input_is_one_line_and_writes_nothing(
    runs: Path, sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # --tracks without the per-token table: refused before the model is loaded
    _one_line_error(
        capsys,
        [
            "evaluate",
            str(tmp_path / "no-model"),
            "--store",
            str(sample_store),
            "--context",
            "64",
            "--tracks",
            "--no-tokens",
            "--out",
            str(out),
        ],
        "--no-tokens",
        "--tracks",
    )
    _one_line_error(
        capsys, ["tracks", str(runs / "bare"), "--out", str(out)], "no per-token table", "without --no-tokens"
    )
    _one_line_error(
        capsys,
        ["tracks", str(runs / "full"), str(runs / "short"), "--out", str(out)],
        "different token sets",
        "--context",
    )
    _one_line_error(capsys, ["tracks", str(tmp_path / "absent"), "--out", str(out)], "does not exist")
    _one_line_error(
        capsys,
        ["tracks", str(runs / "full"), str(runs / "cut"), str(runs / "full"), "--out", str(out)],
        "one result or of two",
    )
    # a store that moved: named, with both fixes; --store finds it
    moved = tmp_path / "moved"
    shutil.copytree(runs / "full", moved, ignore=shutil.ignore_patterns("tracks"))
    meta = json.loads((moved / "meta.json").read_text())
    (moved / "meta.json").write_text(json.dumps({**meta, "store": str(tmp_path / "gone")}))
    _one_line_error(
        capsys, ["tracks", str(moved), "--out", str(out)], "is not there", "--store DIR", "--chrom-sizes FILE"
    )
    assert main(["tracks", str(moved), "--store", str(sample_store), "--out", str(tmp_path / "found")]) == 0
    # sizes that lack the chromosome or are too short
    sizes = tmp_path / "sizes"
    sizes.write_text("chr1\t1000\n")
    _one_line_error(
        capsys,
        ["tracks", str(runs / "full"), "--chrom-sizes", str(sizes), "--out", str(out)],
        "lack chr22",
        "--chrom-sizes FILE",
    )
    sizes.write_text("chr22\t20000000\n")
    _one_line_error(capsys, ["tracks", str(runs / "full"), "--chrom-sizes", str(sizes), "--out", str(out)], "beyond")
    sizes.write_text("chr22 twenty\n")
    _one_line_error(capsys, ["tracks", str(runs / "full"), "--chrom-sizes", str(sizes), "--out", str(out)], "line 1")
    # a position scored twice (a part copied under another tile's name): damaged, refused
    shutil.copy(moved / "tokens" / "part-00000.parquet", moved / "tokens" / "part-00099.parquet")
    _one_line_error(
        capsys,
        ["tracks", str(moved), "--store", str(sample_store), "--out", str(out)],
        "more than once",
        "re-run `genolong evaluate`",
    )
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_tracks_sort_chromosomes_as_ucsc_tools_do(tmp_path: Path) -> None:
    """Several chromosomes, given in karyotype order: header and bedGraph in byte order of the name
    (``sort -k1,1 -k2,2n``, what bedGraphToBigWig requires), gaps without entries."""
    contig = np.array(["chr2"] * 3 + ["chr10"] * 2 + ["chr1"] * 2, object)
    position = np.array([5, 6, 9, 0, 1, 100, 101], np.int64)
    value = np.array([0.5, 1.25, -2.0, 3.0, 4.0, 1e-7, 7.0], np.float32)
    order = np.lexsort((position, contig))
    track = Track("t", "nll", "t loss", "test", contig[order], position[order], value[order])
    sizes = {"chr2": 20, "chr10": 5, "chr1": 200}
    write_tracks(tmp_path / "t", [track], sizes)
    chroms, entries = _bigwig(tmp_path / "t" / "t.nll.bw")
    assert list(chroms) == ["chr1", "chr10", "chr2"] and chroms == sizes
    assert list(zip(entries["contig"], entries["start"])) == [
        ("chr1", 100),
        ("chr1", 101),
        ("chr10", 0),
        ("chr10", 1),
        ("chr2", 5),
        ("chr2", 6),
        ("chr2", 9),
    ]
    np.testing.assert_array_equal(
        entries["value"].to_numpy(np.float32), np.float32([1e-7, 7.0, 3.0, 4.0, 0.5, 1.25, -2.0])
    )
    _, bed = _bedgraph(tmp_path / "t" / "t.nll.bedGraph")
    assert bed[["contig", "start"]].equals(entries[["contig", "start"]])
    np.testing.assert_array_equal(bed["value"].to_numpy().astype(np.float32), entries["value"].to_numpy(np.float32))
    with pytest.raises(InputError, match="beyond"):
        write_tracks(tmp_path / "u", [track], {**sizes, "chr10": 1})
    assert not (tmp_path / "u").exists()


def test_track_names_are_file_safe() -> None:
    assert track_name("fine-tuned, cut at 1,024") == "fine-tuned_cut_at_1_024"
    assert track_name("quickstart+lora") == "quickstart+lora"
    assert track_name("a/b c") == "a_b_c"
    assert track_name("///") == "result"


def test_tracks_is_a_light_command(runs: Path, tmp_path: Path) -> None:
    """`genolong tracks` loads no torch (a fresh interpreter; torch would add seconds of start-up)."""
    code = (
        "import sys\nfrom genolong.cli import main\nrc = main(sys.argv[1:])\n"
        "print('HEAVY', rc, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'pandas'}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "tracks", str(runs / "full"), "--out", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY 0 ['pandas']" in proc.stdout, proc.stdout  # pandas: the check sees what the command imports


def test_evaluate_tracks_zoom_levels_equal_the_per_token_table(runs: Path) -> None:
    """The zoom levels of `evaluate --tracks` agree with the parquet's per-base loss (issue 46;
    the wider layouts are in test_tracks_zoom.py)."""
    from tests.evaluation.test_tracks_zoom import _check_zooms

    table = _tokens(runs / "full")
    track = Track(
        "t",
        "nll",
        "t",
        "t",
        table["contig"].to_numpy(object),
        table["position"].to_numpy(np.int64),
        table["nll"].to_numpy(np.float32),
    )
    assert (
        _check_zooms(
            runs / "full" / "tracks" / "tiny_full.nll.bw",
            track,
            {"chr22": 21_000_000},
            np.random.default_rng(0),
            ranges=10,
        )
        >= 20
    )


def test_tracks_formats_bin_and_regions(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = _tokens(runs / "full")
    position, nll = table["position"].to_numpy(), table["nll"].to_numpy()
    # --formats: one of the two files, or both (the default)
    assert main(["tracks", str(runs / "full"), "--formats", "bigwig", "--out", str(tmp_path / "bw")]) == 0
    assert sorted(p.name for p in (tmp_path / "bw").iterdir()) == ["chrom.sizes", "tiny_full.nll.bw"]
    assert main(["tracks", str(runs / "full"), "--formats", "bedGraph", "--out", str(tmp_path / "bg")]) == 0
    assert sorted(p.name for p in (tmp_path / "bg").iterdir()) == ["chrom.sizes", "tiny_full.nll.bedGraph"]
    _one_line_error(
        capsys,
        ["tracks", str(runs / "full"), "--formats", "bigwig,wig", "--out", str(tmp_path / "x")],
        "--formats",
        "bigwig, bedgraph",
    )
    # --bin 64: one interval per 64-base bin of the chromosome, the mean of its scored bases
    assert main(["tracks", str(runs / "full"), "--bin", "64", "--out", str(tmp_path / "bin")]) == 0
    line, bed = _bedgraph(tmp_path / "bin" / "tiny_full.nll.bedGraph")
    assert "64-base" in line
    bins = position // 64
    want = pd.Series(nll.astype(np.float64)).groupby(bins).mean()
    assert bed["start"].tolist() == [int(b) * 64 for b in want.index] and (bed["end"] - bed["start"] == 64).all()
    np.testing.assert_array_equal(bed["value"].to_numpy().astype(np.float32), want.to_numpy().astype(np.float32))
    chroms, entries = _bigwig(tmp_path / "bin" / "tiny_full.nll.bw")
    np.testing.assert_array_equal(entries["value"].to_numpy(np.float32), want.to_numpy().astype(np.float32))
    bw = pyBigWig.open(str(tmp_path / "bin" / "tiny_full.nll.bw"))
    lo, hi = int(want.index[0]) * 64, (int(want.index[-1]) + 1) * 64  # whole bins: the zoomed mean is the bins' mean
    assert bw.stats("chr22", lo, hi)[0] == pytest.approx(want.mean(), rel=1e-6)  # float32 zoom sums
    bw.close()
    _one_line_error(capsys, ["tracks", str(runs / "full"), "--bin", "0", "--out", str(tmp_path / "x")], "--bin")
    # --regions: 0-based half-open, any alias of the name; only the bases inside are written
    first = int(position[0])
    regions = tmp_path / "r.bed"
    regions.write_text(
        f"track name=r\n22\t{first + 10}\t{first + 30}\nNC_000022.10\t{first + 300}\t{first + 301}\n"
        f"chr22\t{first + 25}\t{first + 40}\n"
    )
    assert main(["tracks", str(runs / "full"), "--regions", str(regions), "--out", str(tmp_path / "reg")]) == 0
    inside = ((position >= first + 10) & (position < first + 40)) | (position == first + 300)
    _, bed = _bedgraph(tmp_path / "reg" / "tiny_full.nll.bedGraph")
    np.testing.assert_array_equal(bed["start"].to_numpy(), position[inside])
    np.testing.assert_array_equal(bed["value"].to_numpy().astype(np.float32), nll[inside])
    _, entries = _bigwig(tmp_path / "reg" / "tiny_full.nll.bw")
    np.testing.assert_array_equal(entries["start"].to_numpy(), position[inside])
    # regions and bins together: bins of the bases inside
    assert (
        main(
            [
                "tracks",
                str(runs / "full"),
                "--regions",
                str(regions),
                "--bin",
                "1000",
                "--formats",
                "bedgraph",
                "--out",
                str(tmp_path / "both"),
            ]
        )
        == 0
    )
    _, bed = _bedgraph(tmp_path / "both" / "tiny_full.nll.bedGraph")
    assert (
        bed["value"].to_numpy().astype(np.float32).tolist()
        == pd.Series(nll[inside].astype(np.float64))
        .groupby(position[inside] // 1000)
        .mean()
        .to_numpy()
        .astype(np.float32)
        .tolist()
    )
    # a region off the store, past its chromosome's end, or holding no scored base: one line, nothing written
    for text, words in (
        ("chr1\t0\t10\n", ("chr1", "not in")),
        ("chr22\t20999990\t21000010\n", ("past the end",)),
        ("chr22\t5\t3\n", ("not below",)),
        ("chr22\tfive\t9\n", ("line 1",)),
        (f"chr22\t{first - 5}\t{first}\n", ("no scored base",)),
    ):
        regions.write_text(text)
        _one_line_error(
            capsys,
            ["tracks", str(runs / "full"), "--regions", str(regions), "--out", str(tmp_path / "x")],
            "--regions",
            *words,
        )
    assert not (tmp_path / "x").exists()


def test_evaluate_regions_scores_the_tiles_they_touch(
    runs: Path, sample_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """evaluate --regions: only the tiles sharing a base with a region, each whole; their losses
    those of the same tiles in a run over every tile (one thread: bitwise)."""
    tiles = pd.read_parquet(runs / "full" / "tiles.parquet")
    second, third = tiles.iloc[1], tiles.iloc[2]
    regions = tmp_path / "r.bed"
    # a base at the second tile's end, the third tile's first base (any alias, 0-based half-open)
    regions.write_text(
        f"22\t{second.start + second.length - 1}\t{second.start + second.length}\n"
        f"NC_000022.10\t{third.start}\t{third.start + 1}\n"
    )
    out = tmp_path / "reg"
    assert (
        main(
            [
                "evaluate",
                str(runs / "model"),
                "--store",
                str(sample_store),
                *_COMMON,
                "--context",
                "256",
                "--label",
                "tiny full",
                "--regions",
                str(regions),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    chosen = pd.read_parquet(out / "tiles.parquet")
    assert (
        chosen[["contig", "start", "length"]].values.tolist()
        == tiles.iloc[1:3][["contig", "start", "length"]].values.tolist()
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["regions"]["bases"] == 2 and meta["regions"]["path"] == str(regions)
    every, some = _tokens(runs / "full"), _tokens(out)
    inside = every["position"].between(second.start, third.start + third.length - 1)
    np.testing.assert_array_equal(some["position"].to_numpy(), every["position"][inside].to_numpy())
    np.testing.assert_array_equal(some["nll"].to_numpy(), every["nll"][inside].to_numpy())
    # regions off the store: one line, before the model is loaded, nothing written
    regions.write_text("chr1\t0\t10\n")
    _one_line_error(
        capsys,
        [
            "evaluate",
            str(tmp_path / "no-model"),
            "--store",
            str(sample_store),
            "--context",
            "64",
            "--regions",
            str(regions),
            "--out",
            str(tmp_path / "x"),
        ],
        "--regions",
        "chr1",
        "not in",
    )
    regions.write_text("chr22\t20999000\t21000001\n")
    _one_line_error(
        capsys,
        [
            "evaluate",
            str(tmp_path / "no-model"),
            "--store",
            str(sample_store),
            "--context",
            "64",
            "--regions",
            str(regions),
            "--out",
            str(tmp_path / "x"),
        ],
        "past the end",
    )
    assert not (tmp_path / "x").exists()


def _files(directory: Path) -> list[str]:
    """Every path under ``directory``, relative to it, sorted."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# `genolong evaluate` (a script file: Lightning reruns this command line for rank 1) that notes in
# $TRACK_CALLS which ranks write tracks: every call of the writers evaluate can reach
_SPY = """
import os, sys
from pathlib import Path
import genolong.evaluation.score as score
import genolong.evaluation.tracks as tracks

def spy(name, real):
    def call(*args, **kwargs):
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
        (Path(os.environ["TRACK_CALLS"]) / f"{name}-rank{rank}-pid{os.getpid()}").touch()
        return real(*args, **kwargs)
    return call

tracks.write_tracks = spy("write_tracks", tracks.write_tracks)
score.write_result_tracks = spy("write_result_tracks", score.write_result_tracks)
from genolong.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_two_process_evaluate_writes_the_one_process_tracks_from_rank_0(
    runs: Path, sample_store: Path, tmp_path: Path
) -> None:
    script, calls, out = tmp_path / "evaluate.py", tmp_path / "calls", tmp_path / "jobs" / "two"
    script.write_text(_SPY)
    calls.mkdir()
    out.parent.mkdir()
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TRACK_CALLS": str(calls),
    }
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "evaluate",
            str(runs / "model"),
            "--store",
            str(sample_store),
            *_COMMON,
            "--context",
            "256",
            "--label",
            "tiny full",
            "--tracks",
            "--out",
            str(out),
            "--set",
            "parallel.accelerator=cpu",
            "--set",
            "parallel.devices=2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads((out / "meta.json").read_text())["parallel"]["world"] == 2  # two ranks did run
    # rank 0 alone wrote tracks, once; nothing beside the result, the result's files the one-process ones
    assert sorted(p.name.rsplit("-pid", 1)[0] for p in calls.iterdir()) == [
        "write_result_tracks-rank0",
        "write_tracks-rank0",
    ]
    assert [p.name for p in out.parent.iterdir()] == ["two"]
    assert _files(out) == _files(runs / "full")
    one, two = runs / "full" / "tracks", out / "tracks"
    assert sorted(p.name for p in two.iterdir()) == ["chrom.sizes", "tiny_full.nll.bedGraph", "tiny_full.nll.bw"]
    # the same tracks: header, bases and values of the bigWig (read back by pyBigWig), the bedGraph's text
    chroms_one, entries_one = _bigwig(one / "tiny_full.nll.bw")
    chroms_two, entries_two = _bigwig(two / "tiny_full.nll.bw")
    assert chroms_two == chroms_one == {"chr22": 21_000_000} and len(entries_two) > 700
    pd.testing.assert_frame_equal(entries_two, entries_one, check_exact=True)  # exact: see below
    # exact: each tile runs through the same (gathered) weights by the same ops in one thread on either layout
    assert (two / "tiny_full.nll.bedGraph").read_text() == (one / "tiny_full.nll.bedGraph").read_text()
    assert (two / "chrom.sizes").read_text() == (one / "chrom.sizes").read_text()

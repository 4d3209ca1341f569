"""``genolong variants`` end to end: a VCF written here from real soft-masked human DNA (hg38
chr16:186,964-397,118, ``tests/data``, plain gzip as UCSC ships FASTA), read, normalised, scored
at two contexts and written as tables, an annotated VCF and a rejects file.

Oracles: pysam reading the annotated VCF back; :func:`brute_force_llr` (one-shot forwards of the
whole haplotypes) for the scores; a padded and a right-shifted spelling of one deletion, which
must score as the left-aligned one does.

Stopped by SIGTERM after its first committed blocks (issue 28): exit status 75, one line saying how
to resume, whole blocks kept in ``.<out>.partial``, no ``out``; the same command then finishes with
the tables of the uninterrupted run, byte for byte (one torch thread in both).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pysam
import pytest
import torch

from genolong.cli import main
from genolong.errors import PREEMPTED_EXIT_CODE
from genolong.evaluation.variant_score import brute_force_llr
from genolong.evaluation.vcf import Reference, read_variants
from genolong.model import PRESETS, GenoLM

pytestmark = pytest.mark.usefixtures("one_thread")

FASTA = Path(__file__).parent / "data" / "hg38_chr16_186964-397118.softmasked.fa.gz"
CONTEXTS = (96, 256)
WINDOW = 24
TOL = 1e-5  # streamed vs one-shot forwards sum in another order (tests/test_variant_score.py)


def _sequence() -> str:
    with gzip.open(FASTA, "rt") as handle:
        return "".join(line.strip() for line in handle if not line.startswith(">"))


def _homopolymer(seq: str, start: int) -> tuple[int, int]:
    """The first run of >= 4 equal bases at or after ``start``: (0-based first base, length)."""
    upper = seq.upper()
    i = start
    while True:
        j = i
        while j < len(upper) and upper[j] == upper[i]:
            j += 1
        if j - i >= 4 and upper[i] in "ACGT":
            return i, j - i
        i = j


def _write_vcf(path: Path, seq: str) -> dict[str, int]:
    """A VCF of SNVs, a multi-allelic record, one deletion spelled three ways, an insertion, an MNV,
    REF = ALT, and two alleles that must be skipped (symbolic, REF mismatch); returns
    {name: record index} of the interesting records."""
    up = seq.upper()

    def other(base: str) -> str:
        return "C" if base != "C" else "G"

    h, n = _homopolymer(seq, 5_000)  # a homopolymer: the deletion of one of its bases, three spellings
    records = [
        ("snv", 1_201, up[1_200], other(up[1_200])),
        ("multi", 2_502, up[2_501], f"{other(up[2_501])},T" if up[2_501] != "T" else "C,G"),
        ("del_left", h, up[h - 1:h + 1], up[h - 1]),  # anchor before the run + one run base (left-aligned)
        ("del_right", h + n - 1, up[h + n - 2:h + n], up[h + n - 2]),  # the same deletion, at the run's end
        ("del_padded", h, up[h - 1:h + 2], up[h - 1] + up[h + 1]),  # the same deletion with a padding base
        ("ins", 9_001, up[9_000], up[9_000] + "TTG"),
        ("mnv", 12_001, up[12_000:12_002], other(up[12_000]) + other(up[12_001])),
        ("same", 15_001, up[15_000], up[15_000]),
        ("symbolic", 16_001, up[16_000], "<DEL>"),
        ("mismatch", 17_001, other(up[17_000]), up[17_000]),
    ]
    lines = ["##fileformat=VCFv4.2", f"##contig=<ID=chr16,length={len(seq)}>",
             "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO"]
    order = sorted(range(len(records)), key=lambda i: records[i][1])
    index = {}
    for k, i in enumerate(order):
        name, pos, ref, alt = records[i]
        index[name] = k
        lines.append(f"chr16\t{pos}\t{name}\t{ref}\t{alt}\t.\tPASS\t.")
    path.write_text("\n".join(lines) + "\n")
    return index


def _args(root: Path) -> list[str]:
    """The ``variants`` arguments of the module's run (all but ``--out``)."""
    return ["variants", str(root / "model"), "--vcf", str(root / "calls.vcf.gz"), "--fasta", str(root / "chr16.fa.gz"),
            "--contexts", ",".join(map(str, CONTEXTS)), "--window", str(WINDOW), "--segment-tokens", "64", "--quiet"]


@pytest.fixture(scope="module")
def run(one_thread: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """A tiny random model and a chr16-only FASTA whose first base is genomic position 1 (the slice
    shifted: a VCF's positions are the FASTA's), scored at contexts 96 and 256 (in one torch thread,
    as the stopped run's test compares byte for byte)."""
    root = tmp_path_factory.mktemp("variants")
    torch.manual_seed(0)
    GenoLM(PRESETS["tiny"]).save_pretrained(root / "model")
    seq = _sequence()[:20_000]
    with gzip.open(root / "chr16.fa.gz", "wt") as handle:  # plain gzip, as UCSC's downloads
        handle.write(">chr16\n" + "\n".join(seq[i:i + 60] for i in range(0, len(seq), 60)) + "\n")
    index = _write_vcf(root / "calls.vcf", seq)
    pysam.tabix_compress(str(root / "calls.vcf"), str(root / "calls.vcf.gz"))
    status = main([*_args(root), "--out", str(root / "out")])
    assert status == 0
    return root, index


def test_scores_tables_annotated_vcf_and_rejects(run: tuple[Path, dict[str, int]]) -> None:
    root, index = run
    out = root / "out"
    table = pd.read_parquet(out / "scores.parquet")
    tsv = pd.read_csv(out / "scores.tsv", sep="\t")
    assert len(table) == len(tsv)
    np.testing.assert_allclose(tsv["llr"].to_numpy(), table["llr"].to_numpy(), rtol=1e-6)  # TSV text rounding
    alleles = {(int(r), int(a)) for r, a in zip(table["record"], table["allele"])}
    # 10 records: 11 ALTs (multi has 2), minus symbolic and mismatch
    assert len(alleles) == 9 and sorted(table["context"].unique()) == list(CONTEXTS)
    assert len(table) == 9 * len(CONTEXTS)
    same = table[table["record"] == index["same"]]
    assert (same["llr"] == 0.0).all()
    # the three spellings of one deletion: one normalised variant, one score per context
    dels = table[table["record"].isin([index["del_left"], index["del_right"], index["del_padded"]])]
    assert dels.groupby("context")["llr"].nunique().eq(1).all(), dels
    assert dels[["pos", "ref", "alt"]].drop_duplicates().shape[0] == 1

    rejects = pd.read_csv(out / "rejects.tsv", sep="\t")
    assert sorted(rejects["reason"]) == ["ref_mismatch", "symbolic"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["rejects"] == {"symbolic": 1, "ref_mismatch": 1} and meta["records"] == 10

    with pysam.VariantFile(str(out / "scored.vcf.gz")) as vcf:
        fields = [f"GENOLONG_LLR_L{c}" for c in CONTEXTS]
        assert all(f in vcf.header.info for f in fields)
        records = list(vcf)
    assert len(records) == 10 and Path(f"{out / 'scored.vcf.gz'}.tbi").is_file()
    for row in table.itertuples(index=False):
        value = records[row.record].info[f"GENOLONG_LLR_L{row.context}"][row.allele - 1]
        assert value == np.float32(row.llr), (row, value)  # the VCF keeps float32
    skipped = records[index["symbolic"]].info
    assert all(f not in skipped or skipped[f] == (None,) for f in fields)


def test_scores_equal_the_brute_force(run: tuple[Path, dict[str, int]]) -> None:
    """Every allele at both contexts: two one-shot forwards per allele from the block's start."""
    root, _ = run
    table = pd.read_parquet(root / "out" / "scores.parquet")
    model = GenoLM.from_pretrained(root / "model").eval()
    with Reference.open(root / "chr16.fa.gz") as reference:
        found = read_variants(root / "calls.vcf.gz", reference)
        by_key = {(v.record, v.allele): v for v in found.variants}
        worst = 0.0
        for row in table.itertuples(index=False):
            variant = by_key[(row.record, row.allele)]
            start = variant.pos - row.context_used
            oracle = brute_force_llr(model, reference, variant, start, window=WINDOW)
            worst = max(worst, abs(oracle.llr - row.llr))
    assert worst <= TOL, worst


def test_an_existing_out_and_a_vcf_of_nothing_scorable_are_one_line(run: tuple[Path, dict[str, int]], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = run
    common = [str(root / "model"), "--fasta", str(root / "chr16.fa.gz"), "--context", "64", "--quiet"]
    assert main(["variants", *common, "--vcf", str(root / "calls.vcf.gz"), "--out", str(root / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--force" in err[0]
    only = tmp_path / "symbolic.vcf"
    only.write_text("##fileformat=VCFv4.2\n##contig=<ID=chr16>\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
                    "chr16\t100\t.\tA\t<DEL>\t.\t.\t.\n")
    seq = _sequence()
    only.write_text(only.read_text().replace("\tA\t<DEL>", f"\t{seq[99].upper()}\t<DEL>"))
    assert main(["variants", *common, "--vcf", str(only), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 symbolic" in err[0], err
    assert not (tmp_path / "none").exists() and not any(p.name.startswith(".none") for p in tmp_path.iterdir())
    assert math.isfinite(pd.read_parquet(root / "out" / "scores.parquet")["llr"].sum())


# `genolong variants` in one thread whose blocks after the first wait (up to 60 s) until the process
# has noted a SIGTERM (the handler `SignalFlag` installs, read back here), after touching the file
# $HELD_MARKER: the test signals once that file exists, so its signal lands while the second block
# is scored (past the stop check between blocks, however slow the machine) and the run stops after
# exactly 2. (Signalling when the first block's part appears raced that check on a loaded machine:
# the run stopped after 1.)
_HELD = """
import os, pathlib, signal, sys, time
import torch
torch.set_num_threads(1)
import genolong.evaluation.variants as v
real, calls = v._score_unit, []
def held(*args, **kwargs):
    if calls:
        pathlib.Path(os.environ["HELD_MARKER"]).touch()
        flag = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        deadline = time.monotonic() + 60
        while flag is not None and not flag.received and time.monotonic() < deadline:
            time.sleep(0.01)
    calls.append(1)
    return real(*args, **kwargs)
v._score_unit = held
from genolong.cli import main
sys.exit(main(sys.argv[1:]))
"""
_PLAIN = "import sys, torch; torch.set_num_threads(1); from genolong.cli import main; sys.exit(main(sys.argv[1:]))"
_ENV = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.slow
def test_sigterm_stops_after_a_committed_block_and_the_same_command_finishes(run: tuple[Path, dict[str, int]],
                                                                              tmp_path: Path) -> None:
    root, _ = run
    args = [*_args(root), "--out", str(tmp_path / "stopped")]
    blocks = sum(json.loads((root / "out" / "meta.json").read_text())["blocks"])
    assert blocks >= 6  # several blocks, so that stopping after 2 leaves work to resume
    work = tmp_path / ".stopped.partial"
    parts = work / "parts"
    marker = tmp_path / "second-block-started"
    proc = subprocess.Popen([sys.executable, "-c", _HELD, *args], env={**_ENV, "HELD_MARKER": str(marker)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not marker.exists():
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before its second block began: {proc.communicate()[1][-3000:]}"
    assert [p.name for p in parts.iterdir()] == ["part-000-000000.parquet"]  # the first block, committed
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE == 75, err[-3000:]
    lines = err.strip().splitlines()
    assert "Traceback" not in err and sum("stopped" in line for line in lines) == 1, err
    assert lines[-1] == (f"genolong variants: stopped by SIGTERM after 2 of {blocks} blocks; they are kept in {work}, "
                         "where the same command resumes"), err
    # nothing under the result name; in the work directory its settings, timing and the 2 blocks, whole
    assert not (tmp_path / "stopped").exists()
    assert sorted(p.name for p in work.iterdir()) == ["parts", "settings.json", "timing.json"]
    committed = sorted(parts.iterdir())
    assert [p.name for p in committed] == ["part-000-000000.parquet", "part-000-000001.parquet"]
    # the reference: the same command uninterrupted in a fresh process (not the fixture's in-process
    # run, whose torch state the tests before it may have touched)
    plain = [*_args(root), "--out", str(tmp_path / "plain")]
    reference = subprocess.run([sys.executable, "-c", _PLAIN, *plain], env=_ENV, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    whole = pd.read_parquet(tmp_path / "plain" / "scores.parquet")
    for part in committed:
        rows = pd.read_parquet(part)
        assert len(rows) > 0 and (rows["context"] == CONTEXTS[0]).all()
        mine = whole.set_index(["context", "record", "allele"]).loc[list(zip(rows["context"], rows["record"], rows["allele"]))]
        assert np.array_equal(mine["llr"].to_numpy(), rows["llr"].to_numpy())  # exact: one thread, the same ops

    again = subprocess.run([sys.executable, "-c", _PLAIN, *args], env=_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not work.exists()
    for name in ("scores.tsv", "scores.parquet", "context_effect.tsv", "rejects.tsv"):
        # exact: the same blocks through the same weights by the same ops, one thread in every run
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name

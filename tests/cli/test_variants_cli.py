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

FASTA = Path(__file__).resolve().parents[1] / "data" / "hg38_chr16_186964-397118.softmasked.fa.gz"
CONTEXTS = (96, 256)
WINDOW = 24
TOL = 1e-5  # streamed vs one-shot forwards sum in another order (tests/evaluation/test_variant_score.py)


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
        ("del_left", h, up[h - 1 : h + 1], up[h - 1]),  # anchor before the run + one run base (left-aligned)
        ("del_right", h + n - 1, up[h + n - 2 : h + n], up[h + n - 2]),  # the same deletion, at the run's end
        ("del_padded", h, up[h - 1 : h + 2], up[h - 1] + up[h + 1]),  # the same deletion with a padding base
        ("ins", 9_001, up[9_000], up[9_000] + "TTG"),
        ("mnv", 12_001, up[12_000:12_002], other(up[12_000]) + other(up[12_001])),
        ("same", 15_001, up[15_000], up[15_000]),
        ("symbolic", 16_001, up[16_000], "<DEL>"),
        ("mismatch", 17_001, other(up[17_000]), up[17_000]),
    ]
    lines = [
        "##fileformat=VCFv4.2",
        f"##contig=<ID=chr16,length={len(seq)}>",
        "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO",
    ]
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
    return [
        "variants",
        str(root / "model"),
        "--vcf",
        str(root / "calls.vcf.gz"),
        "--fasta",
        str(root / "chr16.fa.gz"),
        "--contexts",
        ",".join(map(str, CONTEXTS)),
        "--window",
        str(WINDOW),
        "--segment-tokens",
        "64",
        "--quiet",
        "--max-ref-mismatch",
        "0.2",
    ]  # its one mismatch of 10 compared alleles: 10%, past the default 5%


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
        handle.write(">chr16\n" + "\n".join(seq[i : i + 60] for i in range(0, len(seq), 60)) + "\n")
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
    # issue 46: the share is reported, the reference file named
    assert meta["ref_mismatch"] == {"mismatched": 1, "compared": 10, "share": 0.1, "max_share": 0.2}
    assert meta["reference"] == str((root / "chr16.fa.gz").resolve())

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


def test_an_existing_out_and_a_vcf_of_nothing_scorable_are_one_line(
    run: tuple[Path, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = run
    common = [str(root / "model"), "--fasta", str(root / "chr16.fa.gz"), "--context", "64", "--quiet"]
    assert main(["variants", *common, "--vcf", str(root / "calls.vcf.gz"), "--out", str(root / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--force" in err[0]
    only = tmp_path / "symbolic.vcf"
    only.write_text(
        "##fileformat=VCFv4.2\n##contig=<ID=chr16>\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
        "chr16\t100\t.\tA\t<DEL>\t.\t.\t.\n"
    )
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
def test_sigterm_stops_after_a_committed_block_and_the_same_command_finishes(
    run: tuple[Path, dict[str, int]], tmp_path: Path
) -> None:
    root, _ = run
    args = [*_args(root), "--out", str(tmp_path / "stopped")]
    blocks = sum(json.loads((root / "out" / "meta.json").read_text())["blocks"])
    assert blocks >= 6  # several blocks, so that stopping after 2 leaves work to resume
    work = tmp_path / ".stopped.partial"
    parts = work / "parts"
    marker = tmp_path / "second-block-started"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD, *args],
        env={**_ENV, "HELD_MARKER": str(marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    assert lines[-1] == (
        f"genolong variants: stopped by SIGTERM after 2 of {blocks} blocks; they are kept in {work}, "
        "where the same command resumes"
    ), err
    # nothing under the result name; in the work directory its settings, timing and the 2 blocks, whole
    assert not (tmp_path / "stopped").exists()
    assert sorted(p.name for p in work.iterdir()) == ["parts", "settings.json", "timing.json"]
    committed = sorted(parts.iterdir())
    assert [p.name for p in committed] == ["part-000-000000.parquet", "part-000-000001.parquet"]
    # the reference: the same command uninterrupted in a fresh process (not the fixture's in-process
    # run, whose torch state the tests before it may have touched)
    plain = [*_args(root), "--out", str(tmp_path / "plain")]
    reference = subprocess.run(
        [sys.executable, "-c", _PLAIN, *plain], env=_ENV, capture_output=True, text=True, timeout=300
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    whole = pd.read_parquet(tmp_path / "plain" / "scores.parquet")
    for part in committed:
        rows = pd.read_parquet(part)
        assert len(rows) > 0 and (rows["context"] == CONTEXTS[0]).all()
        mine = whole.set_index(["context", "record", "allele"]).loc[
            list(zip(rows["context"], rows["record"], rows["allele"]))
        ]
        assert np.array_equal(mine["llr"].to_numpy(), rows["llr"].to_numpy())  # exact: one thread, the same ops

    again = subprocess.run([sys.executable, "-c", _PLAIN, *args], env=_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not work.exists()
    for name in ("scores.tsv", "scores.parquet", "context_effect.tsv", "rejects.tsv"):
        # exact: the same blocks through the same weights by the same ops, one thread in every run
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_scored_vcf_carries_provenance_and_per_allele_fields(run: tuple[Path, dict[str, int]]) -> None:
    """Issue 46: a ##genolong_variants line (version, model, its signature, reference, contexts,
    window, strands, layout, command) and per context LLR, logp_ref, logp_alt (Float) and
    context_used (Integer), all Number=A, equal to the table (the VCF keeps float32)."""
    import genolong

    root, _ = run
    out = root / "out"
    meta = json.loads((out / "meta.json").read_text())
    table = pd.read_parquet(out / "scores.parquet")
    with pysam.VariantFile(str(out / "scored.vcf.gz")) as vcf:
        line = next(r for r in vcf.header.records if r.key == "genolong_variants")
        for c in CONTEXTS:
            for name, type_ in (
                ("LLR", "Float"),
                ("LOGP_REF", "Float"),
                ("LOGP_ALT", "Float"),
                ("CONTEXT_USED", "Integer"),
            ):
                info = vcf.header.info[f"GENOLONG_{name}_L{c}"]
                assert (info.number, info.type) == ("A", type_)
            assert "fixed grid" in vcf.header.info[f"GENOLONG_CONTEXT_USED_L{c}"].description
        records = list(vcf)
    got = {k: line[k].strip('"') for k in line.keys()}
    assert got["Version"] == genolong.__version__ and got["ModelSignature"] == meta["model_signature"]
    assert got["Model"] == str((root / "model").resolve()) and got["Reference"] == meta["reference"]
    assert got["Contexts"] == ",".join(map(str, CONTEXTS)) and got["Window"] == str(WINDOW)
    assert got["Strands"] == "forward" and got["Layout"] == meta["layout"] and "fixed grid" in got["Layout"]
    assert got["Command"].startswith("genolong variants ") and "--max-ref-mismatch 0.2" in got["Command"]
    for row in table.itertuples(index=False):
        info = records[row.record].info
        k = row.allele - 1
        assert info[f"GENOLONG_LOGP_REF_L{row.context}"][k] == np.float32(row.logp_ref)
        assert info[f"GENOLONG_LOGP_ALT_L{row.context}"][k] == np.float32(row.logp_alt)
        assert info[f"GENOLONG_CONTEXT_USED_L{row.context}"][k] == row.context_used
        # the layout rule: a fixed grid of L-base cells, the stream from L before the variant's cell
        assert row.context_used == row.pos - 1 - max(0, (row.pos - 1) // row.context * row.context - row.context)


def test_another_build_stops_in_one_line_and_writes_nothing(
    run: tuple[Path, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 46: SNVs whose positions are shifted (another build, or 0-based POS): past 5% of REF
    mismatches the run stops with one line naming the causes, status 2, nothing written. The
    shift by one is recognised."""
    root, _ = run
    seq = _sequence()[:20_000].upper()
    lines = ["##fileformat=VCFv4.2", "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO"]
    for k, pos0 in enumerate(range(1_000, 19_000, 450)):  # 40 SNVs written at POS = the 0-based position
        ref = seq[pos0]
        lines.append(f"chr16\t{pos0}\ts{k}\t{ref}\t{'C' if ref != 'C' else 'G'}\t.\t.\t.")
    shifted = tmp_path / "shifted.vcf"
    shifted.write_text("\n".join(lines) + "\n")
    common = [
        str(root / "model"),
        "--fasta",
        str(root / "chr16.fa.gz"),
        "--context",
        "64",
        "--quiet",
        "--vcf",
        str(shifted),
    ]
    assert main(["variants", *common, "--out", str(tmp_path / "scored")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--max-ref-mismatch 0.05" in err[0] and "another build" in err[0] and "0-based" in err[0], err
    assert "one base to the right" in err[0], err  # the shift recognised
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shifted.vcf"]  # nothing written
    # every REF wrong: that is another build too, not "nothing scorable"
    wrong = tmp_path / "wrong.vcf"
    wrong.write_text(
        "\n".join(
            lines[:2]
            + [
                f"chr16\t{p + 1}\tw{k}\t{'C' if seq[p] != 'C' else 'G'}\t{seq[p]}\t.\t.\t."
                for k, p in enumerate(range(1_000, 19_000, 450))
            ]
        )
        + "\n"
    )
    assert main(["variants", *common[:-1], str(wrong), "--out", str(tmp_path / "scored")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at 40 of 40 alleles (100.0%" in err[0] and "another build" in err[0], err
    wrong.unlink()
    # the limit is an option: at 100% the matching few are scored
    assert main(["variants", *common, "--out", str(tmp_path / "scored"), "--max-ref-mismatch", "1"]) == 0
    meta = json.loads((tmp_path / "scored" / "meta.json").read_text())
    assert meta["ref_mismatch"]["compared"] == 40 and meta["ref_mismatch"]["share"] > 0.5
    assert "% mismatched" in capsys.readouterr().err


def test_regions_an_unsorted_input_and_htslib_quiet(
    run: tuple[Path, dict[str, int]], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 46: the fixture's VCF out of order, without ##contig lines, scored in the regions of a
    BED: htslib's "Contig ... not defined" warnings do not reach stderr, the scored VCF is sorted
    and indexed (one line says so), only the records in the regions are scored, and their scores
    equal the whole file's bitwise (a variant's stream start depends on its position alone)."""
    root, _ = run
    whole = pd.read_parquet(root / "out" / "scores.parquet")
    with gzip.open(root / "calls.vcf.gz", "rt") as handle:
        text = [line for line in handle if not line.startswith("##contig")]
    head = [line for line in text if line.startswith("#")]
    body = [line for line in text if not line.startswith("#")]
    unsorted = tmp_path / "unsorted.vcf"
    unsorted.write_text("".join(head + body[::-1]))
    bed = tmp_path / "regions.bed"
    # POS 1,201 and 2,502 (0-based 1,200 and 2,501) and 12,001; not 9,001
    bed.write_text("track name=x\nchr16\t1000\t1201\nchr16\t2501\t2600\nchr16\t12000\t12001\n")
    out = tmp_path / "regions"
    assert main([*_args(root), "--vcf", str(unsorted), "--regions", str(bed), "--out", str(out)]) == 0
    captured = capfd.readouterr()
    assert "not defined" not in captured.err and "Quick workaround" not in captured.err, captured.err
    assert "not sorted" in captured.err and Path(f"{out / 'scored.vcf.gz'}.tbi").is_file()
    table = pd.read_parquet(out / "scores.parquet")
    assert sorted(set(table["input_pos"])) == [1_201, 2_502, 12_001]
    keys = ["context", "input_pos", "input_alt"]
    mine = table.set_index(keys).sort_index()
    theirs = whole.set_index(keys).loc[mine.index]
    for column in ("logp_ref", "logp_alt", "llr", "context_used"):
        assert np.array_equal(mine[column].to_numpy(), theirs[column].to_numpy()), column  # one thread: exact
    meta = json.loads((out / "meta.json").read_text())
    assert meta["regions"]["intervals"] == 3 and meta["regions"]["alleles_outside"] == 9 - 4
    with pysam.VariantFile(str(out / "scored.vcf.gz")) as vcf:
        records = list(vcf)
    assert [r.pos for r in records] == sorted(r.pos for r in records) and len(records) == 10
    scored = {r.pos for r in records if r.info.get(f"GENOLONG_LLR_L{CONTEXTS[0]}", (None,))[0] is not None}
    assert scored == {1_201, 2_502, 12_001}

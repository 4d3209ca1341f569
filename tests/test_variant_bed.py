"""``variants --regions``' BED reader (genolong.evaluation.bed) and the REF-mismatch gate's arithmetic
(genolong.evaluation.variant_run), without a model.

Oracle for the BED: a per-base membership set built from the raw lines (0-based, half-open)."""

from __future__ import annotations

import gzip
from pathlib import Path
from types import SimpleNamespace

import pytest

from genolong.errors import InputError
from genolong.evaluation.bed import read_bed
from genolong.evaluation.variant_run import check_ref_mismatch, in_regions
from genolong.evaluation.vcf import Variant, VariantSet


def test_bed_intervals_merge_and_membership_is_half_open(tmp_path: Path) -> None:
    lines = ["track name=calls", "browser position chr1:1-100", "# a comment", "",
             "chr1\t10\t20\tname\t0\t+", "chr1 15 30", "chr1\t30\t31", "chr1\t40\t40", "chr2\t0\t5", "chr1\t100\t200"]
    path = tmp_path / "r.bed.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    regions = read_bed(path)
    assert regions.intervals == {"chr1": [(10, 31), (100, 200)], "chr2": [(0, 5)]}  # touching merged, empty dropped
    want = {("chr1", p) for p in [*range(10, 31), *range(100, 200)]} | {("chr2", p) for p in range(5)}
    for contig in ("chr1", "chr2", "chr3"):
        for p in range(-1, 210):
            assert regions.contains(contig, p) == ((contig, p) in want), (contig, p)
    assert regions.bases == len(want)


@pytest.mark.parametrize("line, match", [("chr1\t10", "line 2 is not 'chrom start end'"),
                                         ("chr1\t20\t10", "line 2 is not"), ("chr1\tx\t10", "line 2 is not")])
def test_bad_bed_lines_are_one_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.bed"
    path.write_text(f"chr1\t0\t5\n{line}\n")
    with pytest.raises(InputError, match=match):
        read_bed(path)
    with pytest.raises(InputError, match="no such BED file"):
        read_bed(tmp_path / "missing.bed")
    (tmp_path / "empty.bed").write_text("track x\n")
    with pytest.raises(InputError, match="no interval"):
        read_bed(tmp_path / "empty.bed")


def _variant(contig: str, input_pos: int, record: int) -> Variant:
    return Variant(contig, input_pos - 1, "A", "C", record, 1, f"v{record}", input_pos, "A", "C")


def test_regions_keep_records_by_their_pos(tmp_path: Path) -> None:
    bed = tmp_path / "r.bed"
    bed.write_text("20\t99\t100\n")  # the 1-based POS 100
    found = VariantSet(variants=[_variant("20", 99, 0), _variant("20", 100, 1), _variant("20", 101, 2),
                                 _variant("21", 100, 3)], records=4)
    kept, summary = in_regions(found, bed)
    assert [v.record for v in kept.variants] == [1] and summary["alleles_outside"] == 3
    bed.write_text("chr20\t0\t1000\n")
    with pytest.raises(InputError, match="none of the 4 scorable alleles lies in its regions .*chr20.*20"):
        in_regions(found, bed)


def test_the_mismatch_share_counts_the_alleles_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = SimpleNamespace(path=Path("ref.fa"))
    rejects = tmp_path / "rejects.tsv"
    rejects.write_text("record\tchrom\tpos\tid\tref\talt\treason\n")
    # 95 kept, 5 mismatched, 3 symbolic (never compared): 5 of 100 = 5%, not past 5%
    found = SimpleNamespace(variants=[None] * 95, rejects={"ref_mismatch": 5, "symbolic": 3})
    got = check_ref_mismatch(Path("calls.vcf"), reference, found, rejects, 0.05)
    assert got == {"mismatched": 5, "compared": 100, "share": 0.05, "max_share": 0.05}
    assert "95 of 100 alleles (5.00% mismatched" in capsys.readouterr().err
    found.rejects["ref_mismatch"] = 6  # 6 of 101: past it
    with pytest.raises(InputError, match=r"calls.vcf: REF differs from the reference ref.fa at 6 of 101 alleles "
                                         r"\(5\.9%, more than --max-ref-mismatch 0\.05\).*another build"):
        check_ref_mismatch(Path("calls.vcf"), reference, found, rejects, 0.05)
    with pytest.raises(InputError, match="between 0 and 1"):
        check_ref_mismatch(Path("calls.vcf"), reference, found, rejects, 5)

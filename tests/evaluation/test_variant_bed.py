"""``variants --regions`` (the shared BED reader, genolong.data.regions, against the reference's
contigs) and the REF-mismatch gate's arithmetic (genolong.evaluation.variant_run), without a model."""

from __future__ import annotations

import gzip
from pathlib import Path
from types import SimpleNamespace

import pytest

from genolong.errors import InputError
from genolong.evaluation.variant_run import check_ref_mismatch, in_regions
from genolong.evaluation.vcf import Variant, VariantSet


def _variant(contig: str, input_pos: int, record: int) -> Variant:
    return Variant(contig, input_pos - 1, "A", "C", record, 1, f"v{record}", input_pos, "A", "C")


def test_regions_keep_records_by_their_pos(tmp_path: Path) -> None:
    bed = tmp_path / "r.bed"
    bed.write_text("20\t99\t100\n")  # the 1-based POS 100
    found = VariantSet(
        variants=[_variant("20", 99, 0), _variant("20", 100, 1), _variant("20", 101, 2), _variant("21", 100, 3)],
        records=4,
    )
    sizes = {"20": 5000, "21": 5000}
    kept, summary = in_regions(found, bed, sizes)
    assert [v.record for v in kept.variants] == [1] and summary["alleles_outside"] == 3
    # a gzip BED whose chromosome names another alias of the reference's contig (chr20 for 20)
    with gzip.open(tmp_path / "r.bed.gz", "wt") as handle:
        handle.write("track x\nchr20\t99\t101\n")
    kept, _ = in_regions(found, tmp_path / "r.bed.gz", sizes)
    assert [v.record for v in kept.variants] == [1, 2]
    bed.write_text("20\t2000\t3000\n")
    with pytest.raises(InputError, match="none of the 4 scorable alleles lies in its regions"):
        in_regions(found, bed, sizes)
    bed.write_text("22\t0\t10\n")  # a chromosome the reference lacks: one line naming it
    with pytest.raises(InputError, match="chromosome 22 is not in the reference"):
        in_regions(found, bed, sizes)


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
    with pytest.raises(
        InputError,
        match=r"calls.vcf: REF differs from the reference ref.fa at 6 of 101 alleles "
        r"\(5\.9%, more than --max-ref-mismatch 0\.05\).*another build",
    ):
        check_ref_mismatch(Path("calls.vcf"), reference, found, rejects, 0.05)
    with pytest.raises(InputError, match="between 0 and 1"):
        check_ref_mismatch(Path("calls.vcf"), reference, found, rejects, 5)

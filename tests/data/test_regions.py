"""BED regions (genolong/data/regions.py): parsing, merging, alias look-up, overlap tests.

Oracle: a per-base boolean mask built by hand from the BED lines (0-based, half-open).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from genolong.data.regions import read_bed, resolve_name
from genolong.errors import InputError


def test_bed_regions_merge_and_match_a_per_base_mask(tmp_path: Path) -> None:
    bed = tmp_path / "r.bed"
    lines = [("20", 10, 20), ("chr20", 15, 30), ("NC_000020.10", 30, 31), ("20", 50, 60), ("chrX", 0, 5)]
    bed.write_text(
        "browser position chr20\ntrack name=x\n# comment\n\n"
        + "".join(f"{c}\t{s}\t{e}\tname\t0\t+\n" for c, s, e in lines)
    )
    sizes = {"20": 100, "X": 10}
    regions = read_bed(bed, sizes)
    # merged per chromosome, keyed by the names of `sizes`: 10-31 (overlapping and touching), 50-60
    assert regions.intervals["20"].tolist() == [[10, 31], [50, 60]] and regions.intervals["X"].tolist() == [[0, 5]]
    assert regions.bases == 21 + 10 + 5
    mask = {name: np.zeros(size, bool) for name, size in sizes.items()}
    for c, s, e in lines:
        mask[resolve_name(c, sizes)][s:e] = True  # type: ignore[index]
    for name, size in sizes.items():
        got = regions.contains(np.full(size, name, object), np.arange(size))
        np.testing.assert_array_equal(got, mask[name])  # exact: booleans
    # intervals: overlap iff they share a base with the per-base mask
    rng = np.random.default_rng(0)
    start = rng.integers(0, 99, 500)
    end = start + rng.integers(1, 12, 500).clip(max=100 - start)
    want = np.array([mask["20"][s:e].any() for s, e in zip(start, end)])
    np.testing.assert_array_equal(regions.overlaps(np.full(500, "20", object), start, end), want)  # exact: booleans
    assert not regions.overlaps(np.array(["other"], object), np.array([0]), np.array([5])).any()
    # the digest names the merged regions: the same file gives the same, one base more another
    other = tmp_path / "o.bed"
    other.write_text("chr20\t10\t31\nchr20\t50\t60\nX\t0\t6\n")
    assert regions.digest == read_bed(bed, sizes).digest != read_bed(other, sizes).digest
    other.write_text("chr20\t10\t31\nchr20\t50\t60\nX\t0\t5\n")
    assert read_bed(other, sizes).digest == regions.digest


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("chr1\t0\t10\n", ("line 1", "chr1", "not in")),
        ("20\t90\t101\n", ("past the end",)),
        ("20\t10\t10\n", ("not below",)),
        ("20\t-1\t10\n", ("line 1",)),
        ("# nothing\n", ("no region",)),
    ],
)
def test_bad_bed_lines_are_one_clear_error(tmp_path: Path, text: str, words: tuple[str, ...]) -> None:
    bed = tmp_path / "r.bed"
    bed.write_text(text)
    with pytest.raises(InputError) as caught:
        read_bed(bed, {"20": 100})
    message = str(caught.value)
    assert "\n" not in message and str(bed) in message
    for word in words:
        assert word in message, (word, message)


def test_resolve_name_prefers_the_exact_name() -> None:
    assert resolve_name("chr20", {"chr20": 1, "20": 2}) == "chr20"
    assert resolve_name("NC_000020.11", {"20": 1}) == "20"
    assert resolve_name("20", {"chr20": 1, "NC_000020.10": 2}) is None  # two candidates: ambiguous
    assert resolve_name("HLA-A", {"chr6": 1}) is None

"""Token ids, lookup tables, complement, and chromosome names across conventions."""

from __future__ import annotations

import numpy as np
import pytest

from genolong.data import alphabet
from genolong.data.alphabet import (
    BASE_MASK,
    COMPLEMENT_LUT,
    ENCODE_LUT,
    INVALID,
    SOFTMASK,
    STORE_ALPHABET,
    N,
    decode,
    encode,
    is_n,
    reverse_complement,
)
from genolong.data.names import ACCESSIONS, CHROMOSOMES, canonical_name, parse_record_name, same_chromosome


def test_store_ids_fit_in_four_bits_and_round_trip() -> None:
    assert max(STORE_ALPHABET) < 16
    letters = "".join(STORE_ALPHABET.values())
    assert decode(encode(letters)) == letters
    assert all((t & BASE_MASK) == alphabet.encode(ch.upper())[0] for t, ch in STORE_ALPHABET.items())


def test_every_byte_is_a_base_an_ambiguity_code_or_invalid() -> None:
    valid = set(b"ACGTNacgtn") | set(alphabet.IUPAC_AMBIGUITY) | set(alphabet.IUPAC_AMBIGUITY.lower())
    for byte in range(256):
        assert (ENCODE_LUT[byte] != INVALID) == (byte in valid), chr(byte)


def test_ambiguity_codes_become_n_with_case() -> None:
    assert decode(encode("ACRyGt")) == "ACNnGt"
    with pytest.raises(ValueError, match="invalid character '-' at position 2"):
        encode("AC-T")
    with pytest.raises(ValueError, match="invalid character 'U'"):
        encode("ACGU")  # RNA is not a genome FASTA


def test_reverse_complement_keeps_case() -> None:
    tokens = encode("AACgtNn")
    assert decode(reverse_complement(tokens)) == "nNacGTT"
    assert np.array_equal(reverse_complement(reverse_complement(tokens)), tokens)  # exact: token codes
    batch = np.stack([encode("ACGT"), encode("aacc")])
    assert [decode(r) for r in reverse_complement(batch)] == ["ACGT", "ggtt"]
    assert COMPLEMENT_LUT[alphabet.BOS] == alphabet.BOS


def test_is_n_and_softmask_flag() -> None:
    tokens = encode("ANnc")
    assert is_n(tokens).tolist() == [False, True, True, False]
    assert ((tokens & SOFTMASK) > 0).tolist() == [False, False, True, True]
    assert (tokens[1] & BASE_MASK) == N


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("1", "chr1"),
        ("chr1", "chr1"),
        ("CHR1", "chr1"),
        ("NC_000001.11", "chr1"),
        ("NC_000001.10", "chr1"),
        ("CM000663.2", "chr1"),
        ("CM000663.1", "chr1"),
        ("22", "chr22"),
        ("NC_000022.11", "chr22"),
        ("CM000684.2", "chr22"),
        ("X", "chrX"),
        ("chrx", "chrX"),
        ("NC_000023.11", "chrX"),
        ("23", "23"),
        ("Y", "chrY"),
        ("NC_000024.10", "chrY"),
        ("CM000686.2", "chrY"),
        ("MT", "chrM"),
        ("M", "chrM"),
        ("chrM", "chrM"),
        ("NC_012920.1", "chrM"),
        ("J01415.2", "chrM"),
        ("chr1_KI270706v1_random", "chr1_KI270706v1_random"),
        ("chrUn_GL000220v1", "chrUn_GL000220v1"),
        ("NC_000025.1", "NC_000025.1"),
        ("0", "0"),
        ("MT_human", "MT_human"),
    ],
)
def test_canonical_name(name: str, canonical: str) -> None:
    assert canonical_name(name) == canonical


def test_accession_table_covers_every_nuclear_chromosome_in_both_assemblies() -> None:
    for accession, ucsc in ACCESSIONS.items():
        assert canonical_name(accession) == ucsc
    nuclear = [c for c in CHROMOSOMES if c != "chrM"]
    for ucsc in nuclear:
        refseq = sorted(a for a, u in ACCESSIONS.items() if u == ucsc and a.startswith("NC_"))
        genbank = sorted(a for a, u in ACCESSIONS.items() if u == ucsc and a.startswith("CM"))
        assert len(refseq) == 2 and len(genbank) == 2, ucsc
    assert (
        ACCESSIONS["NC_000001.11"] == "chr1"
        and ACCESSIONS["NC_000005.9"] == "chr5"
        and ACCESSIONS["NC_000024.9"] == "chrY"
    )
    assert same_chromosome("chr7", "NC_000007.14") and not same_chromosome("chr7", "chr17")


def test_parse_record_name() -> None:
    region = parse_record_name("chr22:20000001-21000000")
    assert (region.contig, region.start, region.length) == ("chr22", 20_000_000, 1_000_000)
    region = parse_record_name("22:1,001-2,000")
    assert (region.contig, region.start, region.length) == ("chr22", 1000, 1000)
    assert parse_record_name("chr1").start == 0 and parse_record_name("chr1").length is None
    # HLA allele names contain ':' but are not regions
    assert parse_record_name("HLA-A*01:01:01:01").contig == "HLA-A*01:01:01:01"

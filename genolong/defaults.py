"""Defaults the command line shows in its help, kept free of heavy imports.

``genolong --help`` builds every subcommand's parser; reading these numbers from the modules that
use them (:mod:`genolong.data.prepare` needs numpy and zarr, :mod:`genolong.quickstart` torch and
Lightning) cost seconds of imports before any help was printed. Those modules import them from
here, so each value has one home.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_MIN_GAP",
    "DEFAULT_SPLITS",
    "DEFAULT_EVAL_TILES",
    "DEFAULT_PROBE_TILES",
    "PROBE_CONTEXT",
    "VARIANT_WINDOW",
    "VARIANT_MAX_REF_MISMATCH",
]

#: ``prepare``: N runs of at least this many bases split a chromosome into segments and are dropped.
DEFAULT_MIN_GAP = 1000
#: ``prepare``: the chromosomes of each split when none are named.
DEFAULT_SPLITS: dict[str, tuple[str, ...]] = {"train": ("chr1", "chr2"), "eval": ("chr22",)}

#: Held-out tiles the quickstart scores per model (8 x 8,192 = 65k bases; about 40 s per model on 2 cores).
DEFAULT_EVAL_TILES = 8
#: Held-out tiles the planted-repeat probe (``genolong probe``) runs on per model, and their length:
#: distances 128 .. 2,048 around the base's 1,024-token training context. A probe tile costs
#: ``L + 5 m + sum(d)`` = 8.5k tokens of forward, about one 8,192-token evaluation tile (measured
#: 0.87x on the bundled base, noisy), so the stage adds about 8 evaluation tiles' time in all.
DEFAULT_PROBE_TILES = 4
PROBE_CONTEXT = 4096

#: ``variants``: reference bases scored after each variant, in both haplotypes (the allele's effect
#: on the bases that follow it; Evo 2-style scores sum a similar stretch).
VARIANT_WINDOW = 128
#: ``variants``: the largest share of the alleles compared with the FASTA whose REF differs from it that
#: is scored; past it the VCF was called on something else (another build, contig naming, 0-based POS)
#: and the run stops (``bcftools norm -c e`` stops at the first).
VARIANT_MAX_REF_MISMATCH = 0.05

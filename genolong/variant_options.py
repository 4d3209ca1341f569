"""The ``variants`` options that issue 46 added (``--regions``, ``--max-ref-mismatch``), kept out of
:mod:`genolong.cli` (at its size limit) and free of heavy imports: building the parser imports no
numpy, pandas or torch (tests/test_cli_startup.py). What they do: :mod:`genolong.evaluation.variant_run`.
"""

from __future__ import annotations

import argparse

from .defaults import VARIANT_MAX_REF_MISMATCH

__all__ = ["add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--regions BED`` and ``--max-ref-mismatch F`` on the ``variants`` parser."""
    parser.add_argument("--regions", metavar="BED",
                        help="score only the records whose POS lies in a region of this BED (0-based, half-open; "
                             "plain or gzip); the others stay in scored.vcf.gz without scores")
    parser.add_argument("--max-ref-mismatch", type=float, default=VARIANT_MAX_REF_MISMATCH, metavar="F",
                        help="stop, writing nothing, when more than this share of the alleles compared with --fasta "
                             "has another REF (another build, chr naming, 0-based positions) (default: %(default)s)")

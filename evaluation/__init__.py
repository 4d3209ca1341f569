"""genolong.evaluation: held-out loss by preceding-context length, comparisons, plots, log-prob gap.

Installed as ``genolong.evaluation`` (see ``package-dir`` in pyproject.toml). Modules:

- ``score``: ``genolong evaluate`` (per-token NLL, ``--context-cut``, resumable result directories);
- ``checkpoint``: the checkpoint a scoring command runs (export, run directory or ``step*.ckpt``),
  its run's recipe and kernel backend, loaded whole into one process;
- ``results``: :class:`EvalResult`, the saved tables (per-tile x bucket sums, also split by
  soft-masking, and per-offset sums);
- ``bootstrap``: context buckets and the block bootstrap over tiles, on plain arrays;
- ``stats``: paired :func:`compare` of two results, pooled or split by soft-masked vs unmasked bases
  (and the ``bootstrap`` names, re-exported);
- ``plots``: the figures of ``genolong plot``;
- ``tracks``: ``genolong tracks`` / ``evaluate --tracks`` (bigWig and bedGraph of the per-base
  loss and of B - A, in the store's genomic coordinates);
- ``logprobs``: ``genolong check-logprobs`` (training path vs step-by-step decode);
- ``probe``: ``genolong probe`` (planted-repeat recall by distance, full vs cut view);
- ``probe_result``: :class:`ProbeResult`, the probe's saved tables (torch-free, for the figures);
- ``distributed``: the multi-process scoring job (launch, mesh, sharded loading, tiles dealt to
  the data-parallel groups, one writer) that ``evaluate``, ``check-logprobs`` and ``probe`` share;
- ``report``: Markdown tables for the terminal and the quickstart's REPORT.md;
- ``vcf``: ``genolong variants``' input: the reference FASTA, VCF/BCF records split per ALT and
  normalised as ``bcftools norm`` does (counted rejects), and the annotated VCF copy.
"""

from __future__ import annotations

from .results import EvalResult
from .stats import compare

__all__ = ["EvalResult", "compare"]

"""Genome data: alphabet, FASTA readers, the prepared store, and training/eval windows."""

from __future__ import annotations

from .alphabet import decode, encode, reverse_complement
from .store import GenomeStore, Split

__all__ = ["GenomeStore", "Split", "decode", "encode", "reverse_complement"]

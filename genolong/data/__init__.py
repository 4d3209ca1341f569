"""Genome data: alphabet, FASTA readers, the prepared store, and training/eval windows.

The names below load their module on first use (module ``__getattr__``), so that importing one
light submodule (``genolong.data.alphabet``, ``genolong.data.names``) does not import zarr.
"""

from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["GenomeStore", "Split", "decode", "encode", "reverse_complement"]

#: public name -> the submodule that defines it
_LAZY = {
    "decode": "alphabet",
    "encode": "alphabet",
    "reverse_complement": "alphabet",
    "GenomeStore": "store",
    "Split": "store",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)  # see the module docstring

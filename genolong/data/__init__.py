"""Genome data: alphabet, FASTA readers, the prepared store, and training/eval windows.

The names below load their module on first use (module ``__getattr__``), so that importing one
light submodule (``genolong.data.alphabet``, ``genolong.data.names``) does not import zarr.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GenomeStore", "Split", "decode", "encode", "reverse_complement"]

#: public name -> the submodule that defines it
_LAZY = {"decode": "alphabet", "encode": "alphabet", "reverse_complement": "alphabet", "GenomeStore": "store", "Split": "store"}


def __getattr__(name: str) -> Any:
    """Load ``name``'s submodule on first use (see the module docstring)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

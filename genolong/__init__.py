"""genolong: fine-tune hybrid linear/sparse-attention language models on whole human chromosomes."""

from __future__ import annotations

from typing import Any

__all__ = ["__version__"]


def __getattr__(name: str) -> Any:
    """``genolong.__version__``, read from the installed distribution on first use.

    Computed lazily: importing :mod:`importlib.metadata` costs tens to hundreds of milliseconds,
    which every ``genolong`` command (``--help`` included) paid at startup when it was read here
    at import time.
    """
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("genolong")
        except PackageNotFoundError:  # running from a source tree that was not installed
            value = "0.0.0+unknown"
        globals()["__version__"] = value  # once: later reads are plain attribute lookups
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

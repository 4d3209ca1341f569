"""genolong.kernels: token-mixing ops (KDA, DSA) and the chunked cross-entropy.

Installed as ``genolong.kernels`` (see ``package-dir`` in pyproject.toml); never import it as a
top-level ``kernels``. The ops arrive with the model (issue 3).
"""

from __future__ import annotations

__all__: list[str] = []

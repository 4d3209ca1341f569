"""genolong.evaluation: held-out loss by preceding-context length, comparisons and plots.

Installed as ``genolong.evaluation`` (see ``package-dir`` in pyproject.toml). The evaluation
commands arrive with issue 5.
"""

from __future__ import annotations

__all__: list[str] = []

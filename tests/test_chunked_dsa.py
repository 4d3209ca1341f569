"""The DSA attention half in query segments (``genolong.parallel.chunked_dsa``, for
``memory.recompute: chunked``) and the layering of the model (it imports nothing from
``genolong.parallel``; context parallelism is installed onto the plain DSA mixer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import genolong.model

MODEL_DIR = Path(genolong.model.__file__).parent


def _imported_modules(source: str, package: str = "genolong.model") -> list[str]:
    """Absolute names of every module a source file of ``package`` imports (top level or inside
    functions; ``from X import y`` also names ``X.y``, which may be a module)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _parallel_imports(source: str) -> list[str]:
    return [m for m in _imported_modules(source) if m == "genolong.parallel" or m.startswith("genolong.parallel.")]


def test_model_imports_nothing_from_parallel() -> None:
    files = sorted(MODEL_DIR.glob("*.py"))
    assert len(files) >= 10 and any(f.name == "dsa.py" for f in files)
    offenders = {f.name: _parallel_imports(f.read_text()) for f in files}
    assert not any(offenders.values()), f"genolong.model modules import genolong.parallel: {offenders}"
    # the scan catches each spelling (today's dsa.py had the first, inside a method)
    for line in ("def f():\n    from ..parallel.cp_dsa import cp_dsa_forward", "from .. import parallel",
                 "import genolong.parallel.context", "from genolong.parallel import parallelize"):
        assert _parallel_imports(line), line
    assert not _parallel_imports("from ..kernels.kda.cp import conv_halo")  # kernels are not parallel

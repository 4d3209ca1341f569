"""genolong.kernels: token-mixing ops (KDA, DSA) and the chunked cross-entropy.

Installed as ``genolong.kernels`` (see ``package-dir`` in pyproject.toml); never import it as a
top-level ``kernels``. The ops arrive with the model (issue 3).

The folder sits at the top of the repository, so wherever the checkout's root is on ``sys.path``
(``python -m pytest`` or ``python -c`` run there) a plain ``import kernels`` finds this folder
before the PyPI distribution named ``kernels``, which transformers (from 5.25) requires and imports
when it loads any model. When this file is imported under that top-level name it therefore hands
the name over to the installed distribution (see :func:`_yield_the_top_level_name`).
"""

from __future__ import annotations

__all__: list[str] = []


def _yield_the_top_level_name() -> None:
    """Replace the module being imported as top-level ``kernels`` with the installed ``kernels``.

    The import system returns whatever ``sys.modules["kernels"]`` holds once this file has run, so
    loading the distribution's package there is enough. The search skips every ``sys.path`` entry
    that resolves to this checkout's root.

    Raises:
        ModuleNotFoundError: (name ``kernels``) when no ``kernels`` distribution is installed, as a
            plain import would outside the checkout, so that ``try: import kernels`` guards behave.
    """
    import importlib.util
    import sys
    from importlib.machinery import PathFinder
    from pathlib import Path

    checkout = Path(__file__).resolve().parent.parent
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != checkout]
    spec = PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError(
            "No module named 'kernels' (the checkout's kernels/ folder is genolong.kernels; "
            "import that, or pip install kernels)", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _yield_the_top_level_name()

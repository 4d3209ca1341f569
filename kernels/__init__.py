"""genolong.kernels: token-mixing ops (KDA, DSA) and the chunked cross-entropy.

Installed as ``genolong.kernels`` (see ``package-dir`` in pyproject.toml); never import it as a
top-level ``kernels``. The ops arrive with the model (issue 3).

The folder sits at the top of the repository, so wherever the checkout's root is on ``sys.path``
(pytest puts it first because ``tests/`` is a package and the root is the first folder above it
without an ``__init__.py``; ``python -m pytest``, ``python -m ...`` and ``python -c`` run there add
the working directory) a plain ``import kernels`` or ``importlib.util.find_spec("kernels")`` finds
this folder before the PyPI distribution named ``kernels``, which transformers imports (from 5.25
it requires it; 5.17 probes for it with ``find_spec`` and then imports it when it finds no
metadata). When this file is imported under that top-level name it therefore steps aside (see
:func:`_yield_the_top_level_name`): the installed distribution when there is one, else an empty
module, as Python gives for a folder that is not a package.
"""

from __future__ import annotations

__all__: list[str] = []


def _yield_the_top_level_name() -> None:
    """Replace the module being imported as top-level ``kernels`` with the installed ``kernels``,
    or, with none installed, with an empty stand-in.

    The import system returns whatever ``sys.modules["kernels"]`` holds once this file has run, so
    loading the distribution's package there is enough. The search skips every ``sys.path`` entry
    that resolves to this checkout's root.

    Without a distribution the stand-in is what Python itself gives for a folder without an
    ``__init__.py`` (a namespace package with nothing in it): no ``__file__``, no ``__version__``,
    no submodules (``import kernels.x`` raises ModuleNotFoundError, ``from kernels import x``
    ImportError). Raising ModuleNotFoundError here instead breaks callers that first found this
    folder with ``importlib.util.find_spec("kernels")`` (which cannot be told to skip it) and then
    import it: transformers 5.17's ``is_kernels_available`` does exactly that, and treats a module
    with neither ``__version__`` nor ``__file__`` as "a namespace package shadowing on sys.path,
    not a real install", i.e. not available.
    """
    import importlib.util
    import sys
    from importlib.machinery import ModuleSpec, PathFinder
    from pathlib import Path

    checkout = Path(__file__).resolve().parent.parent
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != checkout]
    spec = PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        # a namespace package with no portion: empty, and submodule imports find nothing
        stand_in = importlib.util.module_from_spec(ModuleSpec("kernels", None, is_package=True))
        stand_in.__path__ = []
        sys.modules["kernels"] = stand_in
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _yield_the_top_level_name()

"""genolong.parallel: memory techniques applied over the plain model, and the distributed job.

The distributed side lives in its submodules: ``mesh`` (the device mesh), ``context`` / ``cp_*``
(context parallelism), ``expert`` (expert parallelism), ``timeout`` (stalled ranks), ``shutdown``
(how a rank exits). The memory techniques:

- :func:`parallelize` applies them in a fixed order (MoE token chunks, recompute, offload);
- :func:`apply_recompute`: none | selective (per module kind) | full activation recomputation;
- :class:`ActivationOffloader` / :func:`apply_offload`: per-layer CPU activation offload with
  prefetch in backward.

The names below load their module on first use (module ``__getattr__``), so that the torch-free
parts (``genolong.parallel.recompute``'s constants, which the planner ``genolong.plan`` reads) import
without torch.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ..lazy import lazy_exports

__all__ = [
    "ActivationOffloader",
    "DEFAULT_SELECTIVE",
    "MODULE_KINDS",
    "RECOMPUTE_MODES",
    "apply_moe_chunks",
    "apply_offload",
    "apply_recompute",
    "is_recomputed",
    "offloader_of",
    "parallelize",
    "recompute_module",
    "remove_recompute",
]

#: public name -> the submodule that defines it
_LAZY = {
    "ActivationOffloader": "offload",
    "apply_offload": "offload",
    "offloader_of": "offload",
    "apply_moe_chunks": "parallelize",
    "parallelize": "parallelize",
    "DEFAULT_SELECTIVE": "recompute",
    "MODULE_KINDS": "recompute",
    "RECOMPUTE_MODES": "recompute",
    "apply_recompute": "recompute",
    "is_recomputed": "recompute",
    "recompute_module": "recompute",
    "remove_recompute": "recompute",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)  # see the module docstring


class _Package(types.ModuleType):
    """This package's module type: the name ``parallelize`` stays the function.

    The submodule ``genolong.parallel.parallelize`` shares the function's name, and the import
    system binds a submodule on its package when it first loads it. When the package imported
    everything eagerly the function import came last and won; loading lazily, a first
    ``import genolong.parallel.parallelize`` elsewhere would leave the *module* under
    ``genolong.parallel.parallelize``. Ignoring that one binding keeps the function (read through
    :func:`__getattr__`).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "parallelize" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

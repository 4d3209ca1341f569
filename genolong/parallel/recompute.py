"""Activation recomputation (checkpointing) over a plain :class:`~genolong.model.GenoLM`.

``full`` checkpoints every :class:`~genolong.model.lm.Block`: autograd keeps only each block's
inputs (the ``[B, T, m, H]`` streams and, for a shared-indexer DSA layer, the ``[B, T, K]``
top-k indices) and rebuilds the block's activations during its backward. ``selective``
checkpoints chosen module kinds inside every block (see :data:`MODULE_KINDS`), trading less
recompute time for less saving.

Mechanism: torch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``) around the module's forward, installed as an instance attribute
``module.forward``. Nothing is wrapped or renamed: parameter names, ``state_dict`` keys and the
module tree stay those of the checkpoint format, and forward hooks on the module (the meter's,
the offloader's) still run around the checkpoint. The recomputation calls the original forward
directly, so those hooks do not fire a second time during backward.

Recompute gives the same activations bit for bit (the model has no randomness; the DSA top-k is
deterministic, lowest position wins ties), so a shared DSA layer that received its indices from
the forward pass sees the same selection its recomputed predecessor would make, and losses and
gradients equal those without recompute.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import InputError
from ..model.dsa import DSAMixer
from ..model.kda import KDAMixer
from ..model.layers import SwiGLU
from ..model.lm import Block
from ..model.mhc import HyperConnection
from ..model.moe import MoE

__all__ = [
    "RECOMPUTE_MODES",
    "MODULE_KINDS",
    "DEFAULT_SELECTIVE",
    "apply_recompute",
    "recompute_module",
    "is_recomputed",
    "remove_recompute",
]

#: Recompute modes accepted by :func:`apply_recompute`.
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")

#: Module kinds selective recompute can checkpoint inside each block: kind -> (attribute of the
#: Block, module type). "attn" and "ffn" are shorthands for both mixers and both feed-forwards.
_KIND_TARGETS: dict[str, tuple[tuple[str, type[nn.Module]], ...]] = {
    "kda": (("self_attn", KDAMixer),),  # the KDA mixer: projections, short conv, chunked delta rule, gated norm
    "dsa": (("self_attn", DSAMixer),),  # the DSA mixer: MLA projections, indexer top-k, sparse attention
    "moe": (("mlp", MoE),),  # router, routed experts and shared expert
    "mlp": (("mlp", SwiGLU),),  # the dense SwiGLU of the first layers
    "hc": (("attn_hc", HyperConnection), ("ffn_hc", HyperConnection)),  # the two mHC weight computations
}
_KIND_TARGETS["attn"] = _KIND_TARGETS["kda"] + _KIND_TARGETS["dsa"]
_KIND_TARGETS["ffn"] = _KIND_TARGETS["moe"] + _KIND_TARGETS["mlp"]

#: The module kinds selective recompute knows.
MODULE_KINDS: tuple[str, ...] = tuple(_KIND_TARGETS)

#: What ``selective`` checkpoints by default: both token mixers (on the small preset at 2k tokens
#: the KDA mixers alone hold 41% of the saved bytes) and the hyper-connection weights (17%, cheap
#: to recompute: elementwise work on ``[B, T, m*H]`` and one ``[m*H, (2+m)m]`` matmul); the MoE
#: (16%, a Python loop over experts to recompute) is left out. See benchmarks/memory.py.
DEFAULT_SELECTIVE: tuple[str, ...] = ("attn", "hc")


class _RecomputedForward:
    """A module's forward run under non-reentrant checkpointing while autograd records.

    Stored as the instance attribute ``module.forward`` (so ``nn.Module.__call__`` and its hooks
    call it); ``inner`` is the forward it replaced.
    """

    def __init__(self, inner: Callable[..., Any]):
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # inference: nothing is saved, nothing to recompute
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def is_recomputed(module: nn.Module) -> bool:
    """Whether :func:`recompute_module` was applied to ``module``."""
    return isinstance(module.__dict__.get("forward"), _RecomputedForward)


def recompute_module(module: nn.Module) -> nn.Module:
    """Checkpoint ``module``'s forward in place (idempotent); returns the module.

    Autograd then keeps only the module's tensor inputs and recomputes the rest in backward.
    """
    if not is_recomputed(module):
        module.forward = _RecomputedForward(module.forward)  # type: ignore[method-assign]
    return module


def remove_recompute(model: nn.Module) -> int:
    """Undo :func:`recompute_module` on ``model`` and all its submodules; returns how many."""
    count = 0
    for module in model.modules():
        if is_recomputed(module):
            del module.forward
            count += 1
    return count


def _check_kinds(modules: Iterable[str]) -> tuple[str, ...]:
    if isinstance(modules, str):
        modules = (modules,)
    kinds = tuple(modules)
    for kind in kinds:
        if kind not in _KIND_TARGETS:
            near = difflib.get_close_matches(str(kind), MODULE_KINDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise InputError(f"recompute module kind {kind!r} is unknown{hint}; choose from {', '.join(MODULE_KINDS)}")
    return kinds


def apply_recompute(model: nn.Module, mode: str = "none", modules: Sequence[str] = DEFAULT_SELECTIVE) -> list[str]:
    """Apply activation recomputation to a GenoLM in place.

    Args:
        model: a :class:`~genolong.model.GenoLM` (anything with ``layers`` of
            :class:`~genolong.model.lm.Block`).
        mode: "none" (default: nothing), "selective" (checkpoint the ``modules`` kinds inside
            every block) or "full" (checkpoint every block: saved per layer = its inputs,
            ``streams [B, T, m, H]`` plus ``indices [B, T, K]`` on shared DSA layers).
        modules: kinds for "selective" (default, or empty: :data:`DEFAULT_SELECTIVE`); see
            :data:`MODULE_KINDS`: "kda", "dsa", "attn" (= kda + dsa), "moe", "mlp" (dense),
            "ffn" (= moe + mlp), "hc" (the hyper-connection weights). Ignored otherwise.

    Returns:
        The qualified names of the checkpointed modules (e.g. ``layers.3.self_attn``).

    Raises:
        InputError: an unknown mode or module kind, a model without blocks, or a model that
            already has recompute applied.
    """
    if mode not in RECOMPUTE_MODES:
        near = difflib.get_close_matches(str(mode), RECOMPUTE_MODES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise InputError(f"recompute mode {mode!r} is unknown{hint}; choose one of {', '.join(RECOMPUTE_MODES)}")
    kinds = _check_kinds(modules)
    if mode == "none":
        return []
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(b, Block) for b in layers):
        raise InputError(f"apply_recompute needs a GenoLM (model.layers of Blocks); got {type(model).__name__}")
    if any(is_recomputed(m) for m in model.modules()):
        raise InputError("recompute is already applied to this model; apply it once (remove_recompute undoes it)")
    names = {id(m): n for n, m in model.named_modules()}
    chosen: list[nn.Module] = []
    if mode == "full":
        chosen = list(layers)
    else:
        kinds = kinds or DEFAULT_SELECTIVE
        for block in layers:
            for kind in kinds:
                for attr, cls in _KIND_TARGETS[kind]:
                    module = getattr(block, attr)
                    if isinstance(module, cls) and all(module is not c for c in chosen):
                        chosen.append(module)
    for module in chosen:
        recompute_module(module)
    return [names[id(m)] for m in chosen]

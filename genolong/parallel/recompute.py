"""Activation recomputation (checkpointing) over a plain :class:`~genolong.model.GenoLM`.

``full`` checkpoints every :class:`~genolong.model.lm.Block`: autograd keeps only each block's
inputs (the ``[B, T, m, H]`` streams and, for a shared-indexer DSA layer, the ``[B, T, K]``
top-k indices) and rebuilds the block's activations during its backward. ``selective``
checkpoints chosen module kinds inside every block (see :data:`MODULE_KINDS`), trading less
recompute time for less saving. ``chunked`` keeps what ``full`` keeps (the block inputs) but
bounds what backward rebuilds at once: the attention half and the feed-forward half of a block
are rebuilt separately, each ``chunk_tokens`` tokens at a time: the feed-forward half
(position-wise) in token chunks, a KDA attention half in token segments carrying the recurrent
state (:mod:`genolong.parallel.chunked_kda`), a DSA attention half in query segments over the
slice's keys (:mod:`genolong.parallel.chunked_dsa`); see :class:`ChunkedBlockForward`.

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
import functools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..model.config import INDEXED_ATTENTION, LINEAR_ATTENTION

# torch and the model's modules load on first use, not at import: the recipe loader
# (genolong.config) and ``genolong plan`` read this module's constants without paying torch's
# import time (tests/cli/test_cli_startup.py checks it)
if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..model.lm import Block

__all__ = [
    "RECOMPUTE_MODES",
    "MODULE_KINDS",
    "DEFAULT_SELECTIVE",
    "ATTENTION_HALVES",
    "DEFAULT_CHUNK_TOKENS",
    "AttentionHalf",
    "ChunkedBlockForward",
    "apply_recompute",
    "recompute_module",
    "is_recomputed",
    "remove_recompute",
]

#: Recompute modes accepted by :func:`apply_recompute`.
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full", "chunked")

#: Tokens ``chunked`` rebuilds at a time by default (``memory.recompute_chunk_tokens``' default).
DEFAULT_CHUNK_TOKENS = 16384

#: The module kinds selective recompute knows (the keys of :func:`_kind_targets`, in its order).
MODULE_KINDS: tuple[str, ...] = ("kda", "dsa", "moe", "mlp", "hc", "attn", "ffn")


@functools.cache
def _kind_targets() -> dict[str, tuple[tuple[str, type[nn.Module]], ...]]:
    """Module kinds selective recompute can checkpoint inside each block: kind -> (attribute of
    the Block, module type). "attn" and "ffn" are shorthands for both mixers and both
    feed-forwards. Built on first use (it imports the model's torch modules)."""
    from ..model.dsa import DSAMixer
    from ..model.kda import KDAMixer
    from ..model.layers import SwiGLU
    from ..model.mhc import HyperConnection
    from ..model.moe import MoE

    targets: dict[str, tuple[tuple[str, type[nn.Module]], ...]] = {
        "kda": (("self_attn", KDAMixer),),  # the KDA mixer: projections, short conv, chunked delta rule, gated norm
        "dsa": (("self_attn", DSAMixer),),  # the DSA mixer: MLA projections, indexer top-k, sparse attention
        "moe": (("mlp", MoE),),  # router, routed experts and shared expert
        "mlp": (("mlp", SwiGLU),),  # the dense SwiGLU of the first layers
        "hc": (("attn_hc", HyperConnection), ("ffn_hc", HyperConnection)),  # the two mHC weight computations
    }
    targets["attn"] = targets["kda"] + targets["dsa"]
    targets["ffn"] = targets["moe"] + targets["mlp"]
    assert tuple(targets) == MODULE_KINDS, "MODULE_KINDS must list the kinds of _kind_targets, in order"
    return targets


#: What ``selective`` checkpoints by default: both token mixers (on the small preset at 2k tokens
#: the KDA mixers alone hold 41% of the saved bytes) and the hyper-connections (their weight
#: computation, 17%, is now rebuilt in backward anyway: ``HyperConnection.recompute_weights``;
#: "hc" adds only ``pre``, m fp32 per token); the MoE (16%, a Python loop over experts to
#: recompute) is left out. See benchmarks/memory.py.
DEFAULT_SELECTIVE: tuple[str, ...] = ("attn", "hc")


class _RecomputedForward:
    """A module's forward run under non-reentrant checkpointing while autograd records.

    Stored as the instance attribute ``module.forward`` (so ``nn.Module.__call__`` and its hooks
    call it); ``inner`` is the forward it replaced.
    """

    def __init__(self, inner: Callable[..., Any]):
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # inference: nothing is saved, nothing to recompute
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def is_recomputed(module: nn.Module) -> bool:
    """Whether :func:`recompute_module` (or ``chunked`` recompute, on a block) was applied to ``module``."""
    return isinstance(module.__dict__.get("forward"), (_RecomputedForward, ChunkedBlockForward))


def recompute_module(module: nn.Module) -> nn.Module:
    """Checkpoint ``module``'s forward in place (idempotent); returns the module.

    Autograd then keeps only the module's tensor inputs and recomputes the rest in backward.
    """
    if not is_recomputed(module):
        module.forward = _RecomputedForward(module.forward)  # type: ignore[method-assign]
    return module


def remove_recompute(model: nn.Module) -> int:
    """Undo :func:`recompute_module` (and ``chunked`` recompute) on ``model`` and all its submodules;
    returns how many modules were restored."""
    count = 0
    for module in model.modules():
        if is_recomputed(module):
            del module.forward
            count += 1
    return count


# -- chunked: the two halves of a block rebuilt separately, the feed-forward half in token chunks ----

#: An attention half run in token segments: ``(block, streams [B, T, m, H], prev_indices
#: [B, T, k] or None, chunk_tokens) -> (streams [B, T, m, H], indices [B, T, k] or None)``. It may
#: checkpoint its segments itself (non-reentrant ``torch.utils.checkpoint``); it must give the
#: values of ``Block.attention_half`` (bitwise, or to its own stated tolerance).
AttentionHalf = Callable[
    ["Block", "torch.Tensor", "torch.Tensor | None", int], "tuple[torch.Tensor, torch.Tensor | None]"
]


def whole_attention_half(
    block: Block, streams: torch.Tensor, prev_indices: torch.Tensor | None, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention half in one piece (:meth:`Block.attention_half`; ``chunk_tokens`` unused).

    Inside :class:`ChunkedBlockForward`'s block-level checkpoint this rebuilds the whole half at
    once in backward, as ``full`` does: the placeholder for a layer type that has no segmented
    attention half in :data:`ATTENTION_HALVES`. Shapes as :data:`AttentionHalf`.
    """
    return block.attention_half(streams, prev_indices)


def segmented_kda_half(
    block: Block, streams: torch.Tensor, prev_indices: torch.Tensor | None, chunk_tokens: int
) -> tuple[torch.Tensor, None]:
    """A KDA layer's attention half in checkpointed segments of ``chunk_tokens`` tokens carrying
    the KDA state and the short-conv tail (:func:`genolong.parallel.chunked_kda.kda_attention_half`;
    KDA layers take no ``prev_indices`` and return no indices). Shapes as :data:`AttentionHalf`."""
    from .chunked_kda import kda_attention_half

    return kda_attention_half(block, streams, chunk_tokens), None


#: The attention half ``chunked`` runs per layer type (``Block.layer_type``), looked up at each
#: call: KDA layers in token segments carrying the recurrent state
#: (:func:`segmented_kda_half`), DSA layers in query segments over the slice's keys
#: (:func:`genolong.parallel.chunked_dsa.dsa_attention_half`); :func:`whole_attention_half` is
#: the unsegmented form (what ``full`` rebuilds) for comparison. Built on first use (the DSA half
#: imports torch): read it as ``recompute.ATTENTION_HALVES`` (module ``__getattr__``) or through
#: :func:`_attention_halves`; both give the same dict, so a test may patch its items.
ATTENTION_HALVES: dict[str, AttentionHalf]


def _attention_halves() -> dict[str, AttentionHalf]:
    """:data:`ATTENTION_HALVES`, built and bound in this module on the first call."""
    halves = globals().get("ATTENTION_HALVES")
    if halves is None:
        from .chunked_dsa import dsa_attention_half

        halves = {LINEAR_ATTENTION: segmented_kda_half, INDEXED_ATTENTION: dsa_attention_half}
        globals()["ATTENTION_HALVES"] = halves
    return halves


def __getattr__(name: str) -> Any:
    """``ATTENTION_HALVES`` on first use (see its comment)."""
    if name == "ATTENTION_HALVES":
        return _attention_halves()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ffn_piece(block: Block, piece: torch.Tensor) -> torch.Tensor:
    """The feed-forward half on one token chunk ``[1, c, m, H]``; during backward's recomputation
    the MoE's ``last_routing`` keeps the whole forward's statistics (the chunk's would overwrite
    them)."""
    from ..model.moe import MoE
    from .offload import _in_backward

    if isinstance(block.mlp, MoE) and _in_backward():
        stats = block.mlp.last_routing
        try:
            return block.ffn_half(piece)
        finally:  # also when the recomputation stops early, once it has rebuilt what backward needs
            block.mlp.last_routing = stats
    return block.ffn_half(piece)


def _skip_piece(piece: torch.Tensor) -> torch.Tensor:
    # the block-level recomputation needs only the chunk inputs (saved when the chunk's checkpoint
    # is entered), not the chunk's output: the chunk's own checkpoint rebuilds that later
    return piece


def chunked_ffn_half(block: Block, streams: torch.Tensor, chunk_tokens: int, *, skip: bool = False) -> torch.Tensor:
    """:meth:`Block.ffn_half` over ``chunk_tokens`` tokens at a time, each chunk under a
    non-reentrant checkpoint (autograd keeps the chunk's input, a view of ``streams``).

    The ``B * T`` tokens are cut in order (the half is position-wise, so a chunk may span batch
    rows); the MoE's routing statistics (``block.mlp.last_routing``) are the sum over the chunks,
    and its sequence-wise balance loss counts each chunk as one sequence.

    Args:
        block: the layer.
        streams: ``[B, T, m, H]``, the attention half's output.
        chunk_tokens: tokens per chunk (the last chunk takes the rest).
        skip: return the chunk inputs for outputs (the block-level recomputation, which only
            needs the chunks' checkpoints entered; default False).

    Returns:
        ``[B, T, m, H]``.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    from ..model.moe import MoE

    b, t, m, h = streams.shape
    flat = streams.reshape(1, b * t, m, h)
    fn = _skip_piece if skip else partial(_ffn_piece, block)
    moe = block.mlp if isinstance(block.mlp, MoE) and not skip else None
    outs, stats = [], []
    # one split (not a slice per chunk): its backward concatenates the chunks' gradients once,
    # where each slice's backward would write its chunk into a zero-filled [1, B*T, m, H] buffer
    for piece in flat.split(chunk_tokens, dim=1):
        outs.append(checkpoint(fn, piece, use_reentrant=False, preserve_rng_state=False))
        if moe is not None and moe.last_routing is not None:
            stats.append(moe.last_routing)
    if moe is not None and stats:
        moe.last_routing = sum(stats[1:], stats[0])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    # B = 1: the tensor itself, not a view of it (FSDP2 warns about a block returning a view)
    return out if b == 1 else out.view(b, t, m, h)


class ChunkedBlockForward:
    """A block's forward under ``chunked`` recompute; installed as the instance attribute
    ``block.forward`` (so ``Block.__call__`` and every hook on it, FSDP2's and the offloader's,
    still run around it).

    Forward, while autograd records: one non-reentrant checkpoint around the whole block, so
    autograd keeps the block inputs only (``streams [B, T, m, H]``, plus a shared DSA layer's
    ``prev_indices [B, T, k]``), as under ``full``. Inside it, the attention half of
    :data:`ATTENTION_HALVES` (per layer type), then :func:`chunked_ffn_half`.

    Backward of the block, in three steps, so that no step rebuilds more than ``chunk_tokens``
    tokens of one half (with a segmented attention half):

    1. the block-level recomputation runs the attention half again to rebuild its output (the
       feed-forward half's input, ``[B, T, m, H]``; a segmented half keeps only its segment
       inputs and carried states) and enters each feed-forward chunk's checkpoint without running
       the chunk (``skip``);
    2. each feed-forward chunk is rebuilt and differentiated, last chunk first;
    3. the attention half's own segments are rebuilt and differentiated, last segment first
       (:func:`whole_attention_half` has none: it was recorded whole in step 1, as ``full`` does).

    So the segmented attention half runs three times (forward, step 1, step 3), the feed-forward
    half twice, as under ``full``. Results: with :func:`whole_attention_half` and one chunk
    covering the tokens, ``full``'s bitwise; with several chunks the feed-forward's matmuls run on
    fewer rows and its parameter gradients are sums over chunks, and the segmented halves sum the
    gradients of what crosses a segment boundary (KDA state and conv tail, DSA keys) per segment:
    the same maths in another float order (tests/parallel/test_recompute_chunked.py bounds it by fp32
    rounding).

    Without autograd recording (inference) the plain :meth:`Block.forward` runs.

    Args:
        block: the layer.
        chunk_tokens: tokens rebuilt at a time.
    """

    def __init__(self, block: Block, chunk_tokens: int):
        self.block = block
        self.chunk_tokens = chunk_tokens

    def __call__(
        self, streams: torch.Tensor, prev_indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch
        from torch.utils.checkpoint import checkpoint

        from ..model.lm import Block

        if not torch.is_grad_enabled():
            return Block.forward(self.block, streams, prev_indices)
        # the model has no randomness: no RNG state to stash per block
        return checkpoint(self._layer, streams, prev_indices, use_reentrant=False, preserve_rng_state=False)

    def _layer(
        self, streams: torch.Tensor, prev_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from .offload import _in_backward

        block = self.block
        rebuilding = _in_backward()  # step 1 of backward (see the class docstring)
        mid, indices = _attention_halves()[block.layer_type](block, streams, prev_indices, self.chunk_tokens)
        return chunked_ffn_half(block, mid, self.chunk_tokens, skip=rebuilding), indices


def _check_chunk_tokens(chunk_tokens: object) -> int:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InputError(
            f"recompute chunk_tokens must be a positive integer (memory.recompute_chunk_tokens), got {chunk_tokens!r}"
        )
    return chunk_tokens


def _check_kinds(modules: Iterable[str]) -> tuple[str, ...]:
    if isinstance(modules, str):
        modules = (modules,)
    kinds = tuple(modules)
    for kind in kinds:
        if kind not in MODULE_KINDS:
            near = difflib.get_close_matches(str(kind), MODULE_KINDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise InputError(f"recompute module kind {kind!r} is unknown{hint}; choose from {', '.join(MODULE_KINDS)}")
    return kinds


def apply_recompute(
    model: nn.Module,
    mode: str = "none",
    modules: Sequence[str] = DEFAULT_SELECTIVE,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> list[str]:
    """Apply activation recomputation to a GenoLM in place.

    Args:
        model: a :class:`~genolong.model.GenoLM` (anything with ``layers`` of
            :class:`~genolong.model.lm.Block`).
        mode: "none" (default: nothing), "selective" (checkpoint the ``modules`` kinds inside
            every block) or "full" (checkpoint every block: saved per layer = its inputs,
            ``streams [B, T, m, H]`` plus ``indices [B, T, K]`` on shared DSA layers) or
            "chunked" (keep what "full" keeps; rebuild each half of a block separately, the
            feed-forward half ``chunk_tokens`` tokens at a time).
        modules: kinds for "selective" (default, or empty: :data:`DEFAULT_SELECTIVE`); see
            :data:`MODULE_KINDS`: "kda", "dsa", "attn" (= kda + dsa), "moe", "mlp" (dense),
            "ffn" (= moe + mlp), "hc" (the hyper-connection weights). Ignored otherwise.
        chunk_tokens: for "chunked", tokens rebuilt at a time (default
            :data:`DEFAULT_CHUNK_TOKENS`); see :class:`ChunkedBlockForward`. Ignored otherwise.

    Returns:
        The qualified names of the checkpointed modules (e.g. ``layers.3.self_attn``).

    Raises:
        InputError: an unknown mode or module kind, a bad ``chunk_tokens``, a model without
            blocks, or a model that already has recompute applied.
    """
    if mode not in RECOMPUTE_MODES:
        near = difflib.get_close_matches(str(mode), RECOMPUTE_MODES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise InputError(f"recompute mode {mode!r} is unknown{hint}; choose one of {', '.join(RECOMPUTE_MODES)}")
    kinds = _check_kinds(modules)
    if mode == "chunked":
        _check_chunk_tokens(chunk_tokens)
    if mode == "none":
        return []
    from torch import nn

    from ..model.lm import Block

    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(b, Block) for b in layers):
        raise InputError(f"apply_recompute needs a GenoLM (model.layers of Blocks); got {type(model).__name__}")
    if any(is_recomputed(m) for m in model.modules()):
        raise InputError("recompute is already applied to this model; apply it once (remove_recompute undoes it)")
    names = {id(m): n for n, m in model.named_modules()}
    chosen: list[nn.Module] = []
    if mode == "chunked":
        for block in layers:
            block.forward = ChunkedBlockForward(block, chunk_tokens)  # type: ignore[method-assign]
        return [names[id(b)] for b in layers]
    if mode == "full":
        chosen = list(layers)
    else:
        kinds = kinds or DEFAULT_SELECTIVE
        for block in layers:
            for kind in kinds:
                for attr, cls in _kind_targets()[kind]:
                    module = getattr(block, attr)
                    if isinstance(module, cls) and all(module is not c for c in chosen):
                        chosen.append(module)
    for module in chosen:
        recompute_module(module)
    return [names[id(m)] for m in chosen]

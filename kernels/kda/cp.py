"""Context-parallel Kimi Delta Attention over a process group (plain torch, any backend).

Each rank of the group holds one contiguous slice of every sequence, in rank order (rank 0 the
first tokens). Per head, the KDA state update of a slice is affine in the state it starts from::

    S_out = A_r S_in + B_r,    A_r = prod_t (I - b_t k_t k_t^T) Diag(exp g_t)   ([K, K])
                               B_r = the slice's final state from a zero start  ([K, V])

and so is every output of the slice: ``o_t = o0_t + S_in^T P_t`` with ``o0`` the outputs from a zero
start and ``P_t = scale * (A_{1..t})^T q_t`` the query read through the transition so far.

All four come from one local :func:`~genolong.kernels.kda.chunk_kda` call (chunked, no per-token
loop; any op of that signature via ``kda_fn``) on values widened by ``K`` columns: ``v' = [v | 0]`` from the initial state ``[0 | I]``. The
state's columns evolve independently, so the final state is ``[B_r | A_r]`` and the outputs are
``[o0 | P]``. Then the ranks all-gather ``[B_r | A_r]``, each folds the earlier ranks' pairs
(``S <- A_j S + B_j``, j < r) into its ``S_in`` and corrects its outputs, a ``[T, K] x [K, V]``
product. Backward mirrors it: the reverse fold gives every rank the gradients of the earlier ranks'
pairs, an all-reduce hands each rank the sum of the gradients of its own pair, and autograd does the
rest locally (through the local op). The widened values cost the local op ``(V + K) / V`` times its
plain work (twice for ``K = V``).

The pieces are public for callers that split a slice further (the KDA attention half in token
segments, :mod:`genolong.parallel.chunked_kda`): :func:`affine_state` (the widened local run, from
``[0 | I]`` or from the map of earlier tokens of the slice) and :func:`fold_states` (the all-gather
and fold, with its backward).

The short convolutions in front of KDA need the ``kernel - 1`` tokens before the slice:
:func:`conv_halo` gathers them from the previous ranks (differentiable).

Every rank of the group must call these functions in the same order, and in backward every rank
must back-propagate through the result (the backward runs a collective).

Communication per rank per call (``e`` bytes per element of the accumulation dtype: 4 for
float32 / bfloat16 / float16 inputs, 8 for float64; ``W`` the group size), see
:func:`cp_kda_comm_bytes` and :func:`conv_halo_comm_bytes`:

- ``cp_chunk_kda`` forward: one all-gather of ``B * H * K * (K + V) * e`` bytes per rank;
  backward: one all-reduce of ``W * B * H * K * (K + V) * e`` bytes.
- ``conv_halo`` forward: one all-gather of 8 bytes (the slice length) and one of
  ``B * (kernel - 1) * C * x.element_size()`` bytes per rank; backward: one all-reduce of ``W``
  times that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm_bytes import conv_halo_payload, kda_state_payload  # the arithmetic, torch-free (genolong plan)
from .chunk import chunk_kda
from .recurrent import check_kda_inputs, compute_dtype

__all__ = [
    "KDAFn",
    "affine_state",
    "comm_meter",
    "conv_halo",
    "conv_halo_comm_bytes",
    "cp_chunk_kda",
    "cp_kda_comm_bytes",
    "fold_states",
    "identity_map",
]


#: A local KDA op with :func:`~genolong.kernels.kda.chunk_kda`'s signature, returning
#: ``(o, final_state)``.
KDAFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


# ---------------------------------------------------------------------------------------------
# communication meter (for the benchmarks: bytes each rank hands to the collectives)

_METERS: list[dict[str, int]] = []


@contextlib.contextmanager
def comm_meter() -> Iterator[dict[str, int]]:
    """Count the payload bytes this process hands to the collectives of this module.

    Yields a dict ``{"all_gather": bytes, "all_reduce": bytes}`` that fills while the context is
    open (forward and backward alike); payload means the tensor this rank passes in (for an
    all-gather its own contribution, for an all-reduce the whole buffer). Meters nest.
    """
    meter = {"all_gather": 0, "all_reduce": 0}
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


def _count(op: str, x: torch.Tensor) -> None:
    for meter in _METERS:
        meter[op] += x.numel() * x.element_size()


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` from every rank of ``group``, stacked in rank order: ``[W, *x.shape]`` (no autograd)."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _count("all_gather", x)
    dist.all_gather(out, x, group=group)
    return torch.stack(out)


def _all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # all-reduce rather than reduce-scatter: gloo has no reduce-scatter, and the buffers here are
    # small (states, or a few conv rows)
    x = x.contiguous()
    _count("all_reduce", x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


class _FoldStates(torch.autograd.Function):
    """All-gather every rank's ``[B_j | A_j]`` and fold the earlier ranks' into the incoming state.

    forward: ``X_r [B, H, K, V + K]`` -> ``S_in [B, H, K, V]`` with ``S_0 = 0``,
    ``S_{j+1} = A_j S_j + B_j`` for ``j < r``.
    backward: reverse fold ``dB_j = G``, ``dA_j = G S_j^T``, ``G <- A_j^T G`` for ``j = r-1 .. 0``,
    then an all-reduce so that rank ``r`` receives the summed gradients of its own ``X_r``.
    The output always takes part in the caller's result (also on rank 0, where it is zero), so the
    backward, and with it the collective, runs on every rank.
    """

    @staticmethod
    def forward(ctx, X: torch.Tensor, group: dist.ProcessGroup, V: int) -> torch.Tensor:  # type: ignore[override]
        rank = dist.get_rank(group)
        Xs = _all_gather(X, group)  # [W, B, H, K, V + K]
        S = X.new_zeros(X.shape[:-1] + (V,))  # [B, H, K, V]
        for j in range(rank):
            S = Xs[j, ..., V:] @ S + Xs[j, ..., :V]
        ctx.group, ctx.rank, ctx.V = group, rank, V
        ctx.save_for_backward(Xs[:rank])
        return S

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (Xs,) = ctx.saved_tensors  # [r, B, H, K, V + K]
        rank, V = ctx.rank, ctx.V
        W = dist.get_world_size(ctx.group)
        # the states each earlier fold step started from (recomputed: r small [K, V] products)
        starts = [G.new_zeros(G.shape)]
        for j in range(rank - 1):
            starts.append(Xs[j, ..., V:] @ starts[-1] + Xs[j, ..., :V])
        dX = G.new_zeros((W,) + G.shape[:-1] + (V + G.shape[-2],))  # [W, B, H, K, V + K]
        G = G.contiguous()
        for j in range(rank - 1, -1, -1):
            dX[j, ..., :V] = G
            dX[j, ..., V:] = G @ starts[j].transpose(-1, -2)
            G = Xs[j, ..., V:].transpose(-1, -2) @ G
        dX = _all_reduce_sum(dX, ctx.group)
        return dX[rank].clone(), None, None


class _GatherTails(torch.autograd.Function):
    """All-gather ``[B, h, C]`` tails: forward ``[W, B, h, C]``; backward all-reduces the gradient
    and returns this rank's part. Used with every rank's result depending on the gathered tensor
    (see :func:`conv_halo`), so the backward collective runs on every rank."""

    @staticmethod
    def forward(ctx, tail: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(tail, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = _all_reduce_sum(grad.clone(), ctx.group)
        return grad[dist.get_rank(ctx.group)].clone(), None


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a context-parallel group was given but torch.distributed is not initialised")
    return dist.get_world_size(group)


def cp_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    kda_fn: KDAFn | None = None,
) -> torch.Tensor:
    """Kimi Delta Attention over a sequence split in contiguous slices across a process group.

    Args:
        q: queries ``[B, T_local, H, K]`` of this rank's slice (rank ``r`` of the group holds the
            ``r``-th contiguous slice; slices may differ in length, even be empty).
        k: keys ``[B, T_local, H, K]``.
        v: values ``[B, T_local, H, V]``.
        g: per-channel log decay ``[B, T_local, H, K]``, ``<= 0``.
        beta: delta-rule step sizes ``[B, T_local, H]``.
        group: the context-parallel process group (e.g.
            :func:`genolong.parallel.mesh.cp_group`); None or a group of one rank: plain
            :func:`~genolong.kernels.kda.chunk_kda` (zero initial state).
        scale: query scale; default ``K ** -0.5``.
        chunk_size: chunk length of the local chunked form, a power of two; default 64.
        kda_fn: the local KDA op, with :func:`~genolong.kernels.kda.chunk_kda`'s signature (e.g. a
            kernel backend's ``chunk_kda``; it must honour ``initial_state`` and
            ``output_final_state``, and accept values wider than the keys); default ``chunk_kda``.

    Returns:
        ``o [B, T_local, H, V]`` in ``v``'s dtype: the outputs of this slice's tokens in the KDA over
        the whole sequence from a zero state. Differentiable in q, k, v, g, beta; every rank of the
        group must call this collectively, and back-propagate through it collectively.
    """
    kda = chunk_kda if kda_fn is None else kda_fn
    W = _group_size(group)
    if W == 1:
        return kda(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)[0]
    check_kda_inputs(q, k, v, g, beta, scale, None)
    V = v.shape[-1]
    o_aug, X = affine_state(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, kda_fn=kda)
    if q.shape[1] == 0:
        # an empty slice passes the state through (X = [0 | I], a constant); tie X to the (empty)
        # inputs so that this rank, too, runs the fold's backward and its collective
        X = X + sum(x.sum() for x in (q, k, v, g, beta)).to(X.dtype)
    S_in = fold_states(X, group, V)  # [B, H, K, V]
    o0, P = o_aug[..., :V], o_aug[..., V:]  # [B, T, H, V], [B, T, H, K]
    o = o0 + torch.einsum("bthk,bhkv->bthv", P, S_in)
    return o.to(v.dtype)


def identity_map(
    B: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """The identity affine state map ``[0 | I]``: ``[B, H, K, V + K]`` (``S -> I S + 0``)."""
    eye = torch.eye(K, dtype=dtype, device=device).expand(B, H, K, K)
    return torch.cat([torch.zeros(B, H, K, V, dtype=dtype, device=device), eye], dim=-1)


def affine_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    start: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    kda_fn: KDAFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine state map of a run of tokens, ``S_out = A S_in + B``, composed onto ``start``.

    One local KDA call on values widened by ``K`` zero columns, ``v' = [v | 0]``, from the initial
    state ``start = [B_0 | A_0]`` (the map of the tokens before; default ``[0 | I]``): the state's
    columns evolve independently, so the final state is ``[A B_0 + B | A A_0]`` (the map from the
    start of ``start``'s tokens to the end of these) and the outputs are ``[o0 + P B_0 | P A_0]``
    with ``o0`` the outputs from a zero start and ``P_t = scale (A_{1..t})^T q_t``. Chained over
    consecutive segments (each ``start`` the previous one's result) it gives the final state of one
    call over their concatenation (with the torch op and segments on chunk boundaries the chunk
    recurrence runs the same operations, so bit for bit; otherwise to rounding).

    Args:
        q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` (as
            :func:`~genolong.kernels.kda.chunk_kda`).
        start: ``[B, H, K, V + K]`` in the accumulation dtype, or None (the identity).
        scale, chunk_size: as :func:`~genolong.kernels.kda.chunk_kda`.
        kda_fn: the local KDA op (default :func:`~genolong.kernels.kda.chunk_kda`); it must honour
            ``initial_state`` and ``output_final_state`` and accept values wider than the keys.

    Returns:
        ``(o_aug [B, T, H, V + K], X [B, H, K, V + K])``, both in the accumulation dtype (float32, or
        float64 for float64 inputs); differentiable in every input (``start`` included).
    """
    kda = chunk_kda if kda_fn is None else kda_fn
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = compute_dtype(q.dtype)
    # in the accumulation dtype so that P and A are not rounded to a low-precision v dtype
    v_aug = torch.cat([v.to(cdt), v.new_zeros(B, T, H, K, dtype=cdt)], dim=-1)  # [B, T, H, V + K]
    s0 = identity_map(B, H, K, V, cdt, q.device) if start is None else start
    o_aug, X = kda(q, k, v_aug, g, beta, scale=scale, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
    assert X is not None, "kda_fn returned no final state for output_final_state=True"
    return o_aug, X


def fold_states(X: torch.Tensor, group: dist.ProcessGroup, V: int) -> torch.Tensor:
    """The state a rank's slice starts from: all-gather every rank's map ``[B_j | A_j]``, fold the
    earlier ranks' (``S <- A_j S + B_j`` for ``j < r``, from zero).

    Args:
        X: this rank's slice map ``[B, H, K, V + K]`` (:func:`affine_state`).
        group: the context-parallel process group (at least 2 ranks).
        V: the value head dim.

    Returns:
        ``S_in [B, H, K, V]`` (zeros on rank 0). Differentiable: its backward all-reduces the
        gradients of every rank's map, so every rank of the group must call this collectively, use
        ``S_in`` in its result, and back-propagate through it collectively.
    """
    return _FoldStates.apply(X, group, V)


def conv_halo(x: torch.Tensor, kernel: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The ``kernel - 1`` sequence rows just before this rank's slice (for a causal short conv).

    Args:
        x: this rank's slice ``[B, T_local, C]`` (rank ``r`` holds the ``r``-th contiguous slice;
            slices may differ in length, and be shorter than ``kernel - 1``: the rows then come
            from several earlier ranks).
        kernel: the causal convolution's kernel size, ``>= 1``.
        group: the context-parallel process group; None or a group of one rank: zeros.

    Returns:
        ``[B, kernel - 1, C]``: rows ``start - kernel + 1 .. start - 1`` of the whole sequence, with
        zeros before its beginning (all zeros on rank 0), in ``x``'s dtype. Concatenated in front of
        ``x`` it makes the local causal convolution equal to the full one. Differentiable; every rank
        of the group must call it collectively and back-propagate through it collectively.
    """
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1:
        raise ValueError(f"kernel must be an integer >= 1 (the short conv's kernel size), got {kernel!r}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape [B, T_local, C] (3 dims), got {tuple(x.shape)}")
    h = kernel - 1
    B, T, C = x.shape
    W = _group_size(group)
    if W == 1 or h == 0:
        return x.new_zeros(B, h, C)
    assert group is not None
    rank = dist.get_rank(group)
    n = min(T, h)
    lengths = _all_gather(torch.tensor([n], dtype=torch.int64, device=x.device), group)[:, 0].tolist()
    tail = F.pad(x[:, T - n :], (0, 0, h - n, 0))  # [B, h, C], valid rows last
    tails = _GatherTails.apply(tail, group)  # [W, B, h, C]
    # zeros, then every rank's valid tail rows in order; this rank's halo is the h rows ending
    # where its own tail would start (a slice of a tensor built from all ranks' tails, so the
    # backward's all-reduce runs on every rank, rank 0 included)
    seq = torch.cat([x.new_zeros(B, h, C)] + [tails[j, :, h - lengths[j] :] for j in range(W)], dim=1)
    end = h + sum(lengths[:rank])
    return seq[:, end - h : end]


def cp_kda_comm_bytes(B: int, H: int, K: int, V: int, cp: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Payload bytes one rank hands to the collectives in one :func:`cp_chunk_kda` call.

    Args:
        B, H, K, V: batch, heads, key and value head dims.
        cp: context-parallel group size.
        dtype: the input dtype (the states travel in the accumulation dtype: float64 for float64,
            float32 otherwise).

    Returns:
        ``{"forward": B*H*K*(K+V)*e, "backward": cp*B*H*K*(K+V)*e}`` (``e`` = 4 or 8); 0 for
        ``cp == 1``. With ring algorithms a rank sends ``(cp-1)`` times the forward payload and
        ``2 (cp-1)/cp`` times the backward payload over the wire.
    """
    return kda_state_payload(B, H, K, V, cp, torch.empty((), dtype=compute_dtype(dtype)).element_size())


def conv_halo_comm_bytes(B: int, C: int, kernel: int, cp: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Payload bytes one rank hands to the collectives in one :func:`conv_halo` call.

    Returns ``{"forward": 8 + B*(kernel-1)*C*e, "backward": cp*B*(kernel-1)*C*e}`` with ``e`` the
    element size of ``dtype`` (the 8 bytes are the slice length); 0 for ``cp == 1`` or
    ``kernel == 1``.
    """
    return conv_halo_payload(B, C, kernel, cp, torch.empty((), dtype=dtype).element_size())

"""Apply genolong's memory techniques and parallelism to a plain GenoLM, in a fixed order (the
torchtitan pattern).

Order, and why:

1. MoE token chunks (an attribute of each MoE);
2. context parallelism over the mesh's ``cp`` group (the KDA / DSA mixers exchange states and
   keys; :func:`genolong.parallel.context.apply_context_parallel`) and expert parallelism over
   its EP groups (:func:`genolong.parallel.expert.apply_expert_parallel`: the routed experts
   become DTensors over the expert mesh, tokens travel by all-to-all), before recompute so that
   a recomputed block repeats the same collectives in backward (and recompute wraps the EP
   forward of a MoE);
3. activation recompute (per block or per module);
4. CPU activation offload (hooks around each block; inside a recomputed block only the block
   inputs are saved, so those are what moves);
5. FSDP2 last: ``fully_shard`` on the token embedding, on every block, then on the root (final
   norm, head),
   over the mesh's ``dp_shard x cp`` ranks (:func:`genolong.parallel.mesh.fsdp_mesh`; HSDP when
   ``dp_replicate > 1``); with expert parallelism the routed experts of each MoE are their own
   (nested) unit over the ranks holding the same experts
   (:func:`genolong.parallel.mesh.expert_fsdp_mesh`); in a bf16-mixed run every module that holds
   a :data:`~genolong.model.config.KEEP_FP32` parameter (the router, the KDA short convolution and
   forget gate, the mHC connections) is a nested unit with an fp32 policy
   (:func:`fp32_modules`). FSDP2's unshard / reshard hooks then wrap the recompute and offload
   machinery, so a block's full parameters exist only while it runs forward or backward, and the
   offloader never copies parameters (it skips them by identity and storage).

Steps 1, 3 and 4 only set attributes or install hooks/forwards on the existing modules; step 5
turns parameters into DTensor shards but keeps their names: ``state_dict`` keys are unchanged, so
checkpoints load and save as without them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Shard

from ..errors import InputError
from ..model.config import KEEP_FP32
from ..model.moe import MoE
from .context import apply_context_parallel
from .expert import apply_expert_parallel
from .mesh import cp_group, ep_mesh, ep_size, expert_fsdp_mesh, fsdp_mesh
from .offload import apply_offload
from .recompute import DEFAULT_CHUNK_TOKENS, apply_recompute

__all__ = ["FP32_POLICY", "apply_fsdp", "apply_moe_chunks", "fp32_modules", "parallelize"]

#: The policy of the :func:`fp32_modules` units in a mixed-precision run: parameters gathered and
#: gradients reduced in fp32, and the unit's inputs left as they come (FSDP2's default casts the
#: floating-point inputs to ``param_dtype``, which would turn the bf16 activations entering, e.g.,
#: the short convolution into fp32 and change its output dtype, and so the rest of the block).
FP32_POLICY = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def fp32_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that directly hold a parameter named by
    :data:`~genolong.model.config.KEEP_FP32`, in ``named_modules`` order (GenoLM: each MoE's
    router, each KDA mixer's ``conv1d`` and ``forget_gate``, each block's ``attn_hc`` and
    ``ffn_hc``). Their other parameters come with them (the forget gate's low-rank projections,
    the mHC ``fn``: 1% of a GLM-5.3-Flash block; their matmuls still run in bf16 under autocast).
    """
    owners: list[nn.Module] = []
    for prefix, module in model.named_modules():
        names = (f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters(recurse=False))
        if any(KEEP_FP32.search(name) for name in names):
            owners.append(module)
    return owners


def apply_moe_chunks(model: nn.Module, chunk_tokens: int | None) -> int:
    """Set the dispatch chunk of every MoE module of ``model`` (None: the whole batch at once).

    Each MoE then routes and runs its experts ``chunk_tokens`` tokens at a time, so the gathered
    per-expert inputs (``[n_e, H]`` for expert ``e``) never exceed one chunk; results are the
    same up to float summation order. Returns the number of MoE modules changed.

    Raises:
        InputError: ``chunk_tokens`` is not None and not a positive integer.
    """
    if chunk_tokens is not None and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    ):
        raise InputError(f"moe_chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, MoE):
            module.chunk_tokens = chunk_tokens
            count += 1
    return count


def parallelize(
    model: nn.Module,
    *,
    recompute: str = "none",
    recompute_modules: Sequence[str] = (),
    recompute_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    offload: bool = False,
    offload_min_bytes: int = 2**20,
    offload_pool_bytes: int | None = None,
    moe_chunk_tokens: int | None = None,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    ep: int | None = None,
) -> nn.Module:
    """Apply the memory techniques, context parallelism, expert parallelism and FSDP2 to a GenoLM in place (in the
    order of the module docstring); returns the same model.

    Args:
        model: a :class:`~genolong.model.GenoLM` (``input_ids [B, T] -> hidden [B, T, H]``).
        recompute: "none" (default), "selective", "full" or "chunked"; see
            :func:`genolong.parallel.recompute.apply_recompute`. "full" keeps per layer only the
            block inputs (``streams [B, T, hc_mult, H]``, plus ``indices [B, T, K]`` on a shared
            DSA layer).
        recompute_modules: module kinds for "selective": any of "kda", "dsa", "attn", "moe",
            "mlp", "ffn", "hc" (default (): :data:`~genolong.parallel.recompute.DEFAULT_SELECTIVE`,
            ("attn", "hc")).
        recompute_chunk_tokens: for "chunked", tokens rebuilt at a time in backward (default
            16384, :data:`~genolong.parallel.recompute.DEFAULT_CHUNK_TOKENS`).
        offload: move each block's saved activations of at least ``offload_min_bytes`` to
            (pinned, on CUDA) host memory during forward and prefetch them back one block ahead
            in backward (default False); see :class:`genolong.parallel.offload.ActivationOffloader`
            and :func:`genolong.parallel.offload.offloader_of`.
        offload_min_bytes: smallest saved tensor worth offloading (default 1 MiB).
        offload_pool_bytes: the offloader's host pool size (the planner's pinned-host figure;
            default None: the first step's peak), see :class:`genolong.parallel.offload.HostPool`.
        moe_chunk_tokens: MoE dispatch chunk in tokens (default None: the whole batch).
        mesh: the job's ``(dp_replicate, dp_shard, cp)`` mesh from
            :func:`genolong.parallel.mesh.build_mesh` (default None: one process, no FSDP2).
            With a mesh, the model must then be fed each rank's slice of every window
            (``genolong.data.windows.context_parallel_bounds``) and its gradients are FSDP2's:
            summed (not averaged) over the ``dp_shard x cp`` ranks, so scale the loss of each
            rank by the global target count (as :class:`genolong.train.module.GenoLMModule`
            does) for the gradient of the global mean.
        param_dtype: FSDP2 mixed precision: the dtype parameters are all-gathered in and
            computed with (default None: as stored; ``torch.bfloat16`` for bf16-mixed runs).
        reduce_dtype: FSDP2 mixed precision: the dtype of the gradient reduce-scatter (default
            None: ``param_dtype``; ``torch.float32`` keeps the reduction exact-ish in bf16 runs).
        ep: the expert-parallel size the caller expects (the recipe's ``parallel.ep``); the EP
            groups themselves come from ``mesh`` (``build_mesh`` with ``parallel.ep``). Default
            None: whatever the mesh has (1 without a mesh).

    Raises:
        InputError: an unknown recompute mode or module kind, a bad chunk size or threshold, a
            model that is not a GenoLM, techniques already applied, precision settings
            without a mesh, ``ep`` other than the mesh's, or an EP size that does not divide the
            model's experts.

    Loss and gradients are unchanged by every combination (exactly for recompute and offload,
    up to float summation order for MoE chunks, context parallelism and the FSDP2 reduction).
    """
    if mesh is None and (param_dtype is not None or reduce_dtype is not None):
        raise InputError(
            "param_dtype / reduce_dtype are FSDP2's mixed precision: they need a mesh (a multi-process run)"
        )
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InputError(f"parallelize needs a GenoLM (a model with .layers); got {type(model).__name__}")
    if isinstance(offload_min_bytes, bool) or not isinstance(offload_min_bytes, int) or offload_min_bytes < 0:
        raise InputError(f"offload_min_bytes must be a non-negative integer, got {offload_min_bytes!r}")
    if not isinstance(offload, bool):
        raise InputError(f"offload must be true or false, got {offload!r}")
    if ep is not None and ep != ep_size(mesh):
        raise InputError(
            f"parallel.ep = {ep} but the mesh has expert-parallel groups of {ep_size(mesh)} ranks; build the mesh "
            "with the same parallel section (genolong.parallel.mesh.build_mesh)"
        )
    apply_moe_chunks(model, moe_chunk_tokens)
    if mesh is not None:
        apply_context_parallel(model, cp_group(mesh))
        apply_expert_parallel(model, ep_mesh(mesh))
    apply_recompute(model, recompute, recompute_modules, chunk_tokens=recompute_chunk_tokens)
    if offload:
        apply_offload(model, offload_min_bytes, pool_bytes=offload_pool_bytes)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return model


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
) -> nn.Module:
    """FSDP2 over ``mesh``'s ``dp_shard x cp`` ranks: one ``fully_shard`` unit for the token
    embedding, one per block (under expert parallelism its routed experts a nested unit over the
    ranks holding the same experts), then the root (final norm, LM head and whatever else is
    left). The embedding is a unit of its own so that the largest unit a rank gathers is one
    vocabulary-sized matrix, not two (GLM-5.3-Flash: 0.63B parameters instead of 1.27B).

    Every parameter becomes a ``Shard(0)`` DTensor over :func:`genolong.parallel.mesh.fsdp_mesh`
    (2-D HSDP: replicated over ``dp_replicate``). Gradients are summed over those ranks (divide
    factor 1): each rank's share of the loss is already divided by the global target count, and
    the context-parallel ranks' gradients are partial sums of the same sequence's, so an average
    would be wrong for them. Returns ``model``.

    With ``param_dtype`` below fp32 (bf16-mixed), each of :func:`fp32_modules` (the holders of
    the :data:`~genolong.model.config.KEEP_FP32` parameters) is a nested unit of its block with
    :data:`FP32_POLICY`: inside the forward those parameters are fp32, as in a one-process
    bf16-mixed run (fp32 parameters, autocast), while every other parameter is gathered in
    ``param_dtype``. Cost per block: about five more (small) all-gathers and reduce-scatters.
    """
    shard_mesh = fsdp_mesh(mesh)
    expert_mesh = expert_fsdp_mesh(mesh)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # a cast to a lower precision: the KEEP_FP32 parameters' modules become fp32 units of their own
    # (FSDP2 gathers a unit in one dtype, so a parameter cannot be kept out of its unit's cast)
    mixed = param_dtype is not None and param_dtype != torch.float32
    keep = {id(m) for m in fp32_modules(model)} if mixed else set()
    # the embedding runs first in forward and its gradient comes last in backward: resharded in
    # between, like every block but the last
    embedding = model.embed_tokens  # type: ignore[attr-defined]
    fully_shard(embedding, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=True)
    units = [*model.layers, model]  # type: ignore[attr-defined]
    nested: list[nn.Module] = [embedding]
    for i, unit in enumerate(units):
        # the root is resharded anyway after forward; the last block stays unsharded because
        # backward needs it first (torchtitan's choice)
        reshard = i < len(units) - 2
        if expert_mesh is not None and i < len(units) - 1 and isinstance(getattr(unit, "mlp", None), MoE):
            # the routed experts (DTensors Shard(0) over "ep") are their own unit over the ranks
            # holding the same experts; sharded on dim 1 (rows of each expert), so that with
            # the EP shard on dim 0 the placements stay plain (Shard(1), Shard(0)) and global
            # shapes need no padding of the expert dimension
            experts = unit.mlp.experts
            fully_shard(
                experts,
                mesh=expert_mesh,
                mp_policy=policy,
                reshard_after_forward=reshard,
                shard_placement_fn=lambda param: Shard(1),
            )
            nested.append(experts)
        for module in unit.modules():
            if id(module) in keep:
                # the block's own reshard choice: unsharded while the block is (a block's are
                # sharded before the root reaches them, so each module is a unit once)
                keep.discard(id(module))
                fully_shard(module, mesh=shard_mesh, mp_policy=FP32_POLICY, reshard_after_forward=reshard)
                # methods that read the parameters without forward (ForgetGate.gated_kda)
                for method in getattr(module, "fsdp_forward_methods", ()):
                    register_fsdp_forward_method(module, method)
                nested.append(module)
        fully_shard(unit, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=reshard)
    for unit in [*nested, *units]:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        # a plain SUM (not NCCL's PreMulSum by 1): gloo has no PreMulSum, and with a factor of
        # 1 there is no separate scaling to pay for
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model

"""The device mesh: (dp_replicate, dp_shard, cp) from the recipe's ``parallel`` section.

Layout: ``init_device_mesh(device_type, (dp_replicate, dp_shard, cp), mesh_dim_names=MESH_DIMS)``.
``cp`` is the innermost (fastest-varying) dimension, so the ranks of one context-parallel group are
consecutive global ranks: on a multi-GPU node they share the node's fast links, which matters
because CP collectives run inside every KDA / DSA layer, while data-parallel collectives (FSDP
all-gather / reduce-scatter) run once per block. Global rank ``= (r * dp_shard + s) * cp + c`` for
mesh coordinates ``(r, s, c)``.

- :func:`mesh_shape`: pure validation of the sizes (no processes needed);
- :func:`build_mesh`: the ``DeviceMesh`` (the default process group must exist, or is created by
  torch from the usual ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` environment);
- :func:`cp_group`, :func:`cp_rank`, :func:`cp_size`, :func:`dp_mesh`, :func:`dp_rank`,
  :func:`dp_size`, :func:`fsdp_mesh`: what the layers, FSDP2 and the data module need, all safe for ``mesh=None``
  (a single process).

Besides the three named dimensions the mesh carries two flattened ones: ``"dp"``
(``dp_replicate x dp_shard``, the ranks that read different windows) and ``"dp_shard_cp"``
(``dp_shard x cp``, what FSDP2 shards over).

Expert parallelism (``parallel.ep > 1``) is folded into the ``dp_shard x cp`` ranks of a replica
(Megatron's "MoE parallel folding", torchtitan's EP): a second mesh over the same ranks,
``(dp_replicate, efsdp, ep)`` with ``efsdp = dp_shard * cp / ep`` (:func:`expert_mesh`), ``ep``
innermost, so an EP group is ``ep`` consecutive global ranks (rank ``= (r * efsdp + f) * ep + e``,
the same numbering as the dense mesh's ``dp_shard_cp`` index ``s * cp + c = f * ep + e``). Expert
weights are ``Shard(0)`` over ``ep`` (:func:`ep_mesh`) and FSDP2-sharded over ``efsdp`` (HSDP with
``dp_replicate``: :func:`expert_fsdp_mesh`).
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import InputError

__all__ = [
    "MESH_DIMS",
    "ParallelSizes",
    "build_mesh",
    "cp_group",
    "cp_rank",
    "cp_size",
    "dp_mesh",
    "dp_rank",
    "dp_size",
    "ep_mesh",
    "ep_size",
    "expert_fsdp_mesh",
    "expert_mesh",
    "fsdp_mesh",
    "mesh_shape",
]

#: Mesh dimension names, outermost first.
MESH_DIMS: tuple[str, str, str] = ("dp_replicate", "dp_shard", "cp")
#: Expert mesh dimension names (:func:`expert_mesh`), outermost first.
EXPERT_MESH_DIMS: tuple[str, str, str] = ("dp_replicate", "efsdp", "ep")
# the expert mesh of a dense mesh built by build_mesh (an attribute, so that two meshes of the same
# layout built one after the other keep their own groups)
_EXPERT_ATTR = "_genolong_expert_mesh"


class ParallelSizes(Protocol):
    """What :func:`build_mesh` reads from a recipe's ``parallel`` section
    (:class:`genolong.config.ParallelSection` satisfies it)."""

    cp: int
    dp_shard: int
    dp_replicate: int
    ep: int
    # optional: parallel.timeout_s (seconds), read with getattr

    @property
    def world_size(self) -> int:  # pragma: no cover - protocol
        """All processes (``devices * num_nodes``)."""
        ...


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def mesh_shape(cp: int, dp_shard: int, dp_replicate: int, world_size: int, ep: int = 1) -> dict[str, int]:
    """Validate the parallel sizes and resolve ``dp_shard = -1``.

    Args:
        cp: context-parallel size (ranks that share one sequence), ``>= 1``.
        dp_shard: FSDP (sharded data-parallel) size, ``>= 1``, or ``-1`` for all ranks left after
            ``cp * dp_replicate``.
        dp_replicate: replicated data-parallel size (HSDP replicas), ``>= 1``.
        world_size: number of processes, ``>= 1``.
        ep: expert-parallel size, ``>= 1``, dividing ``dp_shard * cp`` (default 1).

    Returns:
        ``{"dp_replicate": r, "dp_shard": s, "cp": c}`` (in :data:`MESH_DIMS` order) with
        ``r * s * c == world_size``.

    Raises:
        InputError: a size is not a positive integer (``dp_shard`` may be -1), ``cp * dp_replicate``
            does not divide the world size, the product of the three is not the world size, or
            ``ep`` does not divide ``dp_shard * cp``.
    """
    for name, value in (
        ("parallel.cp", cp),
        ("parallel.dp_replicate", dp_replicate),
        ("world size", world_size),
        ("parallel.ep", ep),
    ):
        if not _is_int(value) or value < 1:
            raise InputError(f"{name} = {value!r}: must be an integer >= 1")
    if not _is_int(dp_shard) or (dp_shard != -1 and dp_shard < 1):
        raise InputError(
            f"parallel.dp_shard = {dp_shard!r}: must be an integer >= 1, or -1 for all ranks left after cp x dp_replicate"
        )
    if dp_shard == -1:
        if world_size % (cp * dp_replicate):
            raise InputError(
                f"parallel.cp ({cp}) x parallel.dp_replicate ({dp_replicate}) = {cp * dp_replicate} does not divide the world "
                f"size {world_size}; choose cp and dp_replicate whose product divides {world_size}"
            )
        dp_shard = world_size // (cp * dp_replicate)
    elif cp * dp_shard * dp_replicate != world_size:
        raise InputError(
            f"parallel.cp ({cp}) x parallel.dp_shard ({dp_shard}) x parallel.dp_replicate ({dp_replicate}) = "
            f"{cp * dp_shard * dp_replicate} but the world size is {world_size}; make the product {world_size} or set "
            "parallel.dp_shard: -1"
        )
    if (dp_shard * cp) % ep:
        raise InputError(
            f"parallel.ep = {ep} does not divide parallel.dp_shard x parallel.cp = {dp_shard} x {cp} = {dp_shard * cp} "
            f"(the ranks the experts are spread over); choose ep among the divisors of {dp_shard * cp}"
        )
    return {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp}


def build_mesh(parallel: ParallelSizes, world_size: int | None = None, device_type: str = "cpu") -> DeviceMesh:
    """Build the ``(dp_replicate, dp_shard, cp)`` device mesh of the running job.

    Args:
        parallel: the recipe's ``parallel`` section (``cp``, ``dp_shard`` (-1 = all ranks left),
            ``dp_replicate``, ``world_size``).
        world_size: processes in the job; default ``parallel.world_size`` (``devices *
            num_nodes``). When a process group exists its size must equal this.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); default ``"cpu"``.

    Returns:
        A 3-D ``DeviceMesh`` with dimension names :data:`MESH_DIMS`, plus the flattened dimensions
        ``"dp"`` and ``"dp_shard_cp"`` (see :func:`dp_mesh`, :func:`fsdp_mesh`); with
        ``parallel.ep > 1`` (default 1 when the section has no ``ep``) it also carries the expert
        mesh (:func:`expert_mesh`). Every process of the job must call this (it creates the
        sub-groups collectively). With ``parallel.timeout_s`` every process group of the job
        (these and the ones made before) then has that timeout
        (:func:`genolong.parallel.timeout.set_timeout`: torch gives sub-groups its library default).

    Raises:
        InputError: invalid sizes (see :func:`mesh_shape`) or a world size that differs from the
            running process group's.
    """
    running = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world_size is None:
        world_size = parallel.world_size
    if running is not None and world_size != running:
        raise InputError(
            f"the parallel mesh needs {world_size} processes but the job runs {running}; set parallel.devices x "
            f"parallel.num_nodes to {running} or launch {world_size} processes"
        )
    ep = getattr(parallel, "ep", 1)
    shape = mesh_shape(parallel.cp, parallel.dp_shard, parallel.dp_replicate, world_size, ep=ep)
    mesh = init_device_mesh(device_type, tuple(shape[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    # flattened dimensions, made here because creating their groups is collective (later
    # ``_flatten`` calls with the same name return the cached mesh): "dp" = the ranks reading
    # different windows; "dp_shard_cp" = the ranks FSDP2 shards parameters over (the CP ranks of a
    # group compute gradients of the same parameters from different tokens, so their gradients
    # are reduced together with the data-parallel ones, as in torchtitan)
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    if ep > 1:
        # a second root mesh over the same ranks (creating its groups is collective too); FSDP2
        # needs the expert weights' EP mesh and their FSDP mesh to come from one root
        efsdp = shape["dp_shard"] * shape["cp"] // ep
        experts = init_device_mesh(device_type, (shape["dp_replicate"], efsdp, ep), mesh_dim_names=EXPERT_MESH_DIMS)
        # the flattened (efsdp, ep) dimension: a reduction over an expert weight's two shard
        # dimensions (its gradient norm) is then one all-reduce, not two in sequence
        experts[("efsdp", "ep")]._flatten("efsdp_ep")
        setattr(mesh, _EXPERT_ATTR, experts)
    timeout_s = getattr(parallel, "timeout_s", None)
    if timeout_s is not None:
        from .timeout import set_timeout

        set_timeout(timeout_s)
    return mesh


def expert_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``(dp_replicate, efsdp, ep)`` expert mesh that :func:`build_mesh` made for
    ``parallel.ep > 1`` (module docstring); None for ``mesh=None`` or ``ep = 1``."""
    return None if mesh is None else getattr(mesh, _EXPERT_ATTR, None)


def ep_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D ``"ep"`` mesh of this rank's expert-parallel group (``ep`` consecutive ranks; the
    routed experts are ``Shard(0)`` over it); None without expert parallelism."""
    experts = expert_mesh(mesh)
    return None if experts is None else experts["ep"]


def ep_size(mesh: DeviceMesh | None) -> int:
    """Ranks per expert-parallel group (1 without expert parallelism)."""
    experts = expert_mesh(mesh)
    return 1 if experts is None else experts["ep"].size()


def expert_fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """FSDP2's mesh for the routed experts: ``"efsdp"`` (the ``dp_shard x cp / ep`` ranks holding
    the same experts, 1-D), or ``("dp_replicate", "efsdp")`` (HSDP) when ``dp_replicate > 1``;
    None without expert parallelism."""
    experts = expert_mesh(mesh)
    if experts is None:
        return None
    if experts["dp_replicate"].size() == 1:
        return experts["efsdp"]
    return experts[("dp_replicate", "efsdp")]


def cp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The context-parallel process group of this rank, or None without parallelism.

    Args:
        mesh: a mesh from :func:`build_mesh`, or None (single process).

    Returns:
        The ``cp`` dimension's process group; None when ``mesh`` is None or the CP size is 1 (the
        layers then run their plain single-process path, e.g. ``cp_chunk_kda(..., group=None)``).
    """
    if mesh is None or mesh["cp"].size() == 1:
        return None
    return mesh.get_group("cp")


def cp_rank(mesh: DeviceMesh | None) -> int:
    """This rank's position in its CP group (which contiguous slice of each sequence it holds);
    0 for ``mesh=None``."""
    return 0 if mesh is None else mesh["cp"].get_local_rank()


def cp_size(mesh: DeviceMesh | None) -> int:
    """Ranks per CP group (slices per sequence); 1 for ``mesh=None``."""
    return 1 if mesh is None else mesh["cp"].size()


def dp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The flattened 1-D ``"dp"`` mesh (``dp_replicate x dp_shard``: the ranks that read different
    windows, one per CP group; for reducing loss and metrics over data parallelism); None for
    ``mesh=None``. ``mesh`` must come from :func:`build_mesh`."""
    return None if mesh is None else mesh[("dp_replicate", "dp_shard")]._flatten("dp")


def fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh for FSDP2's ``fully_shard(mesh=...)``: the flattened ``dp_shard x cp`` dimension
    ``"dp_shard_cp"`` (1-D), or the 2-D ``("dp_replicate", "dp_shard_cp")`` mesh (HSDP) when
    ``dp_replicate > 1``; None for ``mesh=None``. Parameters are sharded over, and gradients reduced
    over, every rank of a replica, the CP ranks included. ``mesh`` must come from :func:`build_mesh`.
    """
    if mesh is None:
        return None
    flat = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")  # cached by build_mesh
    if mesh["dp_replicate"].size() == 1:
        return flat
    with warnings.catch_warnings():
        # torch >= 2.11 warns that slicing a flattened dimension from the root mesh will go away;
        # it is the documented way to get an HSDP mesh that includes one (tests cover it)
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[("dp_replicate", "dp_shard_cp")]


def dp_rank(mesh: DeviceMesh | None) -> int:
    """This rank's data-parallel index ``r * dp_shard + s`` (which windows it reads; the ranks of
    one CP group share it); 0 for ``mesh=None``."""
    if mesh is None:
        return 0
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


def dp_size(mesh: DeviceMesh | None) -> int:
    """Data-parallel groups ``dp_replicate * dp_shard`` (distinct window streams); 1 for
    ``mesh=None``."""
    return 1 if mesh is None else mesh["dp_replicate"].size() * mesh["dp_shard"].size()

"""genolong.plan: the memory planner behind ``genolong plan``: will a recipe fit, per GPU and per node, before it runs?

Everything is predicted from formulas over the :class:`~genolong.model.config.ModelConfig`
dimensions and the recipe's settings; nothing is measured or looked up. Each module says what it
models and which measurement holds it to the real thing. From the bottom up (a module imports only
those above it):

- ``constants``: sizes the parts share (a GiB, the device workspace, fragmentation, the kernels'
  block sizes);
- ``backends``: which kernels' save sets count for a model's ``kernel_backend``
  (:func:`backend_kernels`);
- ``activations``: the saved-tensor inventory per layer type and the saved activations of a
  training step (:func:`layer_saved_tensors`, :func:`chunked_recompute_terms`,
  :func:`activation_estimate`, :func:`dsa_buffer_bytes`), held to
  :class:`~genolong.memory.meter.ActivationMeter`;
- ``params``: the model's parameters and linear layers by name from the config, and which of them a
  recipe trains, freezes or adapts (:func:`parameter_split`, :class:`ParameterSplit`);
- ``comm``: collective traffic per rank per step, context parallel, expert parallel and FSDP2
  (:func:`comm_estimate`, :func:`ep_comm_bytes`, :func:`fsdp_unit_groups`);
- ``recipe``: what both plans read from a recipe (the architecture, the mesh, the MoE imbalance);
- ``train``: the training plan (:func:`plan`, :class:`Plan`): device memory per GPU, pinned host
  memory, the verdict and the cheapest change that fits;
- ``evaluate``: the evaluation plan, forward only (:func:`eval_plan`, :class:`EvalPlan`,
  :func:`forward_working_set`, :func:`stream_cache_tensors`);
- ``report``: the text tables (:func:`format_plan`, :func:`format_eval_plan`).

The whole package imports without torch or Lightning: ``genolong plan`` stays light
(``tests/cli/test_cli_startup.py``).
"""

from __future__ import annotations

from .activations import (
    PLAN_RECOMPUTE_MODES,
    ActivationEstimate,
    ChunkedTerms,
    SavedTensor,
    TrainedParts,
    activation_estimate,
    chunked_recompute_terms,
    dsa_buffer_bytes,
    layer_saved_tensors,
    outside_saved_tensors,
)
from .backends import BACKEND_KERNELS, DSA_KERNELS, KDA_KERNELS, backend_kernels
from .comm import (
    COMM_CONVENTIONS,
    COMM_PARTS,
    PAYLOAD,
    RECEIVED,
    SENT,
    CommEstimate,
    CommRow,
    FSDPUnit,
    comm_estimate,
    ep_comm_bytes,
    fsdp_unit_groups,
    fsdp_units,
    routed_expert_parameters,
)
from .constants import FRAGMENTATION, GIB, WORKSPACE_BYTES
from .evaluate import (
    CPU_PROCESS_BYTES,
    EVAL_CHUNK_ROWS,
    EvalPlan,
    WorkingTensor,
    eval_outside_tensors,
    eval_plan,
    forward_working_set,
    stream_cache_tensors,
)
from .params import ParameterSplit, linear_shapes, lora_adapter_shapes, parameter_shapes, parameter_split
from .recipe import recipe_moe_imbalance
from .report import format_eval_plan, format_plan
from .train import ATTENTION_LORA, ATTENTION_ONLY_FREEZE, TRANSIENTS, Plan, plan

__all__ = [
    "ATTENTION_LORA",
    "ATTENTION_ONLY_FREEZE",
    "BACKEND_KERNELS",
    "COMM_CONVENTIONS",
    "COMM_PARTS",
    "DSA_KERNELS",
    "EVAL_CHUNK_ROWS",
    "EvalPlan",
    "FRAGMENTATION",
    "GIB",
    "KDA_KERNELS",
    "PAYLOAD",
    "PLAN_RECOMPUTE_MODES",
    "RECEIVED",
    "SENT",
    "TRANSIENTS",
    "WORKSPACE_BYTES",
    "ActivationEstimate",
    "CPU_PROCESS_BYTES",
    "ChunkedTerms",
    "CommEstimate",
    "CommRow",
    "FSDPUnit",
    "ParameterSplit",
    "Plan",
    "SavedTensor",
    "TrainedParts",
    "WorkingTensor",
    "activation_estimate",
    "backend_kernels",
    "chunked_recompute_terms",
    "comm_estimate",
    "dsa_buffer_bytes",
    "eval_outside_tensors",
    "eval_plan",
    "ep_comm_bytes",
    "format_eval_plan",
    "format_plan",
    "forward_working_set",
    "fsdp_unit_groups",
    "fsdp_units",
    "layer_saved_tensors",
    "linear_shapes",
    "lora_adapter_shapes",
    "outside_saved_tensors",
    "parameter_shapes",
    "parameter_split",
    "plan",
    "recipe_moe_imbalance",
    "routed_expert_parameters",
    "stream_cache_tensors",
]

"""Low-rank adapters (LoRA) on a GenoLM, read and written in the PEFT format.

LoRA (Hu et al., 2021) trains, beside a frozen linear layer ``W [out, in]``, two small matrices
``A [r, in]`` and ``B [out, r]``: the layer computes ``W x + (alpha / r) B A x``. With ``B = 0``
(its initial value) the model is the base model exactly; after training, ``W + (alpha / r) B A``
can be merged back into a plain checkpoint (:func:`merge_lora`).

genolong's adapters are PEFT's (``peft`` 0.21, the library transformers, vLLM's LoRA serving and
most tools read): the same initialisation (``A`` Kaiming-uniform with ``a = sqrt(5)``, ``B``
zeros), the same scaling ``alpha / r`` (no rsLoRA), the same forward (the dropout acts on the
adapter's input only) and the same files (:func:`save_adapter`): ``adapter_config.json`` and
``adapter_model.safetensors`` with the names PEFT gives the modules of transformers'
``Glm5NextForConditionalGeneration``, whose text tower has GenoLM's module names under
``model.language_model.`` (the LM head: ``lm_head``), e.g.
``base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight``.
The routed experts (``routed_experts``) are adapted as PEFT does with ``target_parameters`` on
their fused 3-D parameters: per expert ``e`` a rank-``r`` update of ``gate_up_proj[e] [2I, H]`` and
of ``down_proj[e] [H, I]``, held stacked by expert as the experts are (``A [E, r, in]``, ``B [E, out,
r]``, so that expert parallelism shards them with their experts) and written in PEFT's fused layout,
one ``[r * E, in]`` and one ``[out, r * E]`` matrix per parameter (:class:`ExpertAdapters`).

What trains under LoRA: the adapters and the modules named in ``modules_to_save`` (stored whole in
the adapter file, as PEFT does); every other parameter (and the MoE routing bias, a buffer) is the
base's and stays frozen.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import InputError
from ..files import fsync_tree, replace_dir, unique_sibling, writing

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ExpertAdapters",
    "LoraLinear",
    "LoraSettings",
    "adapter_parameters",
    "apply_lora",
    "experts_forward_weight",
    "has_lora",
    "load_adapter",
    "lora_modules",
    "merge_lora",
    "merged_expert_weight",
    "merged_linear_weight",
    "peft_name",
    "read_adapter_config",
    "save_adapter",
    "saved_module_tensors",
]

#: the files of an adapter directory (PEFT's names)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: where GenoLM's modules sit in transformers' ``Glm5NextForConditionalGeneration`` (the LM head sits at the top)
_HF_TEXT = "model.language_model."
#: PEFT's prefix of every key in an adapter file
_PEFT_PREFIX = "base_model.model."
#: the routed experts' fused parameters that ``routed_experts`` adapts, in PEFT's nesting order
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """What :func:`apply_lora` does; the fields of the recipe's ``model.lora``
    (:class:`genolong.config.LoraSection`), which any object with these attributes can stand for.

    Attributes:
        rank: the adapters' rank ``r`` (default 16).
        alpha: updates are scaled by ``alpha / rank`` (default 32.0).
        dropout: dropout on the adapters' input while training (default 0.0).
        targets: ``fnmatch`` globs over module names; every matched ``nn.Linear`` is adapted.
        routed_experts: adapt every routed expert's ``gate_up_proj`` and ``down_proj`` (default False).
        modules_to_save: globs over module names trained in full beside the adapters (default ()).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    routed_experts: bool = False
    modules_to_save: tuple[str, ...] = ()


def peft_name(module_name: str) -> str:
    """A GenoLM module name as transformers' ``Glm5NextForConditionalGeneration`` names it
    (``layers.0.self_attn.q_proj`` -> ``model.language_model.layers.0.self_attn.q_proj``;
    ``lm_head`` stays)."""
    return module_name if module_name == "lm_head" or module_name.startswith("lm_head.") else _HF_TEXT + module_name


def _genolong_name(hf_name: str) -> str:
    """The inverse of :func:`peft_name`."""
    return hf_name.removeprefix(_HF_TEXT)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trained low-rank update, as PEFT's ``lora.Linear``.

    ``forward(x [..., in]) -> [..., out]`` = ``base(x) + lora_B(lora_A(dropout(x))) * scaling``;
    the adapters compute in their own dtype (float32 for a bf16 base: they are trained parameters)
    and the sum is returned in the base's output dtype.

    Args:
        base: the layer adapted (kept as ``.base``; its parameters are frozen here).
        rank: ``r`` (``lora_A [r, in]``, ``lora_B [out, r]``).
        alpha: scaling numerator (``scaling = alpha / rank``).
        dropout: dropout probability on the adapter's input (training only).
        dtype: the adapters' dtype (default None: float32 if the base is floating point of lower
            precision, else the base's).
    """

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, dtype: torch.dtype | None = None
    ):
        super().__init__()
        if rank < 1:
            raise InputError(f"LoRA rank must be at least 1, got {rank}")
        self.base = base
        for param in base.parameters():
            param.requires_grad_(False)
        weight = base.weight
        dtype = dtype or (torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype)
        device = None if weight.device.type == "meta" else weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
        self.rank, self.alpha = int(rank), float(alpha)
        self.scaling = self.alpha / self.rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_adapter()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight ``W + scaling * B A`` ``[out, in]`` (in the base's dtype), for code
        that computes with a layer's matrix instead of calling it (DSA's absorbed ``kv_b_proj``);
        differentiable in the adapters. With ``B = 0`` it is ``W`` bitwise."""
        w = self.base.weight
        delta = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        return w + delta.to(w.dtype)

    def reset_adapter(self) -> None:
        """PEFT's initialisation: ``A`` Kaiming-uniform (``a = sqrt(5)``, ``nn.Linear``'s own), ``B`` zeros."""
        if self.lora_A.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A`` ``[out, in]`` in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        a = self.lora_A.weight
        update = self.lora_B(self.lora_A(self.dropout(x.to(a.dtype)))) * self.scaling
        return out + update.to(out.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


class _Factor(nn.Module):
    """One stacked LoRA factor of the routed experts, ``weight [E, a, b]`` (expert ``e``'s matrix
    ``weight[e]``), kept in a module so that its name ends in ``.weight`` as PEFT's do."""

    def __init__(self, shape: tuple[int, int, int], device: torch.device | None, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the local experts under expert parallelism), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ExpertAdapters(nn.Module):
    """Rank-``r`` updates of every routed expert's ``gate_up_proj [E, 2I, H]`` and ``down_proj
    [E, H, I]`` (a :class:`genolong.model.moe.Experts`): for a parameter ``[E, out, in]``,
    ``lora_A[name].weight [E, r, in]`` and ``lora_B[name].weight [E, out, r]``; the update of
    expert ``e`` is ``scaling * B[e] A[e]``. Stacked by expert like the experts themselves, so
    that expert parallelism shards them with the experts (``Shard(0)``, each rank its experts'
    factors: :func:`genolong.parallel.expert.apply_expert_parallel`).

    The adapter file holds them in PEFT's ``ParamWrapper`` layout (:func:`_to_peft`): ``A`` as
    ``[r * E, in]`` (rows ``e * r .. e * r + r`` are expert ``e``'s) and ``B`` as ``[out, r * E]``
    (column ``k * E + e`` is column ``k`` of expert ``e``'s ``B``). PEFT's adapters on 3-D
    parameters take no dropout (its ``ParamWrapper`` refuses it), nor do these.

    Attached to the experts module as ``experts.lora``; :meth:`expert_weight` gives the weights an
    expert computes with.

    Args:
        experts: the routed experts (their parameters are frozen here).
        rank, alpha: as :class:`LoraLinear`.
        dtype: the adapters' dtype (default float32).
    """

    def __init__(self, experts: nn.Module, rank: int, alpha: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.rank, self.alpha = int(rank), float(alpha)
        self.scaling = self.alpha / self.rank
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        for name in _EXPERT_PARAMETERS:
            param = getattr(experts, name)
            param.requires_grad_(False)
            e, out, inp = param.shape
            device = None if param.device.type == "meta" else param.device
            self.lora_A[name] = _Factor((e, rank, inp), device, dtype)
            self.lora_B[name] = _Factor((e, out, rank), device, dtype)
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.reset_adapter()

    def reset_adapter(self) -> None:
        """PEFT's initialisation (as :meth:`LoraLinear.reset_adapter`), drawn on PEFT's ``[r * E,
        in]`` layout of ``A`` (the same numbers as PEFT draws, fan-in ``in``)."""
        for name in _EXPERT_PARAMETERS:
            a = self.lora_A[name].weight
            if a.device.type == "meta":
                continue
            nn.init.kaiming_uniform_(a.view(-1, a.shape[-1]), a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name].weight)

    def factors(self, name: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s ``(B_e [out, r], A_e [r, in])`` for parameter ``name`` (under expert
        parallelism ``expert`` is the index among this rank's experts)."""
        return _local(self.lora_B[name].weight)[expert], _local(self.lora_A[name].weight)[expert]

    def delta(self, name: str, expert: int) -> torch.Tensor:
        """``scaling * B_e A_e`` ``[out, in]`` of one expert (adapter dtype)."""
        b, a = self.factors(name, expert)
        return (b @ a) * self.scaling

    def expert_weight(self, base: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        """``base[expert] + scaling * B_e A_e`` in ``base``'s dtype (``base``: the experts' fused
        ``name`` parameter, or under expert parallelism this rank's slice of it; then ``expert``
        is the local index, as the adapters' own)."""
        w = base[expert]
        return w + self.delta(name, expert).to(w.dtype)


def _to_peft(part: str, weight: torch.Tensor) -> torch.Tensor:
    """An expert factor in PEFT's fused layout: ``A [E, r, in] -> [r * E, in]`` (expert-major
    rows), ``B [E, out, r] -> [out, r * E]`` (column ``k * E + e``); see :class:`ExpertAdapters`."""
    if part == "lora_A":
        return weight.reshape(-1, weight.shape[-1])
    return weight.permute(1, 2, 0).reshape(weight.shape[1], -1)


def _from_peft(part: str, tensor: torch.Tensor, experts: int) -> torch.Tensor:
    """The inverse of :func:`_to_peft` for ``experts`` experts."""
    if part == "lora_A":
        return tensor.reshape(experts, -1, tensor.shape[-1])
    return tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1)


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _set_child(model: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, child)


def apply_lora(model: nn.Module, lora: Any) -> list[str]:
    """Give ``model`` (a GenoLM) low-rank adapters in place and freeze every base parameter.

    Args:
        model: the model (any device but meta; its weights are the base's).
        lora: :class:`LoraSettings` or the recipe's ``model.lora`` section (``rank``, ``alpha``,
            ``dropout``, ``targets``, ``routed_experts``, ``modules_to_save``).

    Returns:
        The adapted module names (linear layers, then ``...mlp.experts`` for routed experts).

    Raises:
        InputError: a target glob that matches no ``nn.Linear`` (a typo would train nothing
            there), a ``modules_to_save`` glob that matches no module, LoRA applied twice, or
            ``routed_experts`` on a model without routed experts.
    """
    if has_lora(model):
        raise InputError("the model already has LoRA adapters; apply them once (load_adapter or apply_lora, not both)")
    modules = dict(model.named_modules())
    linears = [name for name, m in modules.items() if _is_linear(m)]
    for pattern in lora.targets:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
            example = next((n for n in linears if ".self_attn." in n), linears[0] if linears else "")
            raise InputError(
                f"model.lora.targets: {pattern!r} matches no linear layer (names look like {example!r}); "
                "fix the glob, e.g. 'layers.*.self_attn.*'"
            )
    for pattern in lora.modules_to_save:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in modules if name):
            raise InputError(
                f"model.lora.modules_to_save: {pattern!r} matches no module (names look like 'norm', "
                "'layers.0.input_layernorm'); fix the glob"
            )
    linear_names = [n for n in linears if _matches(n, lora.targets) and not _matches(n, lora.modules_to_save)]
    expert_names: list[str] = []
    if lora.routed_experts:
        expert_names = [
            name for name, m in modules.items() if name.endswith(".mlp.experts") and hasattr(m, "gate_up_proj")
        ]
        if not expert_names:
            raise InputError(
                "model.lora.routed_experts: this model has no routed experts (no MoE layer); set it to false"
            )
    saved_names = [name for name in modules if name and _matches(name, lora.modules_to_save)]
    return _wrap(model, lora, linear_names, expert_names, saved_names)


def _wrap(
    model: nn.Module, lora: Any, linear_names: Sequence[str], expert_names: Sequence[str], saved_names: Sequence[str]
) -> list[str]:
    """Freeze ``model``, wrap the named linear layers, give the named experts adapters and
    unfreeze the named modules; record the settings on the model. Returns the adapted names."""
    modules = dict(model.named_modules())
    for param in model.parameters():
        param.requires_grad_(False)
    for name in linear_names:
        _set_child(model, name, LoraLinear(modules[name], lora.rank, lora.alpha, lora.dropout))
    for name in expert_names:
        modules[name].lora = ExpertAdapters(modules[name], lora.rank, lora.alpha)
    for name in saved_names:
        for param in modules[name].parameters():
            param.requires_grad_(True)
    model.lora_settings = LoraSettings(
        rank=int(lora.rank),
        alpha=float(lora.alpha),
        dropout=float(lora.dropout),
        targets=tuple(lora.targets),
        routed_experts=bool(lora.routed_experts),
        modules_to_save=tuple(lora.modules_to_save),
    )
    model.lora_saved_modules = tuple(saved_names)
    return [*linear_names, *expert_names]


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries adapters (:func:`apply_lora`)."""
    return isinstance(getattr(model, "lora_settings", None), LoraSettings)


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The adapted linear layers by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def _expert_adapters(model: nn.Module) -> dict[str, ExpertAdapters]:
    """The routed experts' adapters by the experts module's name."""
    return {name.removesuffix(".lora"): m for name, m in model.named_modules() if isinstance(m, ExpertAdapters)}


def _saved_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The ``modules_to_save`` modules by name (outermost matches only)."""
    found: dict[str, nn.Module] = {}
    for name in sorted(getattr(model, "lora_saved_modules", ())):
        if not any(name.startswith(p + ".") for p in found):
            found[name] = model.get_submodule(name)
    return found


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """What LoRA trains, by GenoLM parameter name (``layers.0.self_attn.q_proj.lora_A.weight``,
    ``layers.1.mlp.experts.lora.lora_A.gate_up_proj.weight``, and the parameters of
    ``modules_to_save``)."""
    out = {name: p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}
    for module_name, module in _saved_modules(model).items():
        for name, p in module.named_parameters():
            out[f"{module_name}.{name}"] = p
    return out


def merged_linear_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``W + scaling * B A`` ``[out, in]`` in float32 (``weight [out, in]``, ``lora_a [r, in]``,
    ``lora_b [out, r]``): the merge of one adapted linear layer (:func:`merge_lora`, and the sharded
    export, :mod:`genolong.train.export`, which computes it from gathered tensors)."""
    return weight.float() + (lora_b.float() @ lora_a.float()) * scaling


def merged_expert_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, expert: int
) -> torch.Tensor:
    """Expert ``expert``'s merged ``weight[e] + scaling * B[e] A[e]`` ``[out, in]`` in float32
    (``weight [E, out, in]``, ``lora_a [E, r, in]``, ``lora_b [E, out, r]``; the product in the
    adapters' dtype, as :meth:`ExpertAdapters.delta`)."""
    return weight[expert].float() + ((lora_b[expert] @ lora_a[expert]) * scaling).float()


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W += scaling * B A``, computed in float32,
    stored in ``W``'s dtype) and remove the adapters, in place: the model is a plain GenoLM again,
    which :meth:`GenoLM.save_pretrained` writes as a GLM-5.3-Flash checkpoint. Returns ``model``."""
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            base = module.base
            base.weight.copy_(
                merged_linear_weight(base.weight, module.lora_A.weight, module.lora_B.weight, module.scaling).to(
                    base.weight.dtype
                )
            )
            _set_child(model, name, base)
        for name, adapters in _expert_adapters(model).items():
            experts = model.get_submodule(name)
            for param_name in _EXPERT_PARAMETERS:
                param = getattr(experts, param_name)
                a, b = _local(adapters.lora_A[param_name].weight), _local(adapters.lora_B[param_name].weight)
                for e in range(param.shape[0]):
                    param[e].copy_(merged_expert_weight(param, a, b, adapters.scaling, e).to(param.dtype))
            del experts.lora
    for attr in ("lora_settings", "lora_saved_modules"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model


def _peft_parameters(model: nn.Module) -> dict[str, tuple[torch.Tensor, str | None]]:
    """Every adapter parameter under its PEFT key name (see the module docstring), with the
    factor (``"lora_A"`` / ``"lora_B"``) of a routed-expert adapter, whose file layout is not its
    own (:func:`_to_peft`), or None."""
    found: dict[str, tuple[torch.Tensor, str | None]] = {}
    for name, module in lora_modules(model).items():
        for part in ("lora_A", "lora_B"):
            found[f"{_PEFT_PREFIX}{peft_name(name)}.{part}.weight"] = (getattr(module, part).weight, None)
    for name, adapters in _expert_adapters(model).items():
        # PEFT nests one ParamWrapper per targeted parameter, the first innermost: gate_up_proj's
        # adapters sit under "experts.base_layer.", down_proj's under "experts."
        for param_name, infix in zip(_EXPERT_PARAMETERS, ("base_layer.", "")):
            for part in ("lora_A", "lora_B"):
                found[f"{_PEFT_PREFIX}{peft_name(name)}.{infix}{part}.weight"] = (
                    getattr(adapters, part)[param_name].weight,
                    part,
                )
    for module_name, module in _saved_modules(model).items():
        for name, p in module.named_parameters():
            found[f"{_PEFT_PREFIX}{peft_name(module_name)}.{name}"] = (p, None)
    return found


def _peft_keys(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's key names, in PEFT's layout (the routed experts' factors
    as copies, :func:`_to_peft`)."""
    return {key: p if part is None else _to_peft(part, p) for key, (p, part) in _peft_parameters(model).items()}


def _adapter_config(model: nn.Module, base_model_name_or_path: str | None) -> dict[str, Any]:
    """``adapter_config.json`` as peft 0.21's ``LoraConfig`` writes it (the keys that matter; peft fills the rest with defaults)."""
    s: LoraSettings = model.lora_settings
    experts = sorted(_expert_adapters(model))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": s.rank,
        "lora_alpha": s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": sorted(peft_name(n) for n in lora_modules(model)) or None,
        "target_parameters": [f"{peft_name(n)}.{p}" for n in experts for p in _EXPERT_PARAMETERS] or None,
        "modules_to_save": sorted(peft_name(n) for n in _saved_modules(model)) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
        "genolong": {
            "targets": list(s.targets),
            "routed_experts": s.routed_experts,
            "modules_to_save": list(s.modules_to_save),
        },
    }


def save_adapter(
    model: nn.Module, directory: str | os.PathLike[str], base_model_name_or_path: str | None = None
) -> Path:
    """Write ``model``'s adapters as a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors`` in float32, and genolong's checksum manifest), built beside
    ``directory`` and renamed into place when complete (an existing adapter there is replaced).

    ``peft.PeftModel.from_pretrained(Glm5NextForConditionalGeneration..., directory)`` then
    computes what ``model`` computes.

    Args:
        model: a GenoLM with adapters (unsharded, e.g. the full copy of an FSDP2 model).
        directory: the output directory.
        base_model_name_or_path: the base checkpoint, recorded for PEFT (default None).

    Raises:
        InputError: ``model`` has no adapters, or ``directory`` exists and is not an adapter directory.
    """
    from ..integrity import write_manifest

    if not has_lora(model):
        raise InputError("save_adapter: the model has no LoRA adapters (model.lora is not set)")
    out = Path(directory)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / ADAPTER_CONFIG).is_file())):
        raise InputError(f"refusing to replace {out}: it exists and is not an adapter directory; choose another path")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in _peft_keys(model).items()}
    config = _adapter_config(model, base_model_name_or_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_sibling(out, "tmp")
    tmp.mkdir()
    try:
        with writing(out, needed=sum(t.nbytes for t in tensors.values()), work=tmp):
            save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            write_manifest(tmp)
            fsync_tree(tmp)
            replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_peft_config(path: Path) -> tuple[LoraSettings, list[str]]:
    """``adapter_config.json`` checked: its settings (PEFT's target strings) and the routed-expert
    modules (transformers names) its ``target_parameters`` adapt."""
    file = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise InputError(f"--adapter {path}: no such directory; give a LoRA adapter directory (e.g. runs/NAME/adapter)")
    if not file.is_file():
        raise InputError(
            f"--adapter {path}: no {ADAPTER_CONFIG} in it; give a PEFT LoRA adapter directory (e.g. runs/NAME/adapter)"
        )
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise InputError(
            f"--adapter {path}: {ADAPTER_CONFIG} is not readable JSON ({error}); re-save the adapter"
        ) from None
    if raw.get("peft_type") != "LORA":
        raise InputError(
            f"--adapter {path}: a {raw.get('peft_type')!r} adapter; genolong reads LoRA adapters (peft_type LORA) only"
        )
    unsupported = [
        key
        for key, off in (
            ("use_dora", False),
            ("use_rslora", False),
            ("fan_in_fan_out", False),
            ("lora_bias", False),
            ("rank_pattern", {}),
            ("alpha_pattern", {}),
        )
        if raw.get(key, off) not in (off, None)
    ]
    if raw.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise InputError(
            f"--adapter {path}: uses {', '.join(unsupported)}, which genolong's LoRA does not compute; "
            "re-train the adapter without them"
        )
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise InputError(
            f"--adapter {path}: target_modules is a regular expression ({targets!r}); genolong reads adapters whose "
            "target_modules list module names (as peft writes when given a list)"
        )
    params = raw.get("target_parameters") or []
    if any(
        p.rsplit(".", 1)[-1] not in _EXPERT_PARAMETERS or not p.rsplit(".", 1)[0].endswith(".mlp.experts")
        for p in params
    ):
        raise InputError(
            f"--adapter {path}: target_parameters {params} are not routed-expert parameters; genolong adapts "
            f"the experts' {' and '.join(_EXPERT_PARAMETERS)} only"
        )
    experts = sorted({p.rsplit(".", 1)[0] for p in params})
    if sorted(params) != sorted(f"{e}.{p}" for e in experts for p in _EXPERT_PARAMETERS):
        raise InputError(
            f"--adapter {path}: target_parameters adapt only one of {' and '.join(_EXPERT_PARAMETERS)} of some MoE "
            "layer; genolong adapts both"
        )
    try:
        rank, alpha, dropout = int(raw["r"]), float(raw["lora_alpha"]), float(raw.get("lora_dropout") or 0.0)
    except (KeyError, TypeError, ValueError):
        raise InputError(f"--adapter {path}: {ADAPTER_CONFIG} lacks r or lora_alpha; re-save the adapter") from None
    return LoraSettings(
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        targets=tuple(targets),
        routed_experts=bool(experts),
        modules_to_save=tuple(raw.get("modules_to_save") or ()),
    ), experts


def read_adapter_config(directory: str | os.PathLike[str]) -> LoraSettings:
    """The :class:`LoraSettings` of a PEFT LoRA adapter directory (written by genolong or by
    peft); ``targets`` and ``modules_to_save`` are PEFT's (transformers module names or name
    suffixes, as peft matches them).

    Raises:
        InputError: no directory, no ``adapter_config.json``, not JSON, not a LoRA adapter, or
            PEFT options genolong does not compute (DoRA, rsLoRA, per-module ranks, biases, ...).
    """
    return _read_peft_config(Path(directory))[0]


def _peft_matches(module_name: str, target: str) -> bool:
    """PEFT's rule for a listed target: the module's (transformers) name, or a suffix of it after a dot."""
    hf = peft_name(module_name)
    return hf == target or hf.endswith("." + target)


def load_adapter(model: nn.Module, directory: str | os.PathLike[str]) -> LoraSettings:
    """Give ``model`` (the base, a GenoLM) the adapters of a PEFT LoRA directory, in place, and
    load their weights; the adapters stay separate (nothing is merged) and frozen, as the base.

    Modules are matched as peft matches them (``target_modules`` entries are full transformers
    names or name suffixes such as ``q_proj``; ``target_parameters`` name routed experts'
    ``gate_up_proj`` / ``down_proj``).

    Returns:
        The adapter's settings, with the matched GenoLM module names as ``targets`` and
        ``modules_to_save``.

    Raises:
        InputError: see :func:`read_adapter_config`; a module the adapter names that this model
            lacks, an adapter tensor of another shape (an adapter for another base), missing or
            unexpected tensors, or a damaged ``adapter_model.safetensors``.
    """
    from ..integrity import check_weights

    path = Path(directory)
    raw, expert_targets = _read_peft_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"--adapter {path}: no {ADAPTER_WEIGHTS} in it; re-save the adapter")
    check_weights(path)
    if has_lora(model):
        raise InputError(f"--adapter {path}: the model already has LoRA adapters; load one adapter onto the base")
    modules = dict(model.named_modules())
    linear_names = [n for n, m in modules.items() if _is_linear(m) and any(_peft_matches(n, t) for t in raw.targets)]
    saved_names = [n for n in modules if n and any(_peft_matches(n, t) for t in raw.modules_to_save)]
    expert_names = [_genolong_name(e) for e in expert_targets]
    for target in raw.targets:
        if not any(_peft_matches(n, target) for n in linear_names):
            shown = _genolong_name(target)
            raise InputError(
                f"--adapter {path}: adapts {shown!r}, which this base model does not have (as a linear layer); "
                "the adapter was trained on another model"
            )
    for name in (
        *expert_names,
        *(_genolong_name(t) for t in raw.modules_to_save if not any(_peft_matches(n, t) for n in saved_names)),
    ):
        if name not in modules or (name in expert_names and not hasattr(modules[name], "gate_up_proj")):
            raise InputError(
                f"--adapter {path}: adapts {name!r}, which this base model does not have; "
                "the adapter was trained on another model"
            )
    settings = LoraSettings(
        rank=raw.rank,
        alpha=raw.alpha,
        dropout=raw.dropout,
        targets=tuple(linear_names),
        routed_experts=bool(expert_names),
        modules_to_save=tuple(saved_names),
    )
    _wrap(model, settings, linear_names, expert_names, saved_names)
    expected = _peft_parameters(model)
    try:
        with safe_open(str(weights), framework="pt") as f:
            keys = set(f.keys())
            absent = sorted(set(expected) - keys)
            extra = sorted(keys - set(expected))
            if absent or extra:
                what = f"lacks {absent[0]}" if absent else f"has {extra[0]}, which its config does not describe"
                raise InputError(f"--adapter {path}: {ADAPTER_WEIGHTS} {what}; re-save the adapter")
            with torch.no_grad():
                for key, (target, part) in expected.items():
                    tensor = f.get_tensor(key)
                    shape = tuple(target.shape) if part is None else tuple(_to_peft(part, target).shape)
                    if tuple(tensor.shape) != shape:
                        raise InputError(
                            f"--adapter {path}: {key} has shape {tuple(tensor.shape)}, this base needs "
                            f"{shape}; the adapter was trained on another model"
                        )
                    target.copy_(
                        (tensor if part is None else _from_peft(part, tensor, target.shape[0])).to(target.dtype)
                    )
    except SafetensorError as error:
        raise InputError(f"--adapter {path}: {ADAPTER_WEIGHTS} is damaged ({error}); re-save the adapter") from None
    for param in model.parameters():
        param.requires_grad_(False)
    return settings


def saved_module_tensors(model: nn.Module, directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The ``modules_to_save`` tensors of an adapter directory, by GenoLM parameter name
    (``norm.weight``; float32 as stored), read from its ``adapter_model.safetensors``; ``model``
    is the base :func:`load_adapter` adapted from ``directory`` (its own tensors are not read: on a
    meta-device model they hold nothing). ``{}`` when the adapter saves no module."""
    saved = _saved_modules(model)
    if not saved:
        return {}
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(Path(directory) / ADAPTER_WEIGHTS), framework="pt") as f:
        for module_name, module in saved.items():
            for name, _ in module.named_parameters():
                out[f"{module_name}.{name}"] = f.get_tensor(f"{_PEFT_PREFIX}{peft_name(module_name)}.{name}")
    return out


def experts_forward_weight(experts: nn.Module, name: str, expert: int) -> torch.Tensor:
    """The weight routed expert ``expert`` computes with for parameter ``name``: the fused
    parameter's slice, plus its adapter's update when the experts carry one (``experts.lora``)."""
    base = getattr(experts, name)
    adapters = getattr(experts, "lora", None)
    if adapters is None:
        return base[expert]
    return adapters.expert_weight(base, name, expert)

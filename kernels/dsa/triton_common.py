"""What genolong's Triton DSA kernels share: the dtypes they load, and the check that they can run
on the tensors they are given."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from ...errors import InputError

__all__ = ["KERNEL_DTYPES", "check_runnable", "dot_dtype"]

#: Dtypes the kernels load directly; anything else (float64) is computed in float32, as the references.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_runnable(kernel: object, module: str, what: str, names: str, *tensors: torch.Tensor) -> None:
    """Triton compiles for a GPU; CPU tensors only run under the interpreter (``TRITON_INTERPRET=1``).

    Args:
        kernel: one of the module's ``@triton.jit`` kernels (an ``InterpretedFunction`` when the
            module was imported in interpreter mode: triton.jit decides at import).
        module: the kernel module's name, for the message (e.g. ``genolong.kernels.dsa.triton_topk``).
        what: the public function's name; names: its tensor arguments, for the messages.
        tensors: the tensor arguments.

    Raises:
        InputError: tensors on several devices, or CPU tensors with compiled kernels.
    """
    devices = {x.device for x in tensors}
    if len(devices) != 1:
        raise InputError(f"{names} must be on one device, got {sorted(str(d) for d in devices)}")
    if next(iter(devices)).type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise InputError(
            f"{what} got CPU tensors; run on a GPU, or set TRITON_INTERPRET=1 before "
            f"{module} is first imported (slow, for tests), or use kernel_backend 'torch'"
        )


def dot_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The one dtype the kernels' dot operands are cast to, for the given tensor inputs.

    - all of one kernel dtype (fp16, bf16 or fp32): that dtype;
    - 16-bit and fp32 mixed (bf16 queries with an fp32 latent, pooled keys or LayerNorm output, as
      ``bf16-mixed`` autocast with fp32 master weights hands them over): the 16-bit one, so that
      the dots run on tensor cores; the fp32 side, the smaller tensor in every call genolong makes,
      is rounded to it, as autocast's own matmul would round it;
    - anything else (float64, or fp16 with bf16): float32.
    """
    dtypes = {x.dtype for x in tensors}
    if len(dtypes) == 1 and next(iter(dtypes)) in KERNEL_DTYPES:
        return next(iter(dtypes))
    half = dtypes - {torch.float32}
    if len(half) == 1 and next(iter(half)) in (torch.float16, torch.bfloat16):
        return next(iter(half))
    return torch.float32

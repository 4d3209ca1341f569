"""What genolong's Triton DSA kernels share: the dtypes they load, and the check that they can run
on the tensors they are given."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from ...errors import InputError

__all__ = ["KERNEL_DTYPES", "check_runnable"]

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

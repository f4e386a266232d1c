"""Imports Triton for the kernels, turning on its CPU interpreter on machines without CUDA.

Triton decides at decoration time (`@triton.jit`) whether a kernel is compiled for the GPU or run by
its interpreter, from the TRITON_INTERPRET environment variable. So on a machine without CUDA this
module sets TRITON_INTERPRET=1 (unless the user set it) before the kernel modules decorate
anything; importing triton earlier elsewhere does not matter. To run the kernels in the
interpreter on a CUDA machine, export TRITON_INTERPRET=1 before the first import of
pagedspec.kernels.triton_attention / pagedspec.kernels.triton_kv_write.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["check_device", "interpreted", "tl", "triton"]


def interpreted(kernel: object) -> bool:
    """True when `kernel` runs in Triton's interpreter rather than compiled for the GPU."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def check_device(kernel: object, device: torch.device) -> None:
    """Raises ValueError when `kernel` was compiled for CUDA but the tensors are elsewhere."""
    if not interpreted(kernel) and device.type != "cuda":
        raise ValueError(
            f"backend 'triton' got tensors on {device} but its kernels were compiled for CUDA; "
            f"set TRITON_INTERPRET=1 before importing kernels.triton_* to run them on the CPU"
        )

"""The C++ CPU kernels (kernels/csrc): paged attention and the KV-cache write, the packed GEMM of
Linear (with SwiGLU fused in), and fused decoder-layer ops.

Compiled with torch.utils.cpp_extension (g++ and ninja) into torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) the first time a process needs them, about
a minute once per machine (``make setup`` does it); later processes load the cached build, and
an edited source is rebuilt. The build targets the SIMD level torch itself dispatches to on this
CPU (ATen's Vectorized<float>: AVX512 or AVX2). Its OpenMP regions run in torch's own OpenMP
runtime where the dynamic loader shares it (torch's Linux wheels bundle libgomp.so.1 under the
system soname), so torch.set_num_threads applies to the kernels too.
"""

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("bindings.cpp", "cpu_paged_attention.cpp", "cpu_layer_ops.cpp", "cpu_linear.cpp")
# torch.backends.cpu.get_cpu_capability() -> the flags that select ATen's matching Vectorized.
_SIMD_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def load() -> ModuleType:
    """The compiled extension (built on first call; raises if it cannot be built)."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    simd = capability if capability in _SIMD_FLAGS else "DEFAULT"
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={simd}", f"-DCPU_CAPABILITY_{simd}"]
    return cpp_extension.load(
        name=f"pagedspec_cpu_{simd.lower()}",
        sources=[str(_CSRC / name) for name in _SOURCES],
        extra_cflags=flags + _SIMD_FLAGS.get(simd, []),
        extra_ldflags=["-fopenmp"],
    )


@functools.cache
def available() -> bool:
    """Whether the extension is built or can be built here; warns once when it cannot."""
    try:
        load()
    except Exception as error:  # a missing compiler or ninja surfaces as many exception types
        logger.warning("C++ CPU kernels unavailable, falling back to PyTorch ops: %s", error)
        return False
    return True

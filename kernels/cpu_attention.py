"""The "cpu" backend: kernels/csrc/cpu_paged_attention.cpp, built on first use.

The extension is compiled with torch.utils.cpp_extension (g++ and ninja) into torch's extension
cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) the first time a process needs it,
~1 minute once per machine; later processes load the cached build. It is built for the SIMD level
torch itself dispatches to on this CPU (ATen's Vectorized<float>, AVX512 or AVX2) and uses torch's
OpenMP thread pool, so torch.set_num_threads applies to it.

"auto" picks this backend for CPU tensors when ``available()``; where it cannot be built (no
compiler), "auto" falls back to the torch backend with one warning.
"""

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from kernels.checks import check_paged_attention_args

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_paged_attention.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch.backends.cpu.get_cpu_capability() -> the flags that select ATen's matching Vectorized.
_SIMD_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def load() -> ModuleType:
    """The compiled extension (builds it on first call; raises if it cannot be built)."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    simd = capability if capability in _SIMD_FLAGS else "DEFAULT"
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={simd}", f"-DCPU_CAPABILITY_{simd}"]
    return cpp_extension.load(
        name=f"pagedspec_cpu_attention_{simd.lower()}",
        sources=[str(_SOURCE)],
        extra_cflags=flags + _SIMD_FLAGS.get(simd, []),
        extra_ldflags=["-fopenmp"],
    )


@functools.cache
def available() -> bool:
    """Whether the extension is built or can be built here; warns once when it cannot."""
    try:
        load()
    except Exception as error:  # a missing compiler or ninja surfaces as many exception types
        logger.warning("CPU attention kernel unavailable, using the torch backend: %s", error)
        return False
    return True


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels.paged_attention on CPU tensors of a dtype in DTYPES; same contract."""
    check_paged_attention_args(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out
    )
    if query.device.type != "cpu" or query.dtype not in DTYPES:
        raise ValueError(
            f"backend 'cpu' needs CPU tensors of dtype {DTYPES}, got {query.dtype} on "
            f"{query.device}"
        )
    if out is None:
        out = torch.empty_like(query)
    load().paged_attention(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out
    )
    return out

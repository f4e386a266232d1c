"""The "cpu" backend: paged attention by the C++ kernel in kernels/csrc/cpu_paged_attention.cpp.

"auto" picks it for CPU tensors of a dtype in DTYPES when ``kernels.cpu_extension.available()``;
where the extension cannot be built (no compiler), "auto" falls back to the torch backend.
"""

import torch

from kernels import cpu_extension
from kernels.checks import check_paged_attention_args

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    cpu_extension.load().paged_attention(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out
    )
    return out

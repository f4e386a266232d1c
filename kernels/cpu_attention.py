"""The "cpu" backend: paged attention and the KV-cache write by the C++ kernels in
kernels/csrc/cpu_paged_attention.cpp.

"auto" picks it for CPU tensors of a dtype in DTYPES when ``kernels.cpu_extension.available()``;
where the extension cannot be built (no compiler), "auto" falls back to the torch backend.
"""

import torch

from kernels import cpu_extension
from kernels.checks import check_paged_attention_args

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        raise ValueError(
            f"backend 'cpu' needs CPU tensors of dtype {DTYPES}, got {t.dtype} on {t.device}"
        )


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
    _check_device(query)
    if out is None:
        out = torch.empty_like(query)
    cpu_extension.load().paged_attention(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out
    )
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kernels.write_kv_cache on CPU tensors of a dtype in DTYPES; same contract. One C++ call
    checks shapes, dtypes and every slot before writing (where the torch backend's index_copy
    costs more per layer than the copy itself at decode)."""
    for t in (key, value, k_cache, v_cache, slot_mapping):
        if t.device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs CPU tensors, got a tensor on {t.device}")
    _check_device(k_cache)
    cpu_extension.load().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

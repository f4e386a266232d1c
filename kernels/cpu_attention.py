"""The "cpu" backend: paged attention and the KV-cache write by the C++ kernels in
kernels/csrc/cpu_paged_attention.cpp.

"auto" picks it for CPU tensors of a dtype in DTYPES when
``pagedspec.kernels.cpu_extension.available()``; where the extension cannot be built (no compiler),
"auto" falls back to the torch backend.
"""

from dataclasses import dataclass

import torch

from pagedspec.kernels import cpu_extension
from pagedspec.kernels.checks import check_paged_attention_args

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        raise ValueError(
            f"backend 'cpu' needs CPU tensors of dtype {DTYPES}, got {t.dtype} on {t.device}"
        )


@dataclass(frozen=True)
class AttentionPlan:
    """A step's span metadata as every layer's kernel call reads it: checked once, and int64
    and contiguous (the kernel's index type), so no layer re-checks or converts it. The kernel
    checks each call's query, caches, out and scale itself; the Python checks of the unplanned
    path cost 2x the kernel at a batch-1 decode (30 calls a step for SmolLM2)."""

    block_tables: torch.Tensor
    cu_query_lens: torch.Tensor
    seq_lens: torch.Tensor
    tree_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class WritePlan:
    """A step's slot_mapping, int64 and contiguous; the kernel checks shapes and slots."""

    slot_mapping: torch.Tensor


def plan_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
) -> AttentionPlan:
    """The plan for every layer's call on this step's spans (caches shaped like ``k_cache``)."""
    check_paged_attention_args(
        query, k_cache, k_cache, block_tables, cu_query_lens, seq_lens, 1.0, None, tree_mask
    )
    _check_device(query)
    tables = (t.long().contiguous() for t in (block_tables, cu_query_lens, seq_lens))
    return AttentionPlan(*tables, None if tree_mask is None else tree_mask.contiguous())


def plan_write_kv_cache(slot_mapping: torch.Tensor) -> WritePlan:
    if slot_mapping.device.type != "cpu":
        raise ValueError(f"backend 'cpu' needs CPU tensors, got a tensor on {slot_mapping.device}")
    return WritePlan(slot_mapping.long().contiguous())


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels.paged_attention on CPU tensors of a dtype in DTYPES; same contract. With a
    ``plan`` (from plan_paged_attention on the same metadata) the metadata are the plan's."""
    if plan is None:
        check_paged_attention_args(
            query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out, tree_mask
        )
        _check_device(query)
        mask = None if tree_mask is None else tree_mask.contiguous()
        plan = AttentionPlan(block_tables, cu_query_lens, seq_lens, mask)
    if out is None:
        out = torch.empty_like(query)
    cpu_extension.load().paged_attention(
        query, k_cache, v_cache, plan.block_tables, plan.cu_query_lens, plan.seq_lens, scale, out,
        plan.tree_mask,
    )  # fmt: skip
    return out


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: WritePlan | None = None,
) -> None:
    """kernels.write_kv_cache on CPU tensors of a dtype in DTYPES; same contract. One C++ call
    checks devices, shapes, dtypes and every slot before writing (where the torch backend's
    index_copy costs more per layer than the copy itself at decode). With a ``plan`` (from
    plan_write_kv_cache on the same slot_mapping) the slots are the plan's."""
    if plan is None:
        _check_device(k_cache)
    cpu_extension.load().write_kv_cache(
        key, value, k_cache, v_cache, slot_mapping if plan is None else plan.slot_mapping
    )

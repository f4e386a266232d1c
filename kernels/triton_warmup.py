"""Compiles every Triton kernel variant the engine can launch, once, when the engine starts.

A variant is one set of compile-time constants (and specialisation key): Triton compiles it the
first time it is launched, 1-3 s each, which mid-serving would stall every request. The
attention kernel's variants for one model (dtype, heads, head dim, block size fixed) are its
BLOCK_M tiles times single pass / split-KV, plus the merge kernel per power-of-two split count;
the KV write has one. Run-time sizes (token and sequence counts, splits, the block-table width)
are not specialised on (see pagedspec.kernels.triton_attention), so nothing else can appear.

Off CUDA this compiles nothing: the interpreter has no compile step.
"""

from dataclasses import dataclass

import torch

from pagedspec.kernels import triton_attention
from pagedspec.kernels.triton_attention import LaunchPlan, block_m_for, max_auto_splits, max_block_m
from pagedspec.kernels.triton_kv_write import write_kv_cache
from pagedspec.kernels.triton_setup import interpreted, triton

# Rows per tile BLOCK_M takes min(64, next_power_of_2(rows)) of; 2**6 = 64 is the largest.
_ROW_POWERS = range(7)


@dataclass(frozen=True)
class Variant:
    """One attention launch: BLOCK_M and a split count (1: single pass; > 1: the split-KV kernel
    and the merge kernel compiled for SPLITS_P2 = num_splits, a power of two)."""

    block_m: int
    num_splits: int


def attention_variants(group: int, max_context: int, block_m_limit: int = 64) -> list[Variant]:
    """Every variant plan_launch can choose on a GPU for GQA group `group`, contexts of up to
    `max_context` tokens and its block_m_limit: each BLOCK_M single-pass and split, and every
    merge width."""
    block_ms = sorted({block_m_for(2**p, group, block_m_limit) for p in _ROW_POWERS})
    variants = [Variant(m, 1) for m in block_ms]
    splits = max_auto_splits(max_context)
    if splits > 1:
        variants += [Variant(m, 2) for m in block_ms]
        # Merges for next_power_of_2(n), n in 3..splits, up to 2**top; the split attention
        # kernel is shared.
        top = (splits - 1).bit_length()
        widths = [2**p for p in range(2, top + 1)]
        variants += [Variant(block_ms[0], w) for w in widths]
    return variants


def warmup(
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    max_context: int,
    attention: bool = True,
    query_dtype: torch.dtype | None = None,
    trees: bool = False,
) -> list[Variant]:
    """Launches each variant once on a one-token problem over `k_cache` / `v_cache` (the
    engine's caches: same dtype, strides and alignment) with queries, keys and values of
    `query_dtype` (None: the caches'); returns the attention variants launched (none with
    ``attention=False``: the KV write alone, for the xformers backend).

    The query, key and value are views laid out as pagedspec.engine.models.llama makes them (q and k
    split from one rotary output, v split from the qkv projection), so the pointers and strides
    have the divisibility the real launches have: Triton specialises on nothing else here. The
    KV write is compiled with slot -1, which writes nothing; attention reads block 0 and its
    output is thrown away. ``trees``: each attention variant is compiled with a tree mask too
    (the TREE variants draft-tree verification launches).
    """
    if k_cache.device.type != "cuda" or interpreted(triton_attention._attention_kernel):
        return []  # TRITON_INTERPRET=1 on a GPU machine: nothing is compiled
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device, dtype = k_cache.device, query_dtype or k_cache.dtype
    qk = torch.zeros(1, num_heads + num_kv_heads, head_dim, dtype=dtype, device=device)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    qkv = torch.zeros(1, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)[1]
    v = v.view(1, num_kv_heads, head_dim)
    int32 = dict(dtype=torch.int32, device=device)
    write_kv_cache(k, v, k_cache, v_cache, torch.full((1,), -1, dtype=torch.int64, device=device))
    block_tables = torch.zeros(1, 1, **int32)
    cu_query_lens = torch.tensor([0, 1], **int32)
    seq_lens = torch.ones(1, **int32)
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    limit = max_block_m(dtype, max(16, triton.next_power_of_2(head_dim)))
    variants = attention_variants(group, max_context, limit) if attention else []
    masks = [None, torch.full((1,), -1, dtype=torch.int64, device=device)][: 1 + trees]
    for variant in variants:
        block_q = variant.block_m // group
        plan = LaunchPlan(variant.block_m, block_q, 1 // block_q + 1, variant.num_splits)
        for tree_mask in masks:
            triton_attention.launch(
                q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, 1.0, out, plan,
                tree_mask,
            )  # fmt: skip
    torch.cuda.synchronize(device)
    return variants

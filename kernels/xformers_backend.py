"""Paged attention through xFormers (CUDA only): a peer backend to compare the Triton kernel with.

xFormers has no CPU kernels, so this module is imported only when backend="xformers" is asked for
with CUDA tensors (see pagedspec.kernels.__init__). Our span semantics are exactly xFormers'
PagedBlockDiagonalCausalWithOffsetPaddedKeysMask: block-diagonal over sequences, causal from the
bottom right (query j of a span of q_len over seq_len keys sees keys 0..seq_len - q_len + j).
Its bias is built from host lists, so every call syncs once to read the span lengths.
"""

import torch
from xformers.ops import fmha
from xformers.ops.fmha.attn_bias import PagedBlockDiagonalCausalWithOffsetPaddedKeysMask

from pagedspec.kernels.checks import check_paged_attention_args


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
    """Same contract as kernels.paged_attention; xFormers picks its own fastest operator."""
    check_paged_attention_args(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out
    )
    if query.dtype != k_cache.dtype:
        raise ValueError(
            f"backend 'xformers' needs the cache dtype to equal the query's, got "
            f"{k_cache.dtype} under {query.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("backend 'xformers' needs contiguous k_cache and v_cache")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    cu = cu_query_lens.tolist()
    bias = PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=[b - a for a, b in zip(cu[:-1], cu[1:], strict=True)],
        kv_seqlen=seq_lens.tolist(),
        block_tables=block_tables.to(torch.int32),
        page_size=block_size,
        device=query.device,
    )
    # xFormers' GQA layout: [batch=1, tokens, kv heads, group, head_dim], K/V broadcast over group.
    kv_shape = (1, num_blocks * block_size, num_kv_heads, group, head_dim)
    o = fmha.memory_efficient_attention_forward(
        query.reshape(1, num_tokens, num_kv_heads, group, head_dim),
        k_cache.view(1, num_blocks * block_size, num_kv_heads, 1, head_dim).expand(kv_shape),
        v_cache.view(1, num_blocks * block_size, num_kv_heads, 1, head_dim).expand(kv_shape),
        attn_bias=bias,
        scale=scale,
    )
    out.copy_(o.view(num_tokens, num_heads, head_dim))
    return out

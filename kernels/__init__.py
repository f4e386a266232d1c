"""Paged attention and KV-cache write behind one dispatch.

Backends: "torch" (pagedspec.kernels.reference, plain PyTorch: the oracle and the portable CPU
path), "cpu" (pagedspec.kernels.cpu_attention: C++ kernels built on first use), "triton"
(kernels.triton_*; on CPU tensors it runs in Triton's interpreter, see
pagedspec.kernels.triton_attention), "xformers" (CUDA only; its paged attention for attention, the
Triton scatter for the cache write). "auto" picks "triton" for CUDA tensors, "cpu" for CPU tensors
of float32/bfloat16/float16 where the extension builds, and "torch" otherwise. Triton and xformers
modules are imported only when first used, so a CPU process never imports xformers.
"""

from typing import Literal

import torch

from pagedspec.kernels import cpu_attention, cpu_extension, reference
from pagedspec.kernels.checks import check_paged_attention_args

Backend = Literal["auto", "torch", "cpu", "triton", "xformers"]
_BACKENDS = ("auto", "torch", "cpu", "triton", "xformers")

__all__ = [
    "Backend",
    "paged_attention",
    "plan_paged_attention",
    "plan_write_kv_cache",
    "warmup",
    "write_kv_cache",
]


def _resolve(backend: str, like: torch.Tensor) -> str:
    """The backend that runs for tensors like ``like`` (device and dtype)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if like.device.type == "cuda":
            return "triton"
        usable = like.device.type == "cpu" and like.dtype in cpu_attention.DTYPES
        return "cpu" if usable and cpu_extension.available() else "torch"
    if backend == "xformers" and like.device.type != "cuda":
        raise ValueError(f"backend 'xformers' needs CUDA tensors, got tensors on {like.device}")
    return backend


def plan_write_kv_cache(
    slot_mapping: torch.Tensor, k_cache: torch.Tensor, backend: Backend = "auto"
) -> reference.KVWritePlan | cpu_attention.WritePlan | None:
    """Per-step work that every layer's write_kv_cache call would repeat (the torch backend's
    slot validation, the cpu backend's index conversion); None for backends that need none.
    Pass the result as ``plan=``: it also fixes the backend."""
    chosen = _resolve(backend, k_cache)
    if chosen == "cpu":
        return cpu_attention.plan_write_kv_cache(slot_mapping)
    if chosen != "torch":
        return None
    return reference.plan_write_kv_cache(slot_mapping, k_cache)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: Backend = "auto",
    plan: reference.KVWritePlan | cpu_attention.WritePlan | None = None,
) -> None:
    """Write key/value [T, Hkv, D] into caches [N, B, Hkv, D] at slot = block * B + offset.

    In place; slot -1 skips the token. slot_mapping is int64 or int32.
    """
    if isinstance(plan, cpu_attention.WritePlan):
        cpu_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, plan)
        return
    chosen = _resolve(backend, key)
    if chosen == "torch":
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, plan=plan)
        return
    if chosen == "cpu":
        cpu_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    from pagedspec.kernels.triton_kv_write import write_kv_cache as triton_write

    triton_write(key, value, k_cache, v_cache, slot_mapping)


def plan_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    backend: Backend = "auto",
    tree_mask: torch.Tensor | None = None,
) -> reference.AttentionPlan | cpu_attention.AttentionPlan | None:
    """Per-step work that every layer's paged_attention call would repeat (the torch backend's
    gather plan, the cpu backend's checks and index conversion); None for backends that need
    none. Pass the result as ``plan=``: it also fixes the backend and holds ``tree_mask``."""
    chosen = _resolve(backend, query)
    if chosen == "cpu":
        return cpu_attention.plan_paged_attention(
            query, k_cache, block_tables, cu_query_lens, seq_lens, tree_mask
        )
    if chosen != "torch":
        return None
    check_paged_attention_args(
        query, k_cache, k_cache, block_tables, cu_query_lens, seq_lens, 1.0, None, tree_mask
    )
    return reference.plan_paged_attention(
        query, k_cache, block_tables, cu_query_lens, seq_lens, tree_mask
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
    backend: Backend = "auto",
    plan: reference.AttentionPlan | cpu_attention.AttentionPlan | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query spans [T, Hq, D] over paged K/V; returns out [T, Hq, D].

    Span i is query[cu_query_lens[i]:cu_query_lens[i+1]], the last q_len_i tokens of a context of
    seq_lens[i] tokens already in the cache; its token j sits at seq_lens[i] - q_len_i + j and
    attends to positions 0..that position. block_tables [S, M] rows may be padded with any valid
    block id past ceil(seq_lens[i] / block_size) entries.

    ``tree_mask`` (int64 [T], None: causal) makes spans token trees (speculative decoding's draft
    trees): where bit j of a token's entry is clear, that token does not see token j of its own
    span (j < 64; tokens before the span and from its 64th on are seen as causality allows). A
    token must see the span's first token and itself. With a ``plan`` the plan's mask applies.
    The xformers backend has no tree masks.
    """
    args = (query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out)
    if isinstance(plan, cpu_attention.AttentionPlan):
        return cpu_attention.paged_attention(*args, plan=plan)
    chosen = _resolve(backend, query)
    if chosen == "torch":
        return reference.paged_attention(*args, plan=plan, tree_mask=tree_mask)
    if chosen == "cpu":
        return cpu_attention.paged_attention(*args, tree_mask=tree_mask)
    if chosen == "triton":
        from pagedspec.kernels.triton_attention import paged_attention as triton_attention

        return triton_attention(*args, tree_mask=tree_mask)
    if tree_mask is not None:
        raise ValueError("backend 'xformers' has no tree masks: use 'triton' for draft trees")
    from pagedspec.kernels.xformers_backend import paged_attention as xformers_attention

    return xformers_attention(*args)


def warmup(
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    max_context: int,
    backend: Backend = "auto",
    query_dtype: torch.dtype | None = None,
    trees: bool = False,
) -> int:
    """Compiles every Triton kernel variant the backend can launch on these caches (one layer's;
    all layers share the variants) for queries, keys and values of ``query_dtype`` (None: the
    caches' dtype), so no step waits for a compile; returns how many attention variants were
    compiled. ``trees``: their tree-mask variants too (draft trees). Nothing to do off CUDA or
    for the torch and cpu backends."""
    if k_cache.device.type != "cuda":
        return 0
    chosen = _resolve(backend, k_cache)
    if chosen not in ("triton", "xformers"):
        return 0
    from pagedspec.kernels.triton_warmup import warmup as triton_warmup

    variants = triton_warmup(
        num_heads, k_cache, v_cache, max_context, chosen == "triton", query_dtype or k_cache.dtype,
        trees and chosen == "triton",
    )  # fmt: skip
    return len(variants)

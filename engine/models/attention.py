"""Paged attention as model layers see it: write this step's K/V, then attend over every span."""

from dataclasses import dataclass

import torch
from torch import nn

from pagedspec import kernels


@dataclass
class AttentionMetadata:
    """One packed step, built by the ModelRunner and shared by every layer.

    Span ``i`` holds the last ``cu_query_lens[i+1] - cu_query_lens[i]`` tokens of a context of
    ``seq_lens[i]`` tokens; ``block_tables[i]`` addresses that context's KV blocks.
    """

    slot_mapping: torch.Tensor  # int64 [T]: where each new token's K/V goes (-1 = skip)
    cu_query_lens: torch.Tensor  # int32 [S+1]
    seq_lens: torch.Tensor  # int32 [S]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [S, M]
    backend: str = "torch"  # attention backend passed to kernels
    # int64 [T] or None (every span causal): kernels.paged_attention's tree_mask (draft trees)
    tree_mask: torch.Tensor | None = None
    # The backend's per-step plans (attention, KV write), built by the first layer and reused
    # by the others.
    plan: object | None = None
    write_plan: object | None = None
    planned: bool = False


def plan_step(meta: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Build the step's plans into ``meta`` for queries shaped like ``query`` (only its shape,
    dtype and device are read) on caches shaped like ``k_cache``."""
    meta.write_plan = kernels.plan_write_kv_cache(meta.slot_mapping, k_cache, meta.backend)
    meta.plan = kernels.plan_paged_attention(
        query, k_cache, meta.block_tables, meta.cu_query_lens, meta.seq_lens, meta.backend,
        meta.tree_mask,
    )  # fmt: skip
    meta.planned = True


class PagedAttention(nn.Module):
    """Stores new K/V in the paged cache, then runs causal GQA attention over all spans at once."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], caches [N, B, Hkv, D] -> attention output [T, Hq, D]."""
        k_cache, v_cache = kv_cache
        if not meta.planned:
            plan_step(meta, q, k_cache)
        kernels.write_kv_cache(
            k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend, plan=meta.write_plan
        )
        return kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_query_lens,
            meta.seq_lens,
            self.scale,
            backend=meta.backend,
            plan=meta.plan,
            tree_mask=meta.tree_mask,
        )

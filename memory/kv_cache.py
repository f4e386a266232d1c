"""KV cache sizing: how many blocks fit, and what one block costs."""

from __future__ import annotations

import torch


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def kv_block_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of ONE block across all layers, K and V together."""
    _check_positive(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
    )
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_kv_blocks(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
) -> int:
    """Number of KV blocks: `num_blocks` as given, or as many as fit in `memory_bytes`.

    Exactly one of the two must be set; the result must be at least 1.
    """
    per_block = kv_block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype)
    if (num_blocks is None) == (memory_bytes is None):
        raise ValueError("set exactly one of num_blocks and memory_bytes")
    if num_blocks is not None:
        _check_positive(num_blocks=num_blocks)
        return num_blocks
    if not isinstance(memory_bytes, int) or memory_bytes < per_block:
        raise ValueError(
            f"memory_bytes must be an int >= one block ({per_block} bytes), got {memory_bytes!r}"
        )
    return memory_bytes // per_block


def allocate_kv_caches(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, [num_blocks, block_size, num_kv_heads, head_dim] each.

    Allocated once and never reallocated; left uninitialised, since every slot is written
    before it is read.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]

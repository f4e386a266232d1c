"""Argument checks shared by every backend.

Only shapes, dtypes and devices are checked here: these need no host sync, so the CUDA path stays
asynchronous. Checks that read tensor values (span lengths, slot ranges) live in the reference
backend, which syncs anyway.
"""

from collections.abc import Callable

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A cache narrower than the model's activations: float32 keys, values and queries over a 16-bit
# cache (kv_cache_dtype). Any other pairing must match exactly.
_NARROW_CACHE_DTYPES = (torch.float16, torch.bfloat16)


def cache_holds(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a cache of ``cache_dtype`` may store (and be read against) ``dtype`` tensors:
    the same dtype, or float32 over a 16-bit cache (values rounded to nearest on write)."""
    return dtype == cache_dtype or (dtype == torch.float32 and cache_dtype in _NARROW_CACHE_DTYPES)


def _need(ok: bool, message: Callable[[], str]) -> None:
    """Raise ValueError(message()) unless ok. The message is built only on failure: these checks
    run once per layer per step, and formatting ~20 messages cost more than the decode-step
    attention kernel they guard."""
    if not ok:
        raise ValueError(message())


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _need(
        k_cache.dim() == 4,
        lambda: (
            f"k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        ),
    )
    _need(
        v_cache.shape == k_cache.shape,
        lambda: (
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        ),
    )
    _need(
        k_cache.dtype in _FLOAT_DTYPES and v_cache.dtype == k_cache.dtype,
        lambda: (
            f"k_cache/v_cache dtype must be one of {_FLOAT_DTYPES} and equal, "
            f"got {k_cache.dtype} and {v_cache.dtype}"
        ),
    )
    _need(k_cache.shape[1] >= 1, lambda: f"block_size must be >= 1, got {k_cache.shape[1]}")
    _need(
        k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
        lambda: "k_cache/v_cache head_dim must be contiguous (stride 1)",
    )


def _check_index(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    _need(t.dim() == dim, lambda: f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    _need(t.dtype in _INDEX_DTYPES, lambda: f"{name} dtype must be int32 or int64, got {t.dtype}")
    _need(t.device == device, lambda n=name, t=t: f"{n} is on {t.device}, expected {device}")


def check_write_kv_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_cache_pair(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _need(
        key.dim() == 3 and tuple(key.shape[1:]) == (num_kv_heads, head_dim),
        lambda: (
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
            f"got shape {tuple(key.shape)}"
        ),
    )
    _need(
        value.shape == key.shape,
        lambda: f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}",
    )
    _need(
        value.dtype == key.dtype and cache_holds(key.dtype, k_cache.dtype),
        lambda: (
            f"key/value dtype must equal the cache dtype {k_cache.dtype} (or be float32 over a "
            f"float16/bfloat16 cache), got {key.dtype} and {value.dtype}"
        ),
    )
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        _need(
            t.device == key.device,
            lambda n=name, t=t: f"{n} is on {t.device}, expected {key.device}",
        )
    _check_index("slot_mapping", slot_mapping, 1, key.device)
    _need(
        slot_mapping.shape[0] == key.shape[0],
        lambda: (
            f"slot_mapping length must equal num_tokens {key.shape[0]}, got {slot_mapping.shape[0]}"
        ),
    )


def check_paged_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    tree_mask: torch.Tensor | None = None,
) -> None:
    _check_cache_pair(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _need(
        query.dim() == 3 and query.shape[2] == head_dim,
        lambda: (
            f"query must be [num_tokens, num_heads, {head_dim}], got shape {tuple(query.shape)}"
        ),
    )
    _need(
        query.shape[1] >= num_kv_heads and query.shape[1] % num_kv_heads == 0,
        lambda: (
            f"query num_heads must be a positive multiple of num_kv_heads={num_kv_heads}, "
            f"got {query.shape[1]}"
        ),
    )
    _need(
        cache_holds(query.dtype, k_cache.dtype),
        lambda: (
            f"query dtype {query.dtype} must equal the cache dtype {k_cache.dtype} "
            f"(or be float32 over a float16/bfloat16 cache)"
        ),
    )
    _need(query.stride(-1) == 1, lambda: "query head_dim must be contiguous (stride 1)")
    device = query.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need(t.device == device, lambda n=name, t=t: f"{n} is on {t.device}, expected {device}")
    _check_index("block_tables", block_tables, 2, device)
    _check_index("cu_query_lens", cu_query_lens, 1, device)
    _check_index("seq_lens", seq_lens, 1, device)
    num_seqs = seq_lens.shape[0]
    _need(
        cu_query_lens.shape[0] == num_seqs + 1,
        lambda: (
            f"cu_query_lens length must be len(seq_lens) + 1 = {num_seqs + 1}, "
            f"got {cu_query_lens.shape[0]}"
        ),
    )
    _need(
        block_tables.shape[0] == num_seqs,
        lambda: (
            f"block_tables must have len(seq_lens) = {num_seqs} rows, got {block_tables.shape[0]}"
        ),
    )
    _need(scale > 0.0, lambda: f"scale must be > 0, got {scale}")
    if out is not None:
        _need(
            out.shape == query.shape and out.dtype == query.dtype and out.device == device,
            lambda: (
                f"out must match query (shape {tuple(query.shape)}, {query.dtype}, {device}), "
                f"got shape {tuple(out.shape)}, {out.dtype}, {out.device}"
            ),
        )
        _need(out.stride(-1) == 1, lambda: "out head_dim must be contiguous (stride 1)")
    if tree_mask is not None:
        _need(
            tree_mask.dtype == torch.int64
            and tuple(tree_mask.shape) == (query.shape[0],)
            and tree_mask.device == device,
            lambda: (
                f"tree_mask must be int64 [num_tokens={query.shape[0]}] on {device}, "
                f"got {tree_mask.dtype} {tuple(tree_mask.shape)} on {tree_mask.device}"
            ),
        )

"""Plain-PyTorch paged attention and KV-cache write: the oracle for the kernels, and the CPU path
where the C++ kernels (pagedspec.kernels.cpu_attention) cannot be built or the dtype is not theirs.

Attention is vectorised over sequences. Sequences are sorted by context length and cut into
chunks whose gathered K/V fit a few MiB; for each chunk the K/V blocks are gathered into a padded
[c, L, Hkv, D] batch (one index_select per tensor), the query spans are padded and packed as
[c, Hkv, max_q * G, D] (the G = Hq / Hkv query heads of a KV head become extra query rows, so K/V
are never repeated), and one masked SDPA call does the attention. Chunking keeps each gather in
the CPU caches and under glibc's mmap threshold (a fresh 50 MB tensor per call costs more in page
faults than the copy itself), and sorting keeps the padding of each chunk small.

Measured on the 2-core dev CPU (python -m benchmarks.kernels without CUDA): decode (span 1) at
batch 64, contexts uniform in 100..1000, 9 query / 3 KV heads, head dim 64, fp32 (54 MB of K/V):
8-12 ms per call with 2 threads on a quiet machine, 12-19 ms on one thread; about 60% of it is
the gather, the rest SDPA. Chunks of 4 MiB beat 1-2 MiB (more per-chunk overhead) and 8+ MiB
(page faults, cache misses) in that measurement.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedspec.kernels.checks import check_paged_attention_args, check_write_kv_cache_args
from pagedspec.kernels.tree_mask import MAX_TREE_TOKENS


@dataclass(frozen=True)
class KVWritePlan:
    """A step's slot_mapping, validated once and turned into the indices every layer's
    write_kv_cache reuses (all layers write the same slots): no per-layer host syncs."""

    slots: torch.Tensor  # int64 slots to write, -1 entries dropped
    keep: torch.Tensor | None  # bool [T]: the tokens written; None when every token is
    num_tokens: int


def plan_write_kv_cache(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> KVWritePlan:
    """Validate slot_mapping's values against caches shaped like ``k_cache`` (one host sync)."""
    num_blocks, block_size = k_cache.shape[:2]
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return KVWritePlan(slots, None, 0)
    lowest, highest = torch.stack(torch.aminmax(slots)).tolist()
    if lowest < -1 or highest >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping values must be -1 or in [0, {num_blocks * block_size}) "
            f"(num_blocks * block_size)"
        )
    if lowest >= 0:
        return KVWritePlan(slots, None, slots.numel())
    keep = slots >= 0  # -1: padding tokens, skipped
    return KVWritePlan(slots[keep], keep, slots.numel())


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: KVWritePlan | None = None,
) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot = block * B + offset; -1 skips.

    In place. Slots other than -1 must be distinct (duplicate slots leave an unspecified winner).
    ``plan``: from ``plan_write_kv_cache`` on the same slot_mapping (built here when None).
    """
    if plan is None:
        check_write_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)
        plan = plan_write_kv_cache(slot_mapping, k_cache)
    elif key.shape[0] != plan.num_tokens:
        raise ValueError(f"plan is for {plan.num_tokens} tokens, key has {key.shape[0]}")
    if plan.keep is not None:
        key, value = key[plan.keep], value[plan.keep]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for cache, new in ((k_cache, key), (v_cache, value)):
        new = new.to(cache.dtype)  # a 16-bit cache under float32 keys: rounded to nearest
        if cache.stride(0) == block_size * cache.stride(1):  # [N, B] collapse into one slot dim
            flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
            flat.index_copy_(0, plan.slots, new)
        else:  # index (block, offset) so that caches of any stride work
            cache.index_put_((plan.slots // block_size, plan.slots % block_size), new)


# Gathered K/V bytes per chunk of sequences (see the module docstring). On CUDA there are no
# page faults to dodge (caching allocator) and every chunk costs kernel launches: big chunks.
_CPU_CHUNK_BYTES = 4 << 20
_CUDA_CHUNK_BYTES = 1 << 30


def _host_spans(
    cu_query_lens: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, max_kv: int
) -> tuple[list[int], list[int], list[int]]:
    """cu_query_lens, query lengths and context lengths as lists; validates them (one sync)."""
    cu = cu_query_lens.tolist()
    kv_lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if cu[0] != 0 or cu[-1] != num_tokens or min(q_lens) < 0:
        raise ValueError(
            f"cu_query_lens must start at 0, be non-decreasing and end at num_tokens={num_tokens}, "
            f"got {cu}"
        )
    if any(q > kv for q, kv in zip(q_lens, kv_lens, strict=True)):
        raise ValueError("seq_lens[i] must be >= the query span length of sequence i")
    if max(kv_lens) > max_kv:
        raise ValueError(
            f"seq_lens must be <= block_tables.shape[1] * block_size = {max_kv}, got {max(kv_lens)}"
        )
    return cu, q_lens, kv_lens


def _chunk_bounds(kv_sorted: list[int], bytes_per_pos: int, budget: int) -> list[tuple[int, int]]:
    """[lo, hi) runs of the sorted (longest first) sequences whose padded K/V fit ~budget bytes."""
    bounds, lo = [], 0
    for i in range(1, len(kv_sorted) + 1):
        # Chunk [lo, i) is padded to kv_sorted[lo], its longest context; would seq i still fit?
        if i == len(kv_sorted) or (i - lo + 1) * kv_sorted[lo] * bytes_per_pos > budget:
            bounds.append((lo, i))
            lo = i
    return bounds


@dataclass(frozen=True)
class _Chunk:
    """One chunk's gather indices and masks: the same for every layer of a step."""

    flat_blocks: torch.Tensor  # [c * nb] block ids (padding entries 0)
    stale: torch.Tensor  # gathered rows past each sequence's context, to zero
    starts: torch.Tensor  # [c] first token of each span
    mask: torch.Tensor  # [c, 1, rows, L] bool: which keys each query row sees
    tok: torch.Tensor | None  # [c, max_q] token of each padded row (None: decode, use starts)
    q_valid: torch.Tensor | None  # [c, max_q] real (not padding) rows
    max_q: int


@dataclass(frozen=True)
class AttentionPlan:
    """Everything paged_attention derives from the step's metadata, computed once per step and
    reused by every layer (all layers share block tables and spans): no per-layer host syncs."""

    chunks: list[_Chunk]
    num_tokens: int
    group: int


def plan_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
) -> AttentionPlan:
    """Validate the spans and build the gather plan for caches shaped like ``k_cache``
    (``tree_mask``: paged_attention's)."""
    num_tokens, num_heads = query.shape[:2]
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = num_heads // num_kv_heads
    if num_tokens == 0:
        return AttentionPlan([], 0, group)
    if num_seqs == 0:
        raise ValueError(f"seq_lens must name at least one sequence for num_tokens={num_tokens}")
    cu, q_lens, kv_lens = _host_spans(
        cu_query_lens, seq_lens, num_tokens, block_tables.shape[1] * block_size
    )
    # Sequences with a non-empty span, longest context first; everything below is in this order.
    order = sorted((i for i in range(num_seqs) if q_lens[i] > 0), key=lambda i: -kv_lens[i])
    device = query.device
    kv_sorted = [kv_lens[i] for i in order]
    kv = torch.tensor(kv_sorted, device=device)
    ql = torch.tensor([q_lens[i] for i in order], device=device)
    starts = torch.tensor([cu[i] for i in order], device=device)
    nb = -(-kv_sorted[0] // block_size)
    # Table entries past a sequence's last block are padding and may hold anything: use block 0.
    blocks = block_tables[torch.tensor(order, device=device), :nb].masked_fill(
        torch.arange(nb, device=device) >= (kv[:, None] + block_size - 1) // block_size, 0
    )
    lowest, highest = torch.stack(torch.aminmax(blocks)).tolist()
    if lowest < 0 or highest >= k_cache.shape[0]:
        raise ValueError(
            f"block_tables entries in use must be in [0, {k_cache.shape[0]}) (num_blocks), "
            f"got {lowest}..{highest}"
        )
    kv_pos = torch.arange(nb * block_size, device=device)
    # the gathered K/V, and their copies in the query's dtype under a 16-bit cache
    item = k_cache.element_size() + (query.element_size() if query.dtype != k_cache.dtype else 0)
    bytes_per_pos = 2 * num_kv_heads * head_dim * item
    budget = _CUDA_CHUNK_BYTES if device.type == "cuda" else _CPU_CHUNK_BYTES
    chunks = []
    for lo, hi in _chunk_bounds(kv_sorted, bytes_per_pos, budget):
        chunk_blocks = -(-kv_sorted[lo] // block_size)
        max_q = max(q_lens[i] for i in order[lo:hi])
        chunks.append(
            _plan_chunk(
                blocks[lo:hi, :chunk_blocks],
                kv[lo:hi],
                ql[lo:hi],
                starts[lo:hi],
                kv_pos[: chunk_blocks * block_size],
                max_q,
                group,
                tree_mask,
            )  # fmt: skip
        )
    return AttentionPlan(chunks, num_tokens, group)


def _plan_chunk(
    blocks: torch.Tensor,
    kv: torch.Tensor,
    ql: torch.Tensor,
    starts: torch.Tensor,
    kv_pos: torch.Tensor,
    max_q: int,
    group: int,
    tree_mask: torch.Tensor | None,
) -> _Chunk:
    """blocks [c, nb] (padding entries already 0), context lengths kv, span lengths ql (all >= 1),
    first tokens starts [c]; kv_pos = arange(nb * B)."""
    # Slots past seq_len hold stale or uninitialised values (even NaN), and a masked score does
    # not cancel a NaN, so they are zeroed; sorting keeps their number small.
    stale = (kv_pos >= kv[:, None]).view(-1).nonzero().squeeze(1)
    if max_q == 1:
        # Decode: one token per sequence, the last one, which sees every cached key.
        mask = (kv_pos < kv[:, None])[:, None, None, :]
        return _Chunk(blocks.reshape(-1), stale, starts, mask, None, None, 1)
    # Pad the spans to [c, max_q] tokens (padding rows read token 0 and are dropped at the end).
    q_idx = torch.arange(max_q, device=kv.device)
    q_valid = q_idx < ql[:, None]
    tok = (starts[:, None] + q_idx).masked_fill(~q_valid, 0)
    # Token j sits at kv_len - q_len + j and sees keys up to there; padding rows see every key.
    q_pos = torch.minimum(kv[:, None] - ql[:, None] + q_idx, kv[:, None] - 1)
    mask = kv_pos <= q_pos[:, :, None]  # [c, max_q, L]
    if tree_mask is not None:  # bit j clear: token j of the span is hidden (j < 64)
        rel = kv_pos - (kv - ql)[:, None]  # [c, L]: key position within the span
        in_tree = ((rel >= 0) & (rel < MAX_TREE_TOKENS))[:, None, :]
        bits = tree_mask[tok][:, :, None] >> rel.clamp(0, MAX_TREE_TOKENS - 1)[:, None, :]
        mask &= ~in_tree | (bits & 1).bool()
    mask = mask.repeat_interleave(group, dim=1)  # [c, max_q * G, L]
    return _Chunk(blocks.reshape(-1), stale, starts, mask[:, None], tok, q_valid, max_q)


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
    """Causal attention of every query span over its sequence's paged K/V; returns out [T, Hq, D].

    Span i (query[cu_query_lens[i]:cu_query_lens[i+1]]) holds the last q_len_i of the seq_lens[i]
    tokens whose K/V are in the cache; its token j sits at seq_lens[i] - q_len_i + j.
    ``plan``: from ``plan_paged_attention`` on the same metadata and ``tree_mask`` (built here
    when None). ``tree_mask``: see kernels.paged_attention.
    """
    if plan is None:
        check_paged_attention_args(
            query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out, tree_mask
        )
        plan = plan_paged_attention(
            query, k_cache, block_tables, cu_query_lens, seq_lens, tree_mask
        )
    elif query.shape[0] != plan.num_tokens:
        raise ValueError(f"plan is for {plan.num_tokens} tokens, query has {query.shape[0]}")
    if out is None:
        out = torch.empty_like(query)
    for chunk in plan.chunks:
        _attend_chunk(query, k_cache, v_cache, out, scale, chunk)
    return out


def _attend_chunk(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    chunk: _Chunk,
) -> None:
    """Attention for a few sequences at once: gather their K/V, one masked SDPA, scatter back."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    c, seq_len_max = chunk.starts.shape[0], chunk.mask.shape[-1]
    k = k_cache.index_select(0, chunk.flat_blocks).view(c * seq_len_max, num_kv_heads * head_dim)
    v = v_cache.index_select(0, chunk.flat_blocks).view(c * seq_len_max, num_kv_heads * head_dim)
    k.index_fill_(0, chunk.stale, 0)
    v.index_fill_(0, chunk.stale, 0)
    k, v = k.to(query.dtype), v.to(query.dtype)  # a 16-bit cache under float32 queries
    k = k.view(c, seq_len_max, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(c, seq_len_max, num_kv_heads, head_dim).transpose(1, 2)

    if chunk.tok is None:
        q = query.index_select(0, chunk.starts).view(c, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)
        # reshape, not view: on CUDA SDPA may return o in another memory layout.
        out.index_copy_(0, chunk.starts, o.reshape(c, num_heads, head_dim))
        return
    max_q = chunk.max_q
    # [c, max_q, Hkv, G, D] -> [c, Hkv, max_q * G, D]: row j * G + g is token j, head g.
    q = (
        query[chunk.tok]
        .view(c, max_q, num_kv_heads, group, head_dim)
        .transpose(1, 2)
        .reshape(c, num_kv_heads, max_q * group, head_dim)
    )
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)
    o = o.reshape(c, num_kv_heads, max_q, group, head_dim).transpose(1, 2)
    out[chunk.tok[chunk.q_valid]] = o.reshape(c, max_q, num_heads, head_dim)[chunk.q_valid]

"""Paged attention over packed query spans in Triton: one launch for decodes, verifications and
prefill chunks alike.

Tiles. The grid is (query tiles, KV heads, KV splits). A tile is BLOCK_M rows, each row a
(query token, query head) pair: BLOCK_Q = BLOCK_M // G consecutive tokens of one span times the
G = Hq / Hkv query heads that share one KV head (GQA packing), so every K/V tile is loaded once
for the whole group. Sequence i owns tiles first(i) = cu_query_lens[i] // BLOCK_Q + i onwards
(ceil(q_len_i / BLOCK_Q) of them); first() is strictly increasing, so a program finds its
sequence by binary search and the launch needs no host sync: the grid T // BLOCK_Q + S is an
upper bound and surplus programs exit at once.

Work. A program streams its sequence's K/V in BLOCK_N-token tiles, reading position pos at
block_tables[s, pos // B] * B + pos % B, up to the causal limit of its last row (tiles past it
are never loaded), with an online softmax in fp32 (exp2 domain). Span token j sits at
seq_len - q_len + j and sees positions 0..that one. Slots past seq_len and table entries past a
sequence's last block are never read.

Split-KV (flash decoding). When the launch has fewer programs than the GPU has SMs, the KV range
of each tile is cut into num_splits segments; each program writes a partial (max, sum,
unnormalised accumulator) in fp32 and _merge_kernel combines them by log-sum-exp. The number of
splits is chosen by _auto_num_splits (documented there) or forced by the num_splits argument.

CPU. On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set
by pagedspec.kernels.triton_setup before they are decorated), slowly but exactly: this is how the
tests check them. The kernels call only Triton builtins, never the @jit helpers of
triton.language.standard (tl.zeros, tl.max, tl.sum, tl.cdiv): those were decorated when triton
was first imported, which may predate TRITON_INTERPRET (transformers' Llama imports triton), and
a compiled helper cannot be called from an interpreted kernel. Max and sum are tl.reduce with
standard's own combine functions, which the interpreter maps to numpy without calling them.
"""

import functools
from dataclasses import dataclass

import torch

from pagedspec.kernels.checks import check_paged_attention_args
from pagedspec.kernels.triton_setup import check_device, interpreted, tl, triton

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Split-KV segments shorter than this are not worth a partial write and a merge.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32


# Reductions go through tl.reduce with the combine functions tl.max / tl.sum use themselves: the
# interpreter recognises them and reduces with numpy without calling them (see module docstring).
_MAX_COMBINE = tl.standard._elementwise_max
_SUM_COMBINE = tl.standard._sum_combine


# Sizes that change from step to step are not specialised on (Triton would otherwise compile a
# variant per value class, e.g. num_tokens == 1 or divisible by 16): no compile stalls mid-serving.
# stride_bt_s is the padded block-table width, which grows with the longest sequence of a step.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_bt_s"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    block_tables_ptr,
    cu_query_lens_ptr,
    seq_lens_ptr,
    tree_mask_ptr,
    scale,
    num_seqs,
    num_tokens,
    num_splits,
    num_heads,
    head_dim,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_bt_s,
    stride_bt_m,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # num_splits > 1: write partials for _merge_kernel
    DOT_PRECISION: tl.constexpr,
    TREE: tl.constexpr,  # tree_mask_ptr holds paged_attention's tree_mask
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Largest sequence s with first(s) = cu_query_lens[s] // BLOCK_Q + s <= tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_query_lens_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid
    seq = lo
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    tile_q0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_q0 >= q_len:
        return
    context = tl.load(seq_lens_ptr + seq) - q_len

    # Row r holds token tile_q0 + r // GROUP and query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = tile_q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context + tok
    tok_abs = (q_start + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + tok_abs[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Causal limit of the tile's last row (exclusive); this split's share of [0, kv_end).
    kv_end = context + tl.minimum(tile_q0 + BLOCK_Q, q_len)
    per_split = ((kv_end + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in the exp2 domain
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_m, mask=pos_ok, other=0)
        block = block.to(tl.int64)
        k = tl.load(
            k_head + (block * stride_kn + (pos % BLOCK_SIZE) * stride_kb)[None, :] + d[:, None],
            mask=pos_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        seen = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if TREE:  # bit j clear: span token j (j < 64) is hidden from the row
            # loaded per tile, not held across the loop: that spilled registers at BLOCK_M 32-64
            bits = tl.load(tree_mask_ptr + tok_abs, mask=row_ok, other=-1)
            rel = (pos - context).to(tl.int64)
            shift = tl.minimum(tl.maximum(rel, 0), 63)
            on_tree = ((bits[:, None] >> shift[None, :]) & 1) != 0
            seen = seen & (on_tree | (rel[None, :] < 0) | (rel[None, :] >= 64))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX_COMBINE))
        # A row with no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM_COMBINE)
        v = tl.load(
            v_head + (block * stride_vn + (pos % BLOCK_SIZE) * stride_vb)[:, None] + d[None, :],
            mask=pos_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = v.to(q.dtype)  # a 16-bit cache under float32 queries
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT_KV:
        # Split 0 always contains position 0, which every row sees: l_i > 0 on valid rows.
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tok_abs[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Partials are [num_splits, T, Hq] (m, l) and [num_splits, T, Hq, BLOCK_D] (acc); every
        # split writes every valid row, an empty segment as (-inf, 0, 0).
        part = (split * num_tokens + tok_abs) * num_heads + head
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    num_tokens,
    num_splits,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    SPLITS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < num_splits
    part = (s * num_tokens + tok) * num_heads + head
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)  # noqa: E741
    # Split 0 holds position 0, so the max is finite; empty splits (m = -inf) get weight 0.
    w = tl.math.exp2(m - tl.reduce(m, 0, _MAX_COMBINE))
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(
        part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0
    )
    out = tl.reduce(acc * w[:, None], 0, _SUM_COMBINE) / tl.reduce(l * w, 0, _SUM_COMBINE)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_num_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Split-KV heuristic: split only when the plain launch leaves SMs idle.

    With P = tiles * Hkv programs and SM streaming multiprocessors, P < SM means some SMs get no
    work; then each tile's KV range is cut into ceil(2 * SM / P) segments (two waves of work),
    but never into segments shorter than _MIN_SPLIT_TOKENS of the longest possible context
    (block_tables.shape[1] * block_size, known without a host sync) and at most _MAX_SPLITS.
    Short real contexts in a wide table just leave the extra segments empty (a cheap no-op).
    Off CUDA (the interpreter) there is no parallelism to win: no split.
    """
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return splits_for(programs, max_context, sms)


def splits_for(programs: int, max_context: int, sms: int) -> int:
    """_auto_num_splits on a GPU with `sms` streaming multiprocessors."""
    if programs >= sms:
        return 1
    return max(
        1, min(triton.cdiv(2 * sms, programs), max_context // _MIN_SPLIT_TOKENS, _MAX_SPLITS)
    )


def max_auto_splits(max_context: int) -> int:
    """The most splits _auto_num_splits can choose for contexts of up to max_context tokens."""
    return max(1, min(max_context // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


def block_m_for(rows: int, group: int, limit: int = 64) -> int:
    """BLOCK_M for spans of `rows` (token, head) rows on average: a power of two in [16, limit],
    at least the group size (one token's heads share a tile)."""
    return max(16, triton.next_power_of_2(group), min(limit, triton.next_power_of_2(rows)))


@dataclass(frozen=True)
class KernelConfig:
    """Tile width along KV and the launch resources of one attention variant."""

    block_n: int  # KV positions per inner-loop tile
    num_warps: int
    num_stages: int


# (fp32, BLOCK_D, BLOCK_M) -> KernelConfig, each compiled for sm_80 and sm_90 by
# pagedspec.kernels.compile_check with no register spills and <= 99 KB of shared memory (A10 / L4 /
# RTX 4090 class GPUs have no more): tests/kernels/test_kernel_compile.py. The Q, K and V tiles and
# the fp32 accumulator live in registers with their gather addresses, so all but the smallest tile
# take 8 warps, and the widest (fp32, head dim 128) narrower KV tiles. ptxas is not monotone here
# (fp32 128 x 32 split-KV spills with 1 or 2 stages, not 3): each entry is the first that compiled
# clean. fp32 at head dim 128 spills at BLOCK_M 64 under every config tried (4-16 warps, BLOCK_N
# 16-32, 1-4 stages), so its tiles stop at 32 rows (max_block_m).
_CONFIGS = {
    (False, 64, 16): KernelConfig(64, 4, 2),
    (False, 64, 32): KernelConfig(64, 8, 2),
    (False, 64, 64): KernelConfig(64, 8, 2),
    (False, 128, 16): KernelConfig(64, 8, 2),
    (False, 128, 32): KernelConfig(64, 8, 2),
    (False, 128, 64): KernelConfig(32, 8, 2),
    (True, 64, 16): KernelConfig(64, 8, 2),
    (True, 64, 32): KernelConfig(64, 8, 2),
    (True, 64, 64): KernelConfig(32, 8, 2),
    (True, 128, 16): KernelConfig(32, 8, 2),
    (True, 128, 32): KernelConfig(16, 8, 3),
}
# Float32 queries over a 16-bit cache (kv_cache_dtype), per (padded head dim, BLOCK_M): the K/V
# tiles are widened after their load, and with num_stages > 1 the software pipeline then kept
# whole tiles in registers and spilled (pagedspec.kernels.compile_check: up to 600 bytes of stack on
# sm_80/90); one stage and narrower tiles compile without spills. Not timed: no GPU was lent.
_NARROW_CACHE_CONFIGS = {
    (64, 16): KernelConfig(32, 4, 1),
    (64, 32): KernelConfig(32, 8, 1),
    (64, 64): KernelConfig(16, 8, 1),
    (128, 16): KernelConfig(32, 8, 1),
    (128, 32): KernelConfig(16, 16, 1),
}
# A tree-mask variant (TREE) under the configs above spills up to this many bytes of registers
# in 10 of its 148 variants (pagedspec.kernels.compile_check); halving BLOCK_N, one stage or twice
# the warps each left 5-10 spilling. Tree launches are draft verifications of a few tokens a
# sequence; their cost was not timed (no GPU lent).
TREE_STACK_LIMIT = 16
# Head dims past 128 (no model served here has them): small tiles, not compile-checked.
_WIDE_HEAD_CONFIG = KernelConfig(16, 8, 1)


def max_block_m(dtype: torch.dtype, block_d: int) -> int:
    """The largest BLOCK_M plan_launch may pick (before the GQA group's minimum): 64, and 32 for
    fp32 past head dim 64 (see _CONFIGS)."""
    return 32 if dtype == torch.float32 and block_d > 64 else 64


def kernel_config(
    dtype: torch.dtype, block_d: int, block_m: int, cache_dtype: torch.dtype | None = None
) -> KernelConfig:
    """Launch config per (query dtype, padded head dim, BLOCK_M), and the cache's dtype where it
    differs (None: the query's): see _CONFIGS and _NARROW_CACHE_CONFIGS. Head dims up to 64 use
    the 64 entries (smaller tiles fit wherever those do). Tree-mask launches take the same
    configs (their small spills: TREE_STACK_LIMIT)."""
    if block_d > 128:
        return _WIDE_HEAD_CONFIG
    key = max(64, block_d), min(64, block_m)
    if cache_dtype is not None and cache_dtype != dtype:
        return _NARROW_CACHE_CONFIGS[key]
    return _CONFIGS[(dtype == torch.float32, *key)]


@dataclass(frozen=True)
class LaunchPlan:
    block_m: int  # rows per tile: (token, head) pairs of one KV head
    block_q: int  # tokens per tile = block_m // G
    num_tiles: int  # grid size along tiles, an upper bound: T // block_q + S
    num_splits: int  # KV segments per tile; 1 = single pass


def plan_launch(
    num_tokens: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
    num_splits: int | None = None,
    block_m_limit: int = 64,
) -> LaunchPlan:
    """Tile shape and split count for a launch, from shapes only (no host sync).

    BLOCK_M covers the rows of an average span (tokens * G) as a power of two in [16, 64]
    (block_m_limit: max_block_m's): decode (span 1) gets one small tile per sequence and KV head,
    prefill full tiles.
    """
    rows = triton.cdiv(num_tokens, num_seqs) * group
    block_m = block_m_for(rows, group, block_m_limit)
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = _auto_num_splits(num_tiles * num_kv_heads, max_context, device)
    return LaunchPlan(block_m, block_q, num_tiles, num_splits)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query spans [T, Hq, D] over paged K/V; returns out [T, Hq, D].

    Semantics as kernels.paged_attention (tree_mask too). num_splits forces the split-KV path
    (> 1) or the single-pass path (1); None chooses by _auto_num_splits. Span values
    (cu_query_lens, seq_lens, table entries) are not validated: that would need a host sync.
    The warm-up compiles no tree variant: the first tree step compiles its own.
    """
    check_paged_attention_args(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out, tree_mask
    )
    check_device(_attention_kernel, query.device)
    if query.dtype not in _DTYPES:
        raise ValueError(f"backend 'triton' supports dtypes {_DTYPES}, got {query.dtype}")
    if torch.bfloat16 in (query.dtype, k_cache.dtype) and interpreted(_attention_kernel):
        # It multiplies the raw bf16 bit patterns in tl.dot (triton-lang/triton#11584).
        raise ValueError(
            "dtype bfloat16 is not supported by Triton's interpreter; use float16 or float32 "
            "on the CPU, or CUDA tensors"
        )
    if num_splits is not None and not 1 <= num_splits <= 128:
        raise ValueError(f"num_splits must be in [1, 128] or None, got {num_splits}")
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if num_seqs == 0:
        raise ValueError(f"seq_lens must name at least one sequence for num_tokens={num_tokens}")

    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    limit = max_block_m(query.dtype, max(16, triton.next_power_of_2(head_dim)))
    plan = plan_launch(
        num_tokens, num_seqs, group, num_kv_heads, max_context, query.device, num_splits, limit
    )
    launch(
        query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out, plan, tree_mask
    )
    return out


def launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    plan: LaunchPlan,
    tree_mask: torch.Tensor | None = None,
) -> None:
    """Launches the kernels for a checked, non-empty problem under `plan` (the warm-up forces
    plans this way to compile every variant)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    num_splits = plan.num_splits
    block_d = max(16, triton.next_power_of_2(head_dim))
    config = kernel_config(query.dtype, block_d, plan.block_m, k_cache.dtype)
    if num_splits > 1:
        part_m = torch.empty(num_splits, num_tokens, num_heads, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_splits, num_tokens, num_heads, block_d, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused by the single-pass kernel
    cu_query_lens = cu_query_lens.contiguous()
    seq_lens = seq_lens.contiguous()

    _attention_kernel[(plan.num_tiles, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        out,
        part_m,
        part_l,
        part_acc,
        block_tables,
        cu_query_lens,
        seq_lens,
        seq_lens if tree_mask is None else tree_mask.contiguous(),  # unread without TREE
        scale,
        num_seqs,
        num_tokens,
        num_splits,
        num_heads,
        head_dim,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(),
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        SPLIT_KV=num_splits > 1,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        TREE=tree_mask is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            num_tokens,
            num_splits,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            SPLITS_P2=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )

"""Random paged-attention problems, shared by the kernel tests and benchmarks/kernels.py."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Kernel test cases, name: (q_lens, seq_lens, query heads per KV head, block size, head dim).
ATTENTION_CASES = {
    "decode_block_edges": ([1] * 6, [1, 15, 16, 17, 32, 49], 4, 16, 64),
    "verify_spans_2_to_9": ([2, 3, 4, 5, 6, 7, 8, 9], [9, 3, 70, 5, 16, 40, 8, 33], 3, 16, 32),
    "prefill_whole_context": ([200], [200], 1, 16, 64),
    "prefill_chunk_after_context": ([150], [300], 8, 32, 32),
    "mixed_batch": ([1, 1, 5, 64, 0, 1, 16], [100, 17, 40, 64, 3, 1, 16], 3, 16, 128),
    "head_dim_48": ([1, 7], [20, 7], 4, 16, 48),
}


@dataclass(frozen=True)
class PagedProblem:
    """Inputs of kernels.paged_attention, laid out the way the engine lays them out."""

    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [N, B, Hkv, D]
    v_cache: torch.Tensor  # [N, B, Hkv, D]
    block_tables: torch.Tensor  # int32 [S, M], shuffled block ids, rows padded
    cu_query_lens: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]

    def args(self) -> tuple[torch.Tensor, ...]:
        """(query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens)."""
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_query_lens,
            self.seq_lens,
        )

    def to(self, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> "PagedProblem":
        """The same problem with the query cast to dtype and the caches to cache_dtype (None:
        dtype)."""
        cache_dtype = cache_dtype or dtype
        return PagedProblem(
            self.query.to(dtype),
            self.k_cache.to(cache_dtype),
            self.v_cache.to(cache_dtype),
            self.block_tables,
            self.cu_query_lens,
            self.seq_lens,
        )


def make_paged_problem(
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    spare_blocks: int = 2,
    table_padding: int = 1,
    poison_unused: bool = True,
) -> PagedProblem:
    """A random problem: span i is the last q_lens[i] of seq_lens[i] cached tokens.

    Every sequence gets ceil(seq_len / block_size) distinct blocks drawn from a random permutation
    of all blocks (so tables are shuffled and non-contiguous); each table row is padded with
    table_padding (or more) random block ids. With poison_unused, every cache slot that no
    sequence owns, including the tail of each last block, holds NaN, so an implementation that
    reads past seq_len or past a table row's used entries produces NaN. Random values are drawn
    on the generator's device (default: the target device) and moved to `device`.
    """
    if len(q_lens) != len(seq_lens):
        raise ValueError(
            f"q_lens and seq_lens must have equal lengths, got {len(q_lens)}, {len(seq_lens)}"
        )
    if any(not 0 <= q <= kv for q, kv in zip(q_lens, seq_lens, strict=True)):
        raise ValueError("every q_len must be in [0, seq_len]")
    gen_device = generator.device if generator is not None else torch.device(device)
    kw = {"device": gen_device, "generator": generator}

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=dtype, **kw).to(device)

    blocks_per_seq = [-(-kv // block_size) for kv in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=0) + table_padding
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), **kw).to(device)
    perm = torch.randperm(num_blocks, **kw).to(device)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[start : start + n]
        start += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if poison_unused:
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        seq_of_pos = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=device),
            torch.tensor(seq_lens, device=device),
        )
        starts = torch.tensor([0, *seq_lens], device=device).cumsum(0)[:-1]
        pos = torch.arange(len(seq_of_pos), device=device) - starts[seq_of_pos]
        slots = tables[seq_of_pos, pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = randn(len(slots), num_kv_heads, head_dim)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = randn(len(slots), num_kv_heads, head_dim)
    else:
        k_cache = randn(*shape)
        v_cache = randn(*shape)

    query = randn(sum(q_lens), num_heads, head_dim)
    cu = torch.tensor([0, *q_lens], device=device).cumsum(0)
    return PagedProblem(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(torch.int32),
        cu_query_lens=cu.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest absolute error of ``got`` against ``exact`` (float64), over ``exact``'s largest."""
    return float((got.double() - exact).abs().max() / exact.abs().max())

"""pagedspec.kernels.reference (the CPU serving path and the kernels' oracle) against a naive
per-token loop, plus the KV-cache write, argument checks and backend dispatch."""

import os
import subprocess
import sys

import pytest
import torch

from pagedspec import kernels
from pagedspec.kernels import reference
from pagedspec.kernels.testing import make_paged_problem


def naive_attention(query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale):
    """Token by token, head by head, position by position: the definition, nothing clever."""
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    for s in range(len(seq_lens)):
        first, last, seq_len = int(cu_query_lens[s]), int(cu_query_lens[s + 1]), int(seq_lens[s])
        slots = [(int(block_tables[s, p // block_size]), p % block_size) for p in range(seq_len)]
        for j in range(last - first):
            pos = seq_len - (last - first) + j
            for h in range(query.shape[1]):
                keys = torch.stack([k_cache[b, o, h // group] for b, o in slots[: pos + 1]])
                values = torch.stack([v_cache[b, o, h // group] for b, o in slots[: pos + 1]])
                weights = torch.softmax(keys @ query[first + j, h] * scale, dim=0)
                out[first + j, h] = weights @ values
    return out


# (q_lens, seq_lens) per case; block size 16 unless the case says otherwise.
CASES = {
    "decode": ([1, 1, 1, 1, 1], [1, 15, 16, 17, 40]),
    "verify": ([2, 5, 9, 3], [2, 20, 33, 48]),
    "prefill_whole_context": ([37, 16], [37, 16]),
    "prefill_chunk_after_context": ([20, 7], [52, 31]),
    "mixed_with_empty_span": ([1, 0, 6, 24], [30, 5, 6, 64]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_reference_matches_naive_loop(case, group, gen):
    q_lens, seq_lens = CASES[case]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=8, block_size=16,
        dtype=torch.float64, generator=gen, table_padding=2,
    )  # fmt: skip
    scale = float(torch.rand((), generator=gen)) + 0.1
    out = torch.full_like(p.query, float("nan"))
    got = reference.paged_attention(*p.args(), scale, out=out)
    assert got is out and not out.isnan().any()
    torch.testing.assert_close(out, naive_attention(*p.args(), scale), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [1, 4096, 1 << 30])
def test_reference_chunking_does_not_change_results(chunk_bytes, gen, monkeypatch):
    # One sequence per chunk, a few per chunk, and everything in one chunk.
    monkeypatch.setattr(reference, "_CPU_CHUNK_BYTES", chunk_bytes)
    q_lens = [1, 3, 1, 12, 1, 2]
    seq_lens = [70, 3, 33, 12, 5, 90]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16,
        dtype=torch.float64, generator=gen,
    )  # fmt: skip
    out = reference.paged_attention(*p.args(), 0.25)
    torch.testing.assert_close(out, naive_attention(*p.args(), 0.25), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)]
)
def test_reference_low_precision_close_to_float64(dtype, tol, gen):
    p = make_paged_problem(
        [1, 4, 30], [100, 20, 30], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
        dtype=torch.float64, generator=gen,
    )  # fmt: skip
    exact = reference.paged_attention(*p.args(), 0.125)
    low = reference.paged_attention(*p.to(dtype).args(), 0.125)
    assert low.dtype == dtype
    err = (low.double() - exact).abs().max() / exact.abs().max()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_reference_float32_queries_over_a_16_bit_cache(cache_dtype, gen):
    """kv_cache_dtype: float32 queries over a 16-bit cache compute in float32 on the cache's
    values: float64 on those same values agrees to float32's precision."""
    p = make_paged_problem(
        [1, 6, 20, 1], [50, 6, 70, 33], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
        generator=gen,
    ).to(torch.float32, cache_dtype)  # fmt: skip
    out = reference.paged_attention(*p.args(), 0.2)
    exact = reference.paged_attention(*p.to(torch.float64).args(), 0.2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_reference_block_size_32_and_int64_indices(gen):
    p = make_paged_problem(
        [1, 5, 40], [64, 33, 40], num_heads=4, num_kv_heads=4, head_dim=8, block_size=32,
        dtype=torch.float64, generator=gen,
    )  # fmt: skip
    args = list(p.args())
    args[3:] = [t.long() for t in args[3:]]
    out = reference.paged_attention(*args, 0.3)
    torch.testing.assert_close(out, naive_attention(*p.args(), 0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize(
    ("slot_dtype", "dtype", "cache_dtype"),
    [
        (torch.int64, torch.float32, torch.float32),
        (torch.int32, torch.bfloat16, torch.bfloat16),
        (torch.int64, torch.float32, torch.float16),  # kv_cache_dtype: rounded on write
        (torch.int32, torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("strided_cache", [False, True])
def test_write_kv_cache_writes_each_slot_once(
    backend, slot_dtype, dtype, cache_dtype, strided_cache, gen
):
    num_blocks, block_size, heads, dim = 6, 16, 3, 8
    num_tokens = 40
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:7]] = -1
    # key/value as strided views of a fused projection, the way a model produces them.
    qkv = torch.randn(num_tokens, 3 * heads + 1, dim, generator=gen).to(dtype)
    key, value = qkv[:, :heads], qkv[:, heads + 1 : 2 * heads + 1]
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(cache_dtype)
    if strided_cache:  # blocks and offsets that do not collapse into one slot dimension
        k_cache = torch.cat([k_cache, k_cache], dim=1)[:, :block_size]
        v_cache = torch.cat([v_cache, v_cache], dim=1)[:, :block_size]
    k_before, v_before = k_cache.clone(), v_cache.clone()

    # Triton's kernels are compiled for the GPU where there is one, interpreted otherwise.
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    caches = (k_cache.to(device), v_cache.to(device))
    args = (key.to(device), value.to(device), *caches, slots.to(device, slot_dtype))
    if backend == "triton" and device == "cpu" and dtype != cache_dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="interpreter"):  # it would truncate
            kernels.write_kv_cache(*args, backend=backend)
        return
    kernels.write_kv_cache(*args, backend=backend)
    k_cache, v_cache = (c.cpu().contiguous() for c in caches)

    keep = slots >= 0
    expect_k = k_before.view(-1, heads, dim).clone()
    expect_v = v_before.view(-1, heads, dim).clone()
    expect_k[slots[keep]] = key[keep].to(cache_dtype)
    expect_v[slots[keep]] = value[keep].to(cache_dtype)
    assert torch.equal(k_cache.view(-1, heads, dim), expect_k)
    assert torch.equal(v_cache.view(-1, heads, dim), expect_v)


def test_one_write_plan_serves_every_layer(gen):
    """The per-step write plan (validated once, reused by all layers) writes what an unplanned
    call writes, padding included; a plan for another token count is refused."""
    num_blocks, block_size, heads, dim = 5, 16, 2, 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:12]
    slots[torch.randperm(12, generator=gen)[:3]] = -1
    cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    plan = kernels.plan_write_kv_cache(slots, cache, backend="torch")
    assert plan.keep is not None and plan.slots.numel() == 9
    for _ in range(3):  # layers: same slots, other values
        key, value = (torch.randn(12, heads, dim, generator=gen) for _ in range(2))
        expect = [cache.clone(), cache.clone()]
        reference.write_kv_cache(key, value, *expect, slots)
        got = [cache.clone(), cache.clone()]
        kernels.write_kv_cache(key, value, *got, slots, backend="torch", plan=plan)
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))
    with pytest.raises(ValueError, match="plan is for 12 tokens"):
        reference.write_kv_cache(key[:5], value[:5], cache, cache.clone(), slots[:5], plan=plan)
    assert kernels.plan_write_kv_cache(slots, cache, backend="triton") is None


def _args(**changes):
    p = make_paged_problem([1, 2], [5, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    args = dict(zip(["query", "k_cache", "v_cache", "block_tables", "cu_query_lens", "seq_lens"],
                    p.args(), strict=True))  # fmt: skip
    args["scale"] = 0.5
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"query": torch.randn(3, 3, 8)}, "num_kv_heads"),
        ({"query": torch.randn(3, 4, 16)}, "query"),
        ({"cu_query_lens": torch.tensor([0, 1], dtype=torch.int32)}, "cu_query_lens"),
        ({"seq_lens": torch.tensor([0, 9], dtype=torch.int32)}, "seq_lens"),
        ({"cu_query_lens": torch.tensor([0, 1, 4], dtype=torch.int32)}, "cu_query_lens"),
        ({"seq_lens": torch.tensor([5, 90], dtype=torch.int32)}, "seq_lens"),
        ({"block_tables": torch.zeros(2, 3)}, "block_tables"),
        ({"block_tables": torch.full((2, 3), 99, dtype=torch.int32)}, "block_tables"),
        ({"scale": 0.0}, "scale"),
        ({"out": torch.empty(3, 4, 8, dtype=torch.float64)}, "out"),
    ],
)
def test_reference_rejects_bad_input(changes, field):
    with pytest.raises(ValueError, match=field):
        reference.paged_attention(**_args(**changes))


def test_write_kv_cache_rejects_out_of_range_slot():
    cache = torch.zeros(2, 4, 1, 8)
    kv = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.write_kv_cache(kv, kv, cache, cache.clone(), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.write_kv_cache(kv, kv, cache, cache.clone(), torch.tensor([0]))


def test_dispatch_backends_on_cpu(gen):
    args = _args()
    explicit = kernels.paged_attention(**args, backend="torch")
    assert torch.equal(explicit, reference.paged_attention(**args))
    with pytest.raises(ValueError, match="backend"):
        kernels.paged_attention(**args, backend="cuda")
    with pytest.raises(ValueError, match="xformers"):
        kernels.paged_attention(**args, backend="xformers")


def test_cpu_path_never_imports_triton_or_xformers():
    code = (
        "import sys, torch\n"
        "from pagedspec import kernels\n"
        "from pagedspec.kernels.testing import make_paged_problem\n"
        "p = make_paged_problem([1], [3], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)\n"
        "kernels.paged_attention(*p.args(), 1.0)\n"
        "assert 'xformers' not in sys.modules\n"
        "assert 'pagedspec.kernels.triton_attention' not in sys.modules\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=os.path.dirname(kernels.__path__[0])
    )


def test_one_plan_serves_every_layer(gen, monkeypatch):
    """The per-step plan (built once, reused by all layers) gives each layer's exact result."""
    monkeypatch.setattr(reference, "_CPU_CHUNK_BYTES", 2048)  # several chunks
    shape = dict(num_heads=6, num_kv_heads=2, head_dim=8, block_size=16, generator=gen)
    q_lens, seq_lens = [1, 5, 0, 30, 1], [17, 40, 3, 30, 64]
    first = make_paged_problem(q_lens, seq_lens, **shape)
    plan = kernels.plan_paged_attention(
        first.query, first.k_cache, first.block_tables, first.cu_query_lens, first.seq_lens,
        backend="torch",
    )  # fmt: skip
    assert len(plan.chunks) > 1
    for layer in range(3):  # same spans and tables, other values (unowned slots stay NaN)
        noise = [torch.randn(t.shape, generator=gen) for t in (first.query, first.k_cache)]
        query, k_cache = first.query * noise[0], first.k_cache * noise[1]
        v_cache = first.v_cache * (layer + 1)
        tables = (first.block_tables, first.cu_query_lens, first.seq_lens)
        expected = reference.paged_attention(query, k_cache, v_cache, *tables, 0.3)
        got = kernels.paged_attention(query, k_cache, v_cache, *tables, 0.3, backend="torch",
                                      plan=plan)  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert kernels.plan_paged_attention(first.query, first.k_cache, *tables, "triton") is None


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [1, 3, 1, 5]], ids=["decode", "mixed"])
def test_reference_accepts_sdpa_output_in_any_layout(q_lens, gen, monkeypatch):
    # CUDA's SDPA kernels may return [c, Hkv, G, D] with G outermost in memory (the GPU check's
    # kernel benchmark failed on a .view of it); CPU SDPA never does, so force that layout here.
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strided_sdpa)
    seq_lens = [9, 20, 33, 5]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=8, block_size=16,
        dtype=torch.float64, generator=gen,
    )  # fmt: skip
    out = reference.paged_attention(*p.args(), 0.3)
    torch.testing.assert_close(out, naive_attention(*p.args(), 0.3), rtol=1e-12, atol=1e-12)

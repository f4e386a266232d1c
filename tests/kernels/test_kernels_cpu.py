"""The C++ CPU kernel (backend "cpu") against pagedspec.kernels.reference computed in float64.

Problems come from pagedspec.kernels.testing.make_paged_problem, which poisons every cache slot no
sequence owns with NaN: a kernel that reads past seq_len or past a table row's used entries fails
here.
"""

from pathlib import Path

import pytest
import torch

from pagedspec import kernels
from pagedspec.kernels import cpu_attention, cpu_extension, reference
from pagedspec.kernels.testing import ATTENTION_CASES, make_paged_problem, relative_error

# Extra shapes for this kernel's own edges: more query rows per KV head than one work item holds
# (32), head dims that are not a multiple of the SIMD width or of the 4-Vec accumulation runs,
# block size 1, a block of two 16-position score chunks, and groups that leave 1, 2 or 3 rows
# after the decode path's groups of 4 rows.
CASES = {
    **ATTENTION_CASES,
    "group_40_head_dim_24": ([3, 1], [20, 7], 40, 16, 24),
    "block_size_1": ([1, 4, 2], [5, 4, 9], 2, 1, 16),
    "decode_group_5_head_dim_40": ([1] * 6, [3, 16, 17, 40, 64, 81], 5, 16, 40),
    "decode_group_6_head_dim_80": ([1] * 5 + [2], [1, 31, 33, 60, 77, 20], 6, 16, 80),
    "decode_group_7_block_32": ([1] * 5 + [3], [1, 31, 32, 33, 95, 64], 7, 32, 64),
}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def run_kernel(problem, scale, dtype=torch.float32):
    """The kernel on NaN-poisoned output; returns (out, float64 reference)."""
    exact = reference.paged_attention(*problem.to(torch.float64).args(), scale)
    low = problem.to(dtype)
    out = torch.full_like(low.query, float("nan"))
    got = cpu_attention.paged_attention(*low.args(), scale, out=out)
    assert got is out
    assert not out.isnan().any(), "some output rows were not written"
    return out, exact


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_kernel_matches_reference(case, dtype, gen):
    q_lens, seq_lens, group, block_size, head_dim = CASES[case]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, generator=gen, table_padding=3,
    )  # fmt: skip
    out, exact = run_kernel(p, head_dim**-0.5, dtype)
    assert relative_error(out, exact) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_kernel_low_precision_cache_with_three_kv_heads(dtype, gen):
    """bf16/fp16 rows are converted into float32 scratch, whose row stride is head_dim whatever
    the cache's (the cache rows here are 3 * head_dim apart): prefill and decode spans."""
    p = make_paged_problem(
        [40, 1, 1, 3], [40, 70, 17, 35], num_heads=9, num_kv_heads=3, head_dim=32,
        block_size=16, generator=gen,
    )  # fmt: skip
    out, exact = run_kernel(p, 0.2, dtype)
    assert relative_error(out, exact) <= TOLERANCE[dtype]


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case", ["mixed_batch", "group_40_head_dim_24", "decode_group_5_head_dim_40"]
)
def test_cpu_kernel_float32_queries_over_a_16_bit_cache(case, cache_dtype, gen):
    """kv_cache_dtype: a float32 query over a 16-bit cache computes in float32 on the cache's
    values, so it matches the float64 reference on those same (rounded) values at float32's
    tolerance. Head dims 24 and 40 leave rows that the SIMD widening does not cover."""
    q_lens, seq_lens, group, block_size, head_dim = CASES[case]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, generator=gen, table_padding=3,
    ).to(torch.float32, cache_dtype)  # fmt: skip
    exact = reference.paged_attention(*p.to(torch.float64).args(), head_dim**-0.5)
    out = torch.full_like(p.query, float("nan"))
    cpu_attention.paged_attention(*p.args(), head_dim**-0.5, out=out)
    assert out.dtype == torch.float32
    assert relative_error(out, exact) <= 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_cpu_cache_write_rounds_float32_into_a_16_bit_cache(cache_dtype, strided, gen):
    """A float32 key written into a 16-bit cache holds key.to(cache dtype) (nearest even), as
    the torch backend writes it; a key whose head_dim is strided takes the element path."""
    cache = torch.randn(8, 16, 3, 24, generator=gen).to(cache_dtype)
    slots = torch.tensor([5, -1, 77, 0, 127])
    wide = torch.randn(5, 3, 48, generator=gen) * 100
    key, value = (wide[..., ::2], wide[..., 1::2]) if strided else (wide[..., :24], wide[..., 24:])
    got, expect = [cache.clone(), cache.clone()], [cache.clone(), cache.clone()]
    kernels.write_kv_cache(key, value, *got, slots, backend="cpu")
    reference.write_kv_cache(key, value, *expect, slots)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    flat = got[0].view(-1, 3, 24)
    assert torch.equal(flat[77], key[2].to(cache_dtype)) and not torch.equal(got[0], cache)


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
    ],
)
def test_cpu_kernels_reject_a_cache_neither_the_query_dtype_nor_16_bit_under_float32(
    query_dtype, cache_dtype
):
    p = _problem().to(query_dtype, cache_dtype)
    with pytest.raises(ValueError, match="dtype"):
        cpu_attention.paged_attention(*p.args(), 1.0)
    key = torch.zeros(1, 2, 8, dtype=query_dtype)
    with pytest.raises(ValueError, match="dtype"):
        kernels.write_kv_cache(key, key, p.k_cache, p.v_cache, torch.tensor([0]), backend="cpu")


def test_cpu_kernel_random_batch(gen):
    num_seqs = int(torch.randint(1, 40, (), generator=gen))
    seq_lens = torch.randint(1, 300, (num_seqs,), generator=gen).tolist()
    q_lens = [int(torch.randint(0, min(s, 40) + 1, (), generator=gen)) for s in seq_lens]
    q_lens[0] = max(q_lens[0], 1)
    group = [1, 3, 4, 8][int(torch.randint(0, 4, (), generator=gen))]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=3 * group, num_kv_heads=3, head_dim=64, block_size=16,
        generator=gen,
    )  # fmt: skip
    out, exact = run_kernel(p, float(torch.rand((), generator=gen)) + 0.05)
    assert relative_error(out, exact) <= 1e-5


def test_cpu_kernel_same_bits_for_any_thread_count(gen):
    """Decode spans are split differently with one thread (14 spans: whole-sequence items) than
    with 8 (too few spans: one item per KV head); every output row must still be computed in the
    same order, so that a request's numbers do not depend on the batch around it."""
    p = make_paged_problem(
        [1] * 12 + [9, 2], torch.randint(9, 200, (14,), generator=gen).tolist(), num_heads=8,
        num_kv_heads=2, head_dim=32, block_size=16, generator=gen,
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 8):
            torch.set_num_threads(n)
            results.append(cpu_attention.paged_attention(*p.args(), 0.2))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_cpu_kernel_strided_query_and_out_int64_indices(gen):
    p = make_paged_problem(
        [3, 1], [20, 33], num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, generator=gen
    )
    # The query as a view of a fused QKV projection: token stride larger than heads * dim.
    qkv = torch.randn(4, 10, 32, generator=gen)
    qkv[:, :6] = p.query
    out = torch.full((4, 7, 32), float("nan"))
    args = [qkv[:, :6], *p.args()[1:3], *(t.long() for t in p.args()[3:])]
    kernels.paged_attention(*args, 0.3, out=out[:, 1:], backend="cpu")
    exact = reference.paged_attention(*p.to(torch.float64).args(), 0.3)
    assert relative_error(out[:, 1:], exact) <= 1e-5
    assert out[:, 0].isnan().all(), "wrote outside out"


def _problem():
    return make_paged_problem([1, 2], [5, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("block_tables", lambda p: p.block_tables.fill_(99)),
        ("block_tables", lambda p: p.block_tables.fill_(-1)),
        ("seq_lens", lambda p: p.seq_lens.copy_(torch.tensor([1, 1]))),
        ("seq_lens", lambda p: p.seq_lens.copy_(torch.tensor([5, 90]))),
        ("cu_query_lens", lambda p: p.cu_query_lens.copy_(torch.tensor([0, 2, 1]))),
        ("cu_query_lens", lambda p: p.cu_query_lens.copy_(torch.tensor([1, 1, 3]))),
    ],
)
def test_cpu_kernel_rejects_bad_values(field, change):
    p = _problem()
    change(p)
    with pytest.raises(ValueError, match=field):
        cpu_attention.paged_attention(*p.args(), 1.0)


def test_cpu_kernel_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="dtype"):
        cpu_attention.paged_attention(*_problem().to(torch.float64).args(), 1.0)


@pytest.mark.parametrize(
    ("match", "change"),
    [
        ("slot_mapping values", lambda a: a["slot_mapping"].copy_(torch.tensor([0, 5, 64]))),
        ("slot_mapping values", lambda a: a["slot_mapping"].copy_(torch.tensor([-2, 5, 6]))),
        ("slot_mapping must be", lambda a: a.update(slot_mapping=torch.tensor([0, 1]))),
        ("slot_mapping dtype", lambda a: a.update(slot_mapping=torch.tensor([0.0, 5.7, 6.0]))),
        ("slot_mapping dtype", lambda a: a.update(slot_mapping=torch.tensor([True, False, True]))),
        ("dtype", lambda a: a.update(value=a["value"].double())),
        ("key must be", lambda a: a.update(key=a["key"][:, :1])),
    ],
)
def test_cpu_cache_write_rejects_bad_input_before_writing(match, change, gen):
    """Every slot is checked before the first write: a bad one leaves both caches untouched."""
    cache = torch.randn(4, 16, 2, 8, generator=gen)
    key, value = (torch.randn(3, 2, 8, generator=gen) for _ in range(2))
    args = dict(key=key, value=value, k_cache=cache.clone(), v_cache=cache.clone(),
                slot_mapping=torch.tensor([0, 5, 6]))  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=match):
        kernels.write_kv_cache(**args, backend="cpu")
    assert torch.equal(args["k_cache"], cache) and torch.equal(args["v_cache"], cache)


def test_auto_picks_cpu_kernel_for_cpu_float_tensors(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a, **_: calls.append(a) or a[0])
    p = _problem()
    kernels.paged_attention(*p.args(), 1.0)
    assert len(calls) == 1
    kernels.paged_attention(*p.to(torch.float64).args(), 1.0)  # float64: the torch backend
    assert len(calls) == 1
    assert isinstance(
        kernels.plan_paged_attention(*p.args()[:2], *p.args()[3:]), cpu_attention.AttentionPlan
    )


def test_planned_calls_give_the_unplanned_bits_and_the_kernel_checks_each_call(gen):
    """A step checks its metadata once (the plan) and every layer calls with the plan: the same
    bits as an unplanned call. What the plan does not cover (each layer's query, caches, out,
    scale) the C++ kernel checks itself, since the Python checks are skipped."""
    p = make_paged_problem(
        [3, 1], [20, 33], num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, generator=gen
    )
    q, k, v, *meta = p.args()
    plan = kernels.plan_paged_attention(q, k, *meta, backend="cpu")
    assert all(
        t.dtype == torch.int64 for t in (plan.block_tables, plan.cu_query_lens, plan.seq_lens)
    )
    planned = kernels.paged_attention(q, k, v, *meta, 0.3, plan=plan)
    assert torch.equal(planned, cpu_attention.paged_attention(q, k, v, *meta, 0.3))
    strided = torch.empty(4, 6, 64)[..., ::2]
    strided.copy_(q)
    bad = [
        ("query must be", q[..., :16], k, v, 0.3, None),  # head_dim
        ("query must be", q[:, :3], k, v, 0.3, None),  # not a multiple of the KV heads
        ("dtype", q.double(), k, v, 0.3, None),
        ("k_cache and v_cache", q, k, v[:, :8], 0.3, None),
        ("out must", q, k, v, 0.3, torch.empty(4, 6, 16)),
        ("contiguous", strided, k, v, 0.3, None),
        ("scale", q, k, v, 0.0, None),
    ]
    for match, query, k_cache, v_cache, scale, out in bad:
        with pytest.raises(ValueError, match=match):
            kernels.paged_attention(query, k_cache, v_cache, *meta, scale, out=out, plan=plan)


def test_planned_cache_write_equals_unplanned_and_checks_each_call(gen):
    cache = torch.randn(4, 16, 2, 8, generator=gen)
    key, value = (torch.randn(3, 2, 8, generator=gen) for _ in range(2))
    slots = torch.tensor([0, -1, 17], dtype=torch.int32)
    plan = kernels.plan_write_kv_cache(slots, cache, backend="cpu")
    assert isinstance(plan, cpu_attention.WritePlan) and plan.slot_mapping.dtype == torch.int64
    planned, unplanned = (cache.clone(), cache.clone()), (cache.clone(), cache.clone())
    kernels.write_kv_cache(key, value, *planned, slots, plan=plan)
    kernels.write_kv_cache(key, value, *unplanned, slots, backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(planned, unplanned, strict=True))
    assert not torch.equal(planned[0], cache)
    with pytest.raises(ValueError, match="key must be"):
        kernels.write_kv_cache(key[:, :1], value, *planned, slots, plan=plan)


def test_unbuildable_extension_warns_and_reports_unavailable(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("g++ not found")

    monkeypatch.setattr(cpu_extension, "load", no_compiler)
    with caplog.at_level("WARNING", logger="pagedspec.kernels.cpu_extension"):
        assert cpu_extension.available.__wrapped__() is False  # uncached: the real check
    assert "g++ not found" in caplog.text


def _relayout(cache: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The same values in memory laid out in ``order`` (a permutation of the 4 dims)."""
    return cache.permute(order).contiguous().permute([order.index(i) for i in range(4)])


@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_kernel_any_cache_layout_and_separate_k_v_strides(block_size, gen):
    """Caches with other memory layouts (heads outside positions, block size 1 with an odd
    stride), K and V laid out differently, -1 in the table padding: same result."""
    p = make_paged_problem(
        [8, 1, 20], [8, 30, 45], num_heads=8, num_kv_heads=2, head_dim=16,
        block_size=block_size, generator=gen,
    )  # fmt: skip
    exact = reference.paged_attention(*p.to(torch.float64).args(), 0.25)
    k_cache, v_cache = _relayout(p.k_cache, (0, 2, 1, 3)), _relayout(p.v_cache, (2, 0, 1, 3))
    if block_size == 1:  # a size-1 dim may carry any stride: here 1, below head_dim
        n, _, h, d = p.k_cache.shape
        k_cache = torch.empty(n, h, d, 1).permute(0, 3, 1, 2).copy_(p.k_cache)
        assert k_cache.stride(1) == 1
    tables = p.block_tables.clone()
    tables[:, -1] = -1  # the last column is padding in every row: never read
    got = cpu_attention.paged_attention(
        p.query, k_cache, v_cache, tables, p.cu_query_lens, p.seq_lens, 0.25
    )
    assert relative_error(got, exact) <= 1e-5


def test_cpu_kernel_span_gives_the_same_bits_alone_and_in_a_batch(gen):
    """A prefill span (per-head items) and a decode span (one item) give bit-identical rows
    alone and among other sequences: a request's numbers do not depend on its batch."""
    shape = dict(num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, generator=gen)
    batch = make_paged_problem([1] * 9 + [40, 1], [50] * 9 + [70, 33], **shape)
    full = cpu_attention.paged_attention(*batch.args(), 0.2)
    for seq, rows in ((9, slice(9, 49)), (10, slice(49, 50))):
        alone = cpu_attention.paged_attention(
            batch.query[rows], batch.k_cache, batch.v_cache, batch.block_tables[seq : seq + 1],
            torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
            batch.seq_lens[seq : seq + 1], 0.2,
        )  # fmt: skip
        assert torch.equal(alone, full[rows])


def test_cpu_kernel_more_query_heads_per_kv_head_than_an_item_holds(gen):
    p = make_paged_problem(
        [3, 1], [40, 17], num_heads=100, num_kv_heads=1, head_dim=8, block_size=16, generator=gen
    )
    out, exact = run_kernel(p, 0.3)
    assert relative_error(out, exact) <= 1e-5


@pytest.mark.parametrize(
    ("field", "seq_lens", "cu_query_lens"),
    [
        ("seq_lens", [2**63 - 1], [0, 1]),
        ("seq_lens", [-5], [0, 0]),
        ("cu_query_lens", [5], [0, 2**62]),
    ],
)
def test_cpu_kernel_extreme_values_raise_not_crash(field, seq_lens, cu_query_lens):
    p = make_paged_problem([1], [5], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    args = list(p.args())
    args[4], args[5] = torch.tensor(cu_query_lens), torch.tensor(seq_lens)
    args[0] = args[0][: cu_query_lens[-1]]
    with pytest.raises(ValueError, match=field):
        cpu_attention.paged_attention(*args, 1.0)


def test_cpu_cache_write_across_threads_matches_reference(gen):
    """Enough tokens for the write to split across threads; int32 slots with skips."""
    cache = torch.randn(40, 16, 3, 8, generator=gen)
    slots = torch.randperm(40 * 16, generator=gen)[:300].int()
    slots[torch.randperm(300, generator=gen)[:20]] = -1
    key, value = (torch.randn(300, 3, 8, generator=gen) for _ in range(2))
    got, expect = [cache.clone(), cache.clone()], [cache.clone(), cache.clone()]
    kernels.write_kv_cache(key, value, *got, slots, backend="cpu")
    reference.write_kv_cache(key, value, *expect, slots)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


def test_build_name_follows_sources_flags_and_versions(tmp_path, monkeypatch):
    """Two checkouts with the same sources share a build; any edit, other flags or another
    torch (another version, or the same one in another virtualenv) names a different one (so
    builds never overwrite each other's)."""
    (tmp_path / "a.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "a.h").write_text("int f();\n")
    name = cpu_extension.build_name("AVX2", ["-O3"], tmp_path)
    assert name.startswith("pagedspec_cpu_avx2_")
    assert cpu_extension.build_name("AVX2", ["-O3"], tmp_path) == name
    assert cpu_extension.build_name("AVX2", ["-O2"], tmp_path) != name
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    assert cpu_extension.build_name("AVX2", ["-O3"], tmp_path) != name
    monkeypatch.undo()
    (tmp_path / "a.h").write_text("int f(void);\n")
    assert cpu_extension.build_name("AVX2", ["-O3"], tmp_path) != name


def test_two_checkouts_compile_the_same_staged_sources(tmp_path):
    """The build compiles copies in its own folder, so the compile commands (which name the
    sources) are the same from any checkout: compiled in place, two checkouts of the same
    sources made ninja rebuild their shared build at every switch. A copy is rewritten only
    where it differs (so its modification time, which ninja reads, stays)."""
    first, second, build = tmp_path / "one" / "csrc", tmp_path / "two" / "csrc", tmp_path / "b"
    for csrc in (first, second):
        csrc.mkdir(parents=True)
        (csrc / "a.cpp").write_text('#include "a.h"\nint f() { return 1; }\n')
        (csrc / "a.h").write_text("int f();\n")
    build.mkdir()
    paths = cpu_extension.stage_sources(first, build, ("a.cpp",))
    assert paths == [str(build / "src" / "a.cpp")]
    assert (build / "src" / "a.h").read_text() == "int f();\n"
    stamp = (build / "src" / "a.cpp").stat().st_mtime_ns
    assert cpu_extension.stage_sources(second, build, ("a.cpp",)) == paths
    assert (build / "src" / "a.cpp").stat().st_mtime_ns == stamp
    (build / "src" / "a.h").write_text("int f")  # a copy cut short
    cpu_extension.stage_sources(second, build, ("a.cpp",))
    assert (build / "src" / "a.h").read_text() == "int f();\n"
    assert sorted(p.name for p in (build / "src").iterdir()) == ["a.cpp", "a.h"]


def test_a_lock_left_by_a_killed_build_does_not_block_a_load(tmp_path, monkeypatch):
    """torch's build ``lock``, left behind by a build killed mid-way, is removed before torch
    would wait on it forever (the load holds our flock, so no live load is building there)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = []

    def fake_load(name, build_directory, **_):
        assert not (Path(build_directory) / "lock").exists(), "torch would wait on this lock"
        built.append(Path(build_directory))
        return name

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    cpu_extension.load.__wrapped__()
    (built[0] / "lock").touch()  # a fresh lock: a build killed a moment ago
    assert cpu_extension.load.__wrapped__() == built[0].name

"""Triton kernels against pagedspec.kernels.reference computed in float64.

Without CUDA the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before they
are decorated, i.e. before kernels.triton_* is first imported. pagedspec.kernels.triton_setup does
that by itself on CPU-only machines; it is repeated here so the module states its own precondition.
On a CUDA machine nothing is set, the kernels compile, and the @gpu tests run at realistic sizes.
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pagedspec import kernels  # noqa: E402
from pagedspec.kernels import reference, triton_attention  # noqa: E402
from pagedspec.kernels.testing import ATTENTION_CASES as CASES
from pagedspec.kernels.testing import (  # noqa: E402
    make_paged_problem,  # noqa: E402
    relative_error,
)

CUDA = torch.cuda.is_available()
# The small cases run in the interpreter on CPU-only machines and compiled where CUDA is present.
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
NO_BF16 = "Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)"


def check_against_reference(problem, scale, tol, num_splits=None, dtype=torch.float32):
    """Runs the kernel on NaN-poisoned output and compares with the float64 reference."""
    exact = reference.paged_attention(*problem.to(torch.float64).args(), scale)
    low = problem.to(dtype)
    out = torch.full_like(low.query, float("nan"))
    got = triton_attention.paged_attention(*low.args(), scale, out=out, num_splits=num_splits)
    assert got is out
    assert not out.isnan().any(), "some output rows were not written"
    err = relative_error(out, exact)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference(case, gen):
    q_lens, seq_lens, group, block_size, head_dim = CASES[case]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, generator=gen, table_padding=3, device=DEVICE,
    )  # fmt: skip
    check_against_reference(p, head_dim**-0.5, tol=1e-5, num_splits=1)


def test_triton_random_batch(gen):
    num_seqs = int(torch.randint(1, 6, (), generator=gen))
    seq_lens = torch.randint(1, 120, (num_seqs,), generator=gen).tolist()
    q_lens = [int(torch.randint(0, min(s, 12) + 1, (), generator=gen)) for s in seq_lens]
    q_lens[0] = max(q_lens[0], 1)
    group = [1, 3, 4, 8][int(torch.randint(0, 4, (), generator=gen))]
    p = make_paged_problem(
        q_lens, seq_lens, num_heads=group, num_kv_heads=1, head_dim=32, block_size=16,
        generator=gen, device=DEVICE,
    )  # fmt: skip
    check_against_reference(p, 0.2, tol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(not CUDA, reason=NO_BF16)),
        (torch.float16, 3e-3),
    ],
)
def test_triton_half_precision_close_to_float64(dtype, tol, gen):
    p = make_paged_problem(
        [1, 6, 20], [50, 6, 70], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        generator=gen, device=DEVICE,
    )  # fmt: skip
    check_against_reference(p.to(dtype), 0.125, tol=tol, dtype=dtype)


@pytest.mark.parametrize(
    "cache_dtype",
    [
        torch.float16,
        pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason=NO_BF16)),
    ],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_float32_queries_over_a_16_bit_cache(cache_dtype, num_splits, gen):
    """kv_cache_dtype: the cache's values are widened to the query's float32, so float64 on those
    same values agrees at float32's tolerance."""
    p = make_paged_problem(
        [1, 6, 20], [50, 6, 70], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        generator=gen, device=DEVICE,
    ).to(torch.float32, cache_dtype)  # fmt: skip
    exact = reference.paged_attention(*p.to(torch.float64).args(), 0.125)
    out = triton_attention.paged_attention(*p.args(), 0.125, num_splits=num_splits)
    assert out.dtype == torch.float32
    assert relative_error(out, exact) <= 1e-5


@pytest.mark.parametrize("num_splits", [2, 7])
def test_triton_split_kv_matches_reference(num_splits, gen):
    p = make_paged_problem(
        [1, 1, 6, 40, 1], [300, 2, 90, 40, 129], num_heads=8, num_kv_heads=2, head_dim=32,
        block_size=16, generator=gen, device=DEVICE,
    )  # fmt: skip
    check_against_reference(p, 0.17, tol=1e-5, num_splits=num_splits)


def test_triton_strided_query_int64_indices_and_dispatch(gen):
    p = make_paged_problem(
        [3, 1], [20, 33], num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
        generator=gen, device=DEVICE,
    )  # fmt: skip
    # The query as a view of a fused QKV projection: token stride larger than heads * dim.
    qkv = torch.randn(4, 10, 32, generator=gen).to(DEVICE)
    qkv[:, :6] = p.query
    args = [qkv[:, :6], *p.args()[1:3], *(t.long() for t in p.args()[3:])]
    got = kernels.paged_attention(*args, 0.3, backend="triton")
    exact = reference.paged_attention(*p.to(torch.float64).args(), 0.3)
    assert relative_error(got, exact) <= 1e-5


def test_triton_rejects_unsupported_dtypes():
    p = make_paged_problem(
        [1], [4], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, device=DEVICE
    )
    with pytest.raises(ValueError, match="dtype"):
        triton_attention.paged_attention(*p.to(torch.float64).args(), 1.0)
    if not CUDA:  # NO_BF16
        with pytest.raises(ValueError, match="bfloat16"):
            triton_attention.paged_attention(*p.to(torch.bfloat16).args(), 1.0)
        with pytest.raises(ValueError, match="bfloat16"):
            triton_attention.paged_attention(*p.to(torch.float32, torch.bfloat16).args(), 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        triton_attention.paged_attention(*p.args(), 1.0, num_splits=0)


# ---- CUDA: realistic sizes (32 query / 8 KV heads, head dim 128, block 16) -------------------


def _gpu_problem(q_lens, seq_lens, gen, dtype=torch.float32):
    """Data drawn on the GPU from a seed drawn from `gen`, so the printed seed replays it."""
    seed = int(torch.randint(2**31, (), generator=gen))
    cuda_gen = torch.Generator(device="cuda").manual_seed(seed)
    return make_paged_problem(
        q_lens, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=dtype, device="cuda", generator=cuda_gen, table_padding=4,
    )  # fmt: skip


def _gpu_cases(gen):
    def lens(n, hi):
        return torch.randint(1, hi + 1, (n,), generator=gen).tolist()

    decode = lens(64, 4096)
    verify = [max(s, 5) for s in lens(32, 2048)]
    return {
        "decode_b64": ([1] * 64, decode),
        "verify_b32_span5": ([5] * 32, verify),
        "prefill_chunk_plus_decodes": ([512, *[1] * 15], [2048, *lens(15, 3000)]),
    }


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["decode_b64", "verify_b32_span5", "prefill_chunk_plus_decodes"])
def test_gpu_triton_fp32_matches_reference(case, gen):
    q_lens, seq_lens = _gpu_cases(gen)[case]
    check_against_reference(_gpu_problem(q_lens, seq_lens, gen), 128**-0.5, tol=1e-5)


@pytest.mark.gpu
@gpu
def test_gpu_split_kv_is_chosen_for_few_long_sequences(gen):
    p = _gpu_problem([1], [16384], gen)
    max_context = p.block_tables.shape[1] * 16
    plan = triton_attention.plan_launch(1, 1, 4, 8, max_context, p.query.device)
    assert plan.num_splits > 1
    check_against_reference(p, 128**-0.5, tol=1e-5)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["decode_b64", "verify_b32_span5", "prefill_chunk_plus_decodes"])
def test_gpu_triton_bf16_close_to_fp32(case, gen):
    q_lens, seq_lens = _gpu_cases(gen)[case]
    p = _gpu_problem(q_lens, seq_lens, gen, torch.bfloat16)
    check_against_reference(p, 128**-0.5, tol=2e-2, dtype=torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["decode_b64", "verify_b32_span5", "prefill_chunk_plus_decodes"])
def test_gpu_xformers_matches_reference(case, gen):
    pytest.importorskip("xformers.ops")
    q_lens, seq_lens = _gpu_cases(gen)[case]
    p = _gpu_problem(q_lens, seq_lens, gen, torch.bfloat16)
    exact = reference.paged_attention(*p.to(torch.float64).args(), 128**-0.5)
    got = kernels.paged_attention(*p.args(), 128**-0.5, backend="xformers")
    assert relative_error(got, exact) <= 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode_b64", "prefill_chunk_plus_decodes"])
def test_gpu_triton_float32_queries_over_a_16_bit_cache(case, cache_dtype, gen):
    """kv_cache_dtype on the GPU: float64 on the same rounded cache agrees at float32's
    tolerance."""
    q_lens, seq_lens = _gpu_cases(gen)[case]
    p = _gpu_problem(q_lens, seq_lens, gen).to(torch.float32, cache_dtype)
    exact = reference.paged_attention(*p.to(torch.float64).args(), 128**-0.5)
    got = triton_attention.paged_attention(*p.args(), 128**-0.5)
    assert got.dtype == torch.float32 and relative_error(got, exact) <= 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_gpu_write_kv_cache_matches_reference(dtype, cache_dtype, gen):
    """Float32 keys into a 16-bit cache round to nearest even, as torch's .to() does."""
    slots = torch.randperm(4096 * 16, generator=gen)[:3000]
    slots[torch.randperm(3000, generator=gen)[:100]] = -1
    key, value = torch.randn(2, 3000, 8, 128, generator=gen).to("cuda", dtype)
    caches = [torch.randn(4096, 16, 8, 128, generator=gen).to("cuda", cache_dtype) for _ in "kv"]
    expect = [c.clone() for c in caches]
    kernels.write_kv_cache(key, value, *caches, slots.cuda(), backend="triton")
    kernels.write_kv_cache(key, value, *expect, slots.cuda(), backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(caches, expect, strict=True))


# ---- CPU-only machines (tests/kernels/test_kernel_compile.py compiles the GPU path)
# -------------------

_INTERPRETER_AFTER_TRITON = """
import os, triton  # triton first, as transformers' Llama does, before TRITON_INTERPRET is set
assert "TRITON_INTERPRET" not in os.environ
import torch
from pagedspec import kernels
from pagedspec.kernels import reference
from pagedspec.kernels.testing import make_paged_problem
p = make_paged_problem([1, 4], [20, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
got = kernels.paged_attention(*p.args(), 0.5, backend="triton")
exact = reference.paged_attention(*p.to(torch.float64).args(), 0.5)
assert (got.double() - exact).abs().max() < 1e-5
"""


def _run_python(code: str, **env: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    root = os.path.dirname(kernels.__path__[0])
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=environ, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(CUDA, reason="checks the CPU interpreter set-up")
def test_interpreter_works_when_triton_was_imported_first():
    _run_python(_INTERPRETER_AFTER_TRITON)

"""Tree masks in paged attention (speculative decoding's draft trees): every backend against an
explicit float64 oracle that attends each token to its context, its ancestors and itself."""

import pytest
import torch

from pagedspec import kernels
from pagedspec.kernels.testing import make_paged_problem
from pagedspec.kernels.tree_mask import tree_mask_of

BACKENDS = ["torch", "cpu", "triton"]


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


def oracle(problem, scale: float, visible_in_span: list[list[int] | None]) -> torch.Tensor:
    """float64 attention; visible_in_span[i][j]: span tokens token j of span i sees (None:
    causal)."""
    q, k_cache, v_cache = (t.double() for t in problem.args()[:3])
    tables, cu, lens = (t.tolist() for t in problem.args()[3:])
    block = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for i, (table, seq_len) in enumerate(zip(tables, lens, strict=True)):
        q_len = cu[i + 1] - cu[i]
        ctx = seq_len - q_len
        for j in range(q_len):
            span = visible_in_span[i][j] if visible_in_span[i] else range(j + 1)
            pos = [*range(ctx), *(ctx + a for a in span)]
            slots = [table[p // block] * block + p % block for p in pos]
            keys = k_cache.flatten(0, 1)[slots].repeat_interleave(group, 1)  # [L, Hq, D]
            values = v_cache.flatten(0, 1)[slots].repeat_interleave(group, 1)
            scores = torch.einsum("hd,lhd->hl", q[cu[i] + j], keys) * scale
            out[cu[i] + j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out


def ancestors(parents: list[int]) -> list[list[int]]:
    seen: list[list[int]] = []
    for j, parent in enumerate(parents):
        seen.append(sorted({j, *(seen[parent] if parent >= 0 else [])}))
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_spans_beside_causal_spans_match_the_oracle(backend):
    gen = torch.Generator().manual_seed(0)
    trees = {0: random_parents(8, gen), 2: [-1, 0, 0, 1, 1, 2, 0], 3: random_parents(20, gen)}
    q_lens, seq_lens = [8, 1, 7, 20, 5], [40, 33, 7, 50, 17]  # span 2: a tree with no context
    problem = make_paged_problem(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=32,
                                 block_size=16, generator=gen)  # fmt: skip
    mask: list[int] = []
    for i, n in enumerate(q_lens):
        mask += tree_mask_of(trees[i]) if i in trees else [-1] * n  # -1: every bit, causal
    tree_mask = torch.tensor(mask, dtype=torch.int64)
    scale = 32**-0.5
    got = kernels.paged_attention(*problem.args(), scale, backend=backend, tree_mask=tree_mask)
    want = oracle(problem, scale, [ancestors(trees[i]) if i in trees else None for i in range(5)])
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    plan = kernels.plan_paged_attention(
        problem.query, problem.k_cache, *problem.args()[3:], backend=backend, tree_mask=tree_mask
    )
    planned = kernels.paged_attention(*problem.args(), scale, backend=backend, plan=plan)
    if backend != "triton":  # no plan: the mask goes with each call
        torch.testing.assert_close(planned, got, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chain_mask_is_causal_attention(backend):
    gen = torch.Generator().manual_seed(1)
    problem = make_paged_problem([6, 3], [30, 3], num_heads=4, num_kv_heads=4, head_dim=16,
                                 block_size=8, generator=gen)  # fmt: skip
    chain = tree_mask_of([-1, 0, 1, 2, 3, 4]) + tree_mask_of([-1, 0, 1])
    masked = kernels.paged_attention(*problem.args(), 0.25, backend=backend,
                                     tree_mask=torch.tensor(chain))  # fmt: skip
    plain = kernels.paged_attention(*problem.args(), 0.25, backend=backend)
    torch.testing.assert_close(masked, plain, atol=0, rtol=0)


def test_tree_mask_of_checks_its_parents():
    assert tree_mask_of([-1, 0, 0, 1]) == [0b1, 0b11, 0b101, 0b1011]
    assert tree_mask_of(list(range(-1, 63)))[-1] == -1  # all 64 bits: int64's -1
    for bad in ([0], [-1, -1], [-1, 1], [-1, 0, 3]):
        with pytest.raises(ValueError, match="parents"):
            tree_mask_of(bad)
    with pytest.raises(ValueError, match="at most 64"):
        tree_mask_of(list(range(-1, 64)))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tree_mask_of_the_wrong_shape_or_dtype_is_refused(backend):
    problem = make_paged_problem([2], [5], num_heads=2, num_kv_heads=1, head_dim=16,
                                 block_size=4)  # fmt: skip
    for bad in (torch.tensor([1, 3, 3]), torch.tensor([1, 3], dtype=torch.int32)):
        with pytest.raises(ValueError, match="tree_mask must be int64"):
            kernels.paged_attention(*problem.args(), 0.25, backend=backend, tree_mask=bad)

"""A draft tree through the ModelRunner: each node's logits and hidden state are those of a
causal run of its root-to-node path, on every attention backend the CPU runs and through both
the C++ layer stack and the Python layer loop."""

import random

import numpy as np
import pytest
import torch
from conftest import build_random_llama

from pagedspec.engine.loader.model_loader import load_model, model_kv_shape
from pagedspec.engine.worker import spans as spans_mod
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.engine.worker.spans import Span, tree_depths
from pagedspec.memory import allocate_kv_caches

BLOCK = 4
PARENTS = [-1, 0, 1, 2, 0, 0, 1, 4, 7]  # a chain of 4, siblings at depths 1 and 2, a branch


def fresh_runner(model, backend: str) -> ModelRunner:
    caches = allocate_kv_caches(*model_kv_shape(model.config), 16, BLOCK, torch.float32,
                                torch.device("cpu"))  # fmt: skip
    return ModelRunner(model, caches, backend, torch.device("cpu"))


def path_to(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_random_llama(tmp_path_factory.mktemp("tree-llama"), layers=2)
    return load_model(path, device="cpu").model


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("layer_stack", [True, False])
def test_tree_nodes_equal_their_paths_run_causally(model, backend, layer_stack):
    if not layer_stack:
        model.model.layer_stack, saved = None, model.model.layer_stack
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(64, (11,), generator=gen).tolist()
    tree = torch.randint(64, (len(PARENTS),), generator=gen).tolist()
    table = list(reversed(range(16)))
    runner = fresh_runner(model, backend)
    runner.forward([Span(prompt, 0, 0, table)])
    tree_span = Span(tree, len(prompt), len(tree), table, PARENTS)
    plain = Span([5, 6], 0, 2, list(range(8, 16)))  # a causal span beside the tree
    out = runner.forward([tree_span, plain], return_hidden=True, hidden_layers=(0,))
    logits, hidden = out.logits, out.hidden
    try:
        for node in range(len(PARENTS)):
            ref = fresh_runner(model, backend)
            path = [tree[j] for j in path_to(node)]
            want = ref.forward(
                [Span(prompt + path, 0, 1, table)], return_hidden=True, hidden_layers=(0,)
            )
            want_logits, want_hidden = want.logits, want.hidden
            torch.testing.assert_close(logits[node], want_logits[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[node], want_hidden[-1], atol=1e-4, rtol=1e-4)
        alone = (
            fresh_runner(model, backend).forward([Span([5, 6], 0, 2, list(range(8, 16)))]).logits
        )
        torch.testing.assert_close(logits[len(tree) :], alone, atol=1e-4, rtol=1e-4)
    finally:
        if not layer_stack:
            model.model.layer_stack = saved


def test_tree_depths_and_a_span_whose_parents_do_not_fit(model):
    assert tree_depths(PARENTS) == [0, 1, 2, 3, 1, 1, 2, 2, 3]
    runner = fresh_runner(model, "torch")
    with pytest.raises(ValueError, match="3 tokens but 2 parents"):
        runner.forward([Span([1, 2, 3], 0, 1, list(range(4)), [-1, 0])])


def test_small_and_large_steps_pack_alike():
    """A step of a few tokens is packed in plain Python, a larger one with numpy: the same
    values either way (trees, chunks, unwanted logit rows, ragged block tables)."""
    rng = random.Random(0)
    for _ in range(300):
        spans = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, 5)
            start = rng.randint(0, 40)
            table = rng.sample(range(100), -(-(start + n) // 16) + rng.randint(0, 2))
            parents = None
            if n > 1 and rng.random() < 0.3:
                parents = [-1] + [rng.randrange(j) for j in range(1, n)]
            ids = [rng.randrange(50) for _ in range(n)]
            spans.append(Span(ids, start, rng.randint(0, n), table, parents))
        small, large = spans_mod._pack_small(spans, 16), spans_mod._pack_large(spans, 16)
        for name, a, b in zip(small._fields, small, large, strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                assert np.asarray(a).tolist() == np.asarray(b).tolist(), name

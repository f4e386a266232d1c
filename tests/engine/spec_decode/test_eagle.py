"""EAGLE drafting in the engine: the paged head drafts what the reference head computes from the
target's features, greedy output never changes, and rollback rewrites block tables only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_random_eagle_head
from transformers import LlamaForCausalLM

from pagedspec import LLM, SamplingParams
from pagedspec.engine.models.eagle import SHORT_FEED
from pagedspec.engine.models.quant import dequantize_q8_0, quantize_q8_0
from pagedspec.engine.spec_decode.eagle_format import load_head
from pagedspec.engine.tools.train_eagle.head import EagleHead as ReferenceHead
from pagedspec.engine.worker.spans import Span
from pagedspec.kernels import cpu_extension

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "one two three four five one two three",
    "x",
    "Paged attention stores keys and values in fixed-size blocks of memory. " * 2,
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module", params=["eagle1", "eagle3"])
def head(tiny_llama, tmp_path_factory, request) -> str:
    """A random head of each architecture; the eagle3 one fuses the target's layer 0 (of 2)."""
    layers = (0,) if request.param == "eagle3" else ()
    path = tmp_path_factory.mktemp(request.param)
    return build_random_eagle_head(path, tiny_llama, 300, feature_layers=layers)


def head_features(reference: ReferenceHead, hidden_states: tuple[torch.Tensor, ...]):
    """The head's features [L, H] of HF's ``output_hidden_states`` of one sequence: the final
    (post-norm) ones, fused with those after ``feature_layers`` for an eagle3 head."""
    parts = [hidden_states[i + 1] for i in reference.feature_layers] + [hidden_states[-1]]
    return reference.target_features(torch.cat(parts, dim=-1)[0])


def reference_head(path: str) -> ReferenceHead:
    """The training module's head holding the weights the engine's head runs: on the CPU in
    float32 its Linears are int8 (Q8_0), i.e. these values exactly."""
    reference = ReferenceHead.from_dir(path)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize_q8_0(*quantize_q8_0(module.weight)))
    return reference


def eagle(head: str, k: int = 3, leaves: int = 0) -> dict:
    """On in every step and with its tree at every batch size (the defaults are for speed)."""
    return {"method": "eagle", "draft_model": head, "num_speculative_tokens": k,
            "max_draft_skip": 0, "draft_leaves": leaves, "disable_batch_size": 1 << 20,
            "disable_tree_batch_size": 1 << 20}  # fmt: skip


# A tree wide enough that a random head's leaves often hold the target's token.
TREE = 35


def drafted(
    llm: LLM, min_drafts: int, params: SamplingParams | list[SamplingParams] = GREEDY
) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens, its drafts) of every proposal of at least ``min_drafts`` drafts
    while ``llm`` answers two prompts (greedily by default); of a draft tree, its chain."""
    proposer = llm.llm_engine.spec.proposer
    propose, seen = proposer.propose, []

    def recording(scheduled, ks, params, *leaf_slots):
        proposal = propose(scheduled, ks, params, *leaf_slots)
        for i, (s, d) in enumerate(zip(scheduled, proposal.drafts, strict=True)):
            if i in proposal.trees:
                d = d[: proposal.trees[i].chain]
            if len(d) >= min_drafts:
                seen.append((list(s.seq.token_ids), list(d)))
        return proposal

    proposer.propose = recording
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    return seen


def test_paged_head_drafts_what_the_reference_head_computes(tiny_llama, head):
    """k = 1: each draft is argmax lm_head(h_C), h_C from (token_C, feature_{C-1}) over the whole
    context; recomputed here from HF's features and the training module's head."""
    llm = LLM(tiny_llama, num_kv_blocks=64, max_num_batched_tokens=16,
              speculative_config=eagle(head, k=1))  # fmt: skip
    seen = [(tokens, drafts[0]) for tokens, drafts in drafted(llm, min_drafts=1)]
    assert len(seen) > 10
    hf = LlamaForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    reference = reference_head(head)
    d2t = load_head(head)[0]["d2t"]
    with torch.no_grad():
        for tokens, draft in seen:
            ids = torch.tensor([tokens])
            features = head_features(reference, hf(ids, output_hidden_states=True).hidden_states)
            h = reference.unroll(hf.model.embed_tokens(ids), features.unsqueeze(0), 1)[0][0, -1]
            assert draft == int(d2t[reference.lm_head(h).argmax()])


@pytest.mark.parametrize("leaves", [0, 60], ids=["chain", "tree"])
def test_chained_drafts_follow_the_reference_head(tiny_llama, head, leaves):
    """k = 3: draft j + 1 comes from (d_j, h) at position C + j, h being the head's own output at
    C + j - 1, attending to the context's KV (from the target's features) and the chain's own;
    recomputed here by running the training module's head over the growing sequence. With draft
    trees too: after a token from a leaf, the head reads the leaf's features at its position."""
    llm = LLM(tiny_llama, num_kv_blocks=64, speculative_config=eagle(head, k=3, leaves=leaves))
    seen = drafted(llm, min_drafts=2)
    assert len(seen) > 5
    assert (llm.llm_engine.get_stats().num_leaf_tokens > 5) == bool(leaves)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    reference = reference_head(head)
    d2t = load_head(head)[0]["d2t"]
    with torch.no_grad():
        for tokens, drafts in seen:
            # features known before this step: positions 0 .. C - 1 (C = len(tokens) - 1)
            out = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True)
            feats = list(head_features(reference, out.hidden_states))
            seq, expected = list(tokens), []
            for _ in drafts:
                padded = torch.stack(feats + [torch.zeros_like(feats[0])]).unsqueeze(0)
                embeds = hf.model.embed_tokens(torch.tensor([seq]))
                h = reference.unroll(embeds, padded, 1)[0][0, -1]
                expected.append(int(d2t[reference.lm_head(h).argmax()]))
                feats.append(h)  # the feature of the drafted position's predecessor
                seq.append(expected[-1])
            assert drafts == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_kv_blocks=128),
        dict(num_kv_blocks=128, max_num_batched_tokens=9),  # chunked prefill
        dict(num_kv_blocks=12, max_num_batched_tokens=64),  # forced preemption
    ],
    ids=["batch", "chunked", "preempt"],
)
@pytest.mark.parametrize("leaves", [0, TREE], ids=["chain", "tree"])
def test_eagle_greedy_equals_plain_greedy(tiny_llama, head, kwargs, leaves):
    """Also with draft trees: a token from a leaf's row, and the leaf's K/V moved into place
    (later rows read it), give plain greedy's tokens and logprobs."""
    params = dataclasses.replace(GREEDY, logprobs=2)
    plain = LLM(tiny_llama, num_kv_blocks=128).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny_llama, speculative_config=eagle(head, leaves=leaves), **kwargs)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    for got, want in zip(outs, plain, strict=True):
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = llm.llm_engine.get_stats()
    assert stats.num_verifications > 0
    assert stats.num_draft_tokens > (3 if leaves else 0.9) * stats.num_verifications
    if "max_num_batched_tokens" not in kwargs:  # (chunked: 5 leaves fit, and rarely hit)
        assert (stats.num_leaf_tokens > 3) == bool(leaves), stats
    assert stats.num_free_blocks == stats.num_total_blocks
    if kwargs["num_kv_blocks"] == 12:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("leaves", [0, TREE], ids=["chain", "tree"])
def test_eagle_with_prefix_hits_n_and_stop_strings(tiny_llama, head, leaves):
    plain_llm = LLM(tiny_llama, num_kv_blocks=128)
    llm = LLM(tiny_llama, num_kv_blocks=128, speculative_config=eagle(head, leaves=leaves))
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, stop=["fox"])
    for _ in range(2):  # the second round hits the prefix cache
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        want = plain_llm.generate(PROMPTS, params, use_tqdm=False)
        assert [[c.text for c in o.outputs] for o in got] == [
            [c.text for c in o.outputs] for o in want
        ]
    assert llm.llm_engine.get_stats().num_prefix_cache_hit_tokens > 0


def test_a_head_for_another_model_is_rejected(tiny_llama, head, tmp_path):
    from conftest import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", hidden_size=32, num_attention_heads=2,
                             num_key_value_heads=1)  # fmt: skip
    with pytest.raises(ValueError, match="hidden size"):
        LLM(other, num_kv_blocks=16, speculative_config=eagle(head))


def test_a_head_reading_layers_the_target_lacks_is_rejected(tiny_llama, tmp_path):
    head = build_random_eagle_head(tmp_path / "head", tiny_llama, 300, feature_layers=(0, 1))
    with pytest.raises(ValueError, match=r"reads the target's layers \[0, 1\]; this model has 2"):
        LLM(tiny_llama, num_kv_blocks=16, speculative_config=eagle(head))


def test_a_head_fed_late_drafts_what_a_head_fed_every_step_drafts(tiny_llama, head):
    """Speculation is off while two requests run (disable_batch_size 2): the long request feeds
    nothing until its backlog passes max_deferred, then one span; when the short one finishes
    it drafts again after feeding the rest. Its drafts equal those of a head fed every step."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (70, 45)]

    def run(max_deferred: int) -> tuple[list, int]:
        """Every proposal's (tokens, drafts), and how many spans the head ran."""
        llm = LLM(tiny_llama, num_kv_blocks=128,
                  speculative_config=eagle(head) | {"disable_batch_size": 2})  # fmt: skip
        proposer = llm.llm_engine.spec.proposer
        proposer.max_deferred = max_deferred
        forward, spans = proposer.runner.forward, []
        proposer.runner.forward = lambda s, **kw: spans.append(len(s)) or forward(s, **kw)
        seen = drafted(llm, 0, params)
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        return seen, sum(spans)

    late, late_spans = run(max_deferred=32)
    every, every_spans = run(max_deferred=0)
    assert sum(len(d) for _, d in late) > 20
    assert late == every
    assert late_spans < every_spans - 40  # most of the long request's off steps fed nothing


@pytest.mark.skipif(not cpu_extension.available(), reason="the C++ CPU kernels cannot be built")
def test_draft_steps_in_the_layer_stack_give_the_python_paths_bits(tiny_llama, head):
    """A draft step (every span one token, each a logit row) runs the head's layer in the C++
    stack where it applies; its logits and h equal the Python path's bit for bit, step by step
    over two greedy answers (the same drafts, so the same steps)."""

    def run(stack: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """The head's (logits, h) of every forward, and how many ran the stack."""
        config = eagle(head) | {"min_draft_confidence": 0.0}  # chains of k: 2 draft steps each
        llm = LLM(tiny_llama, num_kv_blocks=64, speculative_config=config)
        proposer = llm.llm_engine.spec.proposer
        forward, outputs, ran = proposer.runner.forward, [], []
        layer_stack = proposer.head.layer_stack
        if stack:
            run_stack = layer_stack.run

            def spy(*args):
                out = run_stack(*args)
                ran.append(out is not None)
                return out

            layer_stack.run = spy
        else:
            proposer.head.layer_stack = None

        def recording(spans, **kw):
            out = forward(spans, **kw)
            outputs.append((out.logits, out.hidden))
            return out

        proposer.runner.forward = recording
        drafted(llm, 0)
        return outputs, sum(ran)

    with_stack, ran = run(stack=True)
    python, _ = run(stack=False)
    assert ran > 20
    assert len(with_stack) == len(python)
    for (logits, h), (want_logits, want_h) in zip(with_stack, python, strict=True):
        assert torch.equal(h, want_h) and torch.equal(logits, want_logits)


@pytest.mark.skipif(not cpu_extension.available(), reason="the C++ CPU kernels cannot be built")
def test_short_feeds_in_the_layer_stack_give_the_python_paths_bits(tiny_llama, head):
    """A step of spans of several tokens each, the last a logit row (a round's first: it feeds
    the accepted tokens), runs the whole layer in the C++ stack up to SHORT_FEED tokens; its
    logits, h and every token's K/V equal the Python path's (logit rows only) bit for bit."""
    llm = LLM(tiny_llama, num_kv_blocks=16, speculative_config=eagle(head))
    proposer = llm.llm_engine.spec.proposer
    runner, head_module = proposer.runner, proposer.head
    torch.manual_seed(0)
    for caches in runner.kv_caches:  # earlier positions' K/V that the spans attend to
        for cache in caches:
            cache.normal_()
    before = [tuple(c.clone() for c in caches) for caches in runner.kv_caches]
    spans = [Span([5, 6, 7], 16, 1, [0, 1]), Span([8, 9], 3, 1, [2]), Span([4], 7, 1, [3])]
    assert sum(len(s.token_ids) for s in spans) <= SHORT_FEED
    features = torch.randn(6, head_module.config.hidden_size)
    runs, ran = [], []
    run_stack = head_module.layer_stack.run
    head_module.layer_stack.run = lambda *a: ran.append(1) or run_stack(*a)
    for stack in (True, False):
        for caches, saved in zip(runner.kv_caches, before, strict=True):
            for cache, value in zip(caches, saved, strict=True):
                cache.copy_(value)
        if not stack:
            head_module.layer_stack = None
        out = runner.forward(spans, features=features, return_hidden=True)
        logits, h = out.logits, out.hidden
        runs.append((logits, h, [tuple(c.clone() for c in caches) for caches in runner.kv_caches]))
    assert ran == [1]  # the stack ran the first time only
    (logits, h, kv), (want_logits, want_h, want_kv) = runs
    assert logits.shape[0] == h.shape[0] == 3
    assert torch.equal(h, want_h) and torch.equal(logits, want_logits)
    for caches, want in zip(kv, want_kv, strict=True):
        assert all(torch.equal(c, w) for c, w in zip(caches, want, strict=True))

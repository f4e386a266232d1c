"""Speculative decoding inside the engine: lossless, rolled back by block-table rewrite only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import build_random_eagle_head, build_random_llama, build_tiny_llama
from transformers import LlamaForCausalLM

from pagedspec import LLM, SamplingParams, SpeculativeConfig
from pagedspec.engine.config import METHOD_DEFAULTS
from pagedspec.engine.sample.penalties import TokenHistory
from pagedspec.engine.spec_decode.backoff import DraftBackoff
from pagedspec.engine.spec_decode.chain import chain_drafts, draw_drafts
from pagedspec.engine.spec_decode.draft_state import DraftState
from pagedspec.engine.spec_decode.proposers import NgramProposer, Proposal
from pagedspec.engine.worker.spans import Span

PROMPTS = [
    "one two three four five one two three four five one two three",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\ndef add(a, b):\n",
    "x",
    "Paged attention stores keys and values in fixed-size blocks of memory. " * 3,
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.get_stats().num_free_blocks == engine.block_manager.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return generate(LLM(tiny_llama, num_kv_blocks=128))


# Backoff off: every eligible step drafts, so the lossless tests exercise as many rounds as can be.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "max_draft_skip": 0}


@pytest.fixture(scope="module")
def partial_draft(tiny_llama, tmp_path_factory) -> str:
    """The target's weights plus noise (0.3 x each tensor's std): its greedy drafts agree with
    the target about a quarter of the time, at every draft position. (An unrelated random
    draft is accepted almost never, which leaves the accept path untested.)"""
    return build_random_llama(
        tmp_path_factory.mktemp("partial_draft"), seed=3, like=tiny_llama, noise=0.3
    )


@pytest.fixture(scope="module")
def sharp(tiny_llama, tmp_path_factory) -> tuple[str, str]:
    """(target, draft) for sampled runs: tiny_llama with a 3x sharper LM head (at temperature
    ~1 tiny_llama's top token has only ~5-10% of the mass, so almost no sampled token matches a
    greedy draft), and that target plus noise as its draft."""
    target = build_random_llama(
        tmp_path_factory.mktemp("sharp_target"), like=tiny_llama, head_scale=3.0
    )
    draft = build_random_llama(tmp_path_factory.mktemp("sharp_draft"), seed=3, like=target,
                               noise=0.3)  # fmt: skip
    return target, draft


def draft_spec(draft: str, k: int = 3) -> dict:
    return {"method": "draft", "draft_model": draft, "num_speculative_tokens": k,
            "max_draft_skip": 0}  # fmt: skip


def assert_some_accepted_some_rejected(llm) -> None:
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_kv_blocks=128),
        dict(num_kv_blocks=128, max_num_batched_tokens=9),  # chunked prefill, shrunk lookahead
        dict(num_kv_blocks=14, max_num_batched_tokens=64),  # forced preemption
        dict(num_kv_blocks=14, max_num_batched_tokens=64, max_draft_skip=16),  # default backoff
    ],
    ids=["batch", "chunked", "preempt", "preempt-backoff"],
)
def test_ngram_greedy_equals_plain_greedy(tiny_llama, plain, kwargs):
    kwargs = dict(kwargs)
    spec = {**NGRAM, "max_draft_skip": kwargs.pop("max_draft_skip", 0)}
    llm = LLM(tiny_llama, speculative_config=spec, **kwargs)
    assert generate(llm) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if kwargs["num_kv_blocks"] == 14:
        assert stats.num_preemptions > 0


class _FixedDrafts(NgramProposer):
    """Always drafts k copies of one token: almost never what the model continues with."""

    def __init__(self, token: int):
        super().__init__(1, 1)
        self.token = token

    def propose(self, scheduled, ks, params):
        return Proposal([[self.token] * k for k in ks], [None] * len(ks), {})


def test_backoff_drafts_less_where_drafts_fail_and_changes_no_token(tiny_llama, plain):
    stats = {}
    for skip in (0, 16):
        llm = LLM(tiny_llama, num_kv_blocks=128,
                  speculative_config={**NGRAM, "max_draft_skip": skip})  # fmt: skip
        llm.llm_engine.spec.proposer = _FixedDrafts(token=7)
        assert generate(llm) == plain
        stats[skip] = llm.llm_engine.get_stats()
    assert stats[0].acceptance_rate < 0.2  # the premise: these drafts mostly fail
    # Without backoff every decode step after the first verifies 4 drafts; with it, a failed
    # round skips 1, 2, 4, ... steps: far fewer rounds, and never a different token.
    assert 0 < stats[16].num_verifications < stats[0].num_verifications / 2


def test_draft_backoff_doubles_on_failure_and_resets_on_success():
    backoff = DraftBackoff(max_skip=4)
    state = DraftState()
    assert backoff.should_draft(state, 0)  # a new sequence: draft
    pattern, outputs = [], 0
    for accepted in (0, 0, 0, 0, 2, 0):
        outputs += accepted + 1
        backoff.record(state, accepted, outputs)
        skipped = 0
        while not backoff.should_draft(state, outputs):
            assert backoff.should_draft(state, outputs) is False  # asking changes nothing
            skipped += 1
            outputs += 1  # a plain decode step
        pattern.append(skipped)
    assert pattern == [1, 2, 4, 4, 0, 1]
    other = DraftState()
    assert backoff.should_draft(other, 0)  # per sequence
    backoff.record(other, 0, 1)
    assert not backoff.should_draft(other, 1)
    assert backoff.should_draft(DraftState(), 1)  # preempted: a fresh state drafts again
    assert DraftBackoff(max_skip=0).should_draft(DraftState(), 0)
    with pytest.raises(ValueError, match="max_skip"):
        DraftBackoff(-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_kv_blocks=128, max_num_batched_tokens=32),  # chunked prefill
        dict(num_kv_blocks=14, max_num_batched_tokens=64),  # forced preemption
    ],
    ids=["chunked", "preempt"],
)
def test_draft_model_greedy_equals_plain_greedy(tiny_llama, partial_draft, plain, kwargs):
    llm = LLM(tiny_llama, speculative_config=draft_spec(partial_draft), **kwargs)
    assert generate(llm) == plain
    assert_some_accepted_some_rejected(llm)
    stats = llm.llm_engine.get_stats()
    assert min(stats.accepted_by_position) > 0  # accepted drafts at every position
    assert sum(stats.accepted_by_position) == stats.num_accepted_tokens
    assert stats.accepted_by_position == tuple(sorted(stats.accepted_by_position, reverse=True))
    if kwargs["num_kv_blocks"] == 14:
        assert stats.num_preemptions > 0


def test_draft_confidence_shortens_chains_and_keeps_greedy_output(tiny_llama, partial_draft, plain):
    """min_draft_confidence stops a chain once the product of its drafts' top-1 probabilities
    drops below it (the first draft is always made): 1 keeps one draft a round, 0 every k, a
    middle value chains of several lengths; the output is the same every time."""
    drafts_per_round = []
    for confidence in (0.0, 0.03, 1.0):
        spec = draft_spec(partial_draft, k=4) | {"min_draft_confidence": confidence}
        llm = LLM(tiny_llama, num_kv_blocks=128, speculative_config=spec)
        assert generate(llm) == plain
        stats = llm.llm_engine.get_stats()
        drafts_per_round.append(stats.num_draft_tokens / stats.num_verifications)
    full, middle, one = drafts_per_round
    assert one == 1.0 and full > 3.5, drafts_per_round
    assert 1.2 < middle < full - 0.3, drafts_per_round


def test_the_chain_stop_ends_greedy_and_sampled_chains_alike():
    """chain_drafts with a drafter whose top-1 probability is always 1/2 (confidence 1/2, 1/4,
    1/8, ... after each draft): greedy and sampled requests in one batch stop at the same
    threshold, none past k."""
    top = torch.log(torch.tensor([0.5, 0.25, 0.25]))

    def forward(spans, owners):
        return top.expand(len(spans), 3).clone()

    def draw(logits, rows, grammars):
        return [0] * len(rows), logits.softmax(-1)

    def chain_lengths(stop: float, ks: list[int]) -> list[int]:
        unconstrained = SimpleNamespace(grammar=None)
        seq = [
            SimpleNamespace(seq_id=i, token_ids=[1, 2, 3], num_prompt_tokens=2,
                            owner=unconstrained)
            for i in range(len(ks))
        ]  # fmt: skip
        scheduled = [SimpleNamespace(seq=s, start=2, block_table=[0]) for s in seq]
        spans = [Span([3], 2, 1, [0]) for _ in scheduled]
        written = {s.seq_id: (3, []) for s in seq}
        params = [SamplingParams(temperature=t) for t in (0.0, 0.8, 0.0)]
        drafts, *_ = chain_drafts(scheduled, ks, params, spans, forward, draw, written, stop)
        return [len(d) for d in drafts]

    assert chain_lengths(0.4, [4, 4, 4]) == [2, 2, 2]
    assert chain_lengths(0.2, [4, 4, 4]) == [3, 3, 3]
    assert chain_lengths(0.0, [2, 4, 4]) == [2, 4, 4]


@pytest.mark.parametrize("value", [-0.1, 1.5, "high"])
def test_draft_confidence_out_of_range_is_rejected(value):
    with pytest.raises(ValueError, match=r"min_draft_confidence must be in \[0, 1\]"):
        SpeculativeConfig(min_draft_confidence=value)


PER_METHOD = ("disable_batch_size", "max_draft_skip", "min_draft_confidence", "draft_leaves")


def test_draft_confidence_and_backoff_defaults_per_method():
    """The defaults README and --help quote, filled in from METHOD_DEFAULTS at construction,
    whether a field is left out or passed as None."""
    expected = {
        "ngram": (16, 16, 0.0, 0),
        "draft": (16, 16, 0.0, 0),
        "eagle": (4, 0, 0.2, 3),  # off sooner, no backoff, chains stop, a draft tree
    }
    for method, values in expected.items():
        model = "x" if method == "draft" else None
        left_out = SpeculativeConfig(method, draft_model=model)
        as_none = SpeculativeConfig(method, draft_model=model, **dict.fromkeys(PER_METHOD))
        assert left_out == as_none
        assert tuple(getattr(left_out, name) for name in PER_METHOD) == values, method
        assert dict(zip(PER_METHOD, values, strict=True)) == METHOD_DEFAULTS[method]
    assert type(SpeculativeConfig().min_draft_confidence) is float
    assert SpeculativeConfig("eagle", disable_batch_size=9).disable_batch_size == 9
    explicit = SpeculativeConfig(method="eagle", min_draft_confidence=0, max_draft_skip=4)
    assert explicit.min_draft_confidence == 0.0 and explicit.max_draft_skip == 4
    assert SpeculativeConfig("eagle", min_draft_confidence=0.5).min_draft_confidence == 0.5
    with pytest.raises(ValueError, match="max_draft_skip must be an integer >= 0"):
        SpeculativeConfig(max_draft_skip=-1)
    with pytest.raises(ValueError, match="disable_batch_size must be an integer >= 1"):
        SpeculativeConfig(disable_batch_size=0)
    with pytest.raises(ValueError, match="disable_tree_batch_size must be an integer >= 1"):
        SpeculativeConfig(method="eagle", disable_tree_batch_size=-2)


def test_draft_equal_to_target_accepts_everything(tiny_llama, plain):
    spec = {"method": "draft", "draft_model": tiny_llama, "num_speculative_tokens": 4}
    llm = LLM(tiny_llama, num_kv_blocks=128, speculative_config=spec)
    assert generate(llm) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_accepted_length > 4


def test_draft_model_with_other_vocabulary_is_rejected(tiny_llama, tmp_path):
    other = build_tiny_llama(tmp_path / "other", vocab_size=300)
    spec = {"method": "draft", "draft_model": other}
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_llama, num_kv_blocks=16, speculative_config=spec)


def test_seeded_sampling_with_ngram_speculation_equals_seeded_plain_sampling(sharp):
    """Deterministic drafts verified against per-position seeded samples emit exactly the
    tokens plain seeded sampling emits (top-p and temperature included)."""
    target, _ = sharp
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=30, ignore_eos=True)
    plain = generate(LLM(target, num_kv_blocks=64), params=params)
    llm = LLM(target, num_kv_blocks=64, speculative_config=NGRAM)
    assert generate(llm, params=params) == plain
    assert_some_accepted_some_rejected(llm)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_a_seeded_request_is_reproducible_under_every_proposer(sharp, method, tmp_path):
    """A seeded request gives the tokens of a run without speculation, alone, repeated (a
    prefix-cache hit, which changes what EAGLE drafts) and in a batch where speculation is off:
    a draft model or head drafts the argmax for it (sampled drafts would make its tokens
    depend on what was drafted)."""
    target, draft = sharp
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=30, ignore_eos=True)
    plain = generate(LLM(target, num_kv_blocks=64), PROMPTS[:1], params)[0]
    head = {"method": "eagle", "num_speculative_tokens": 4, "max_draft_skip": 0,
            "draft_model": build_random_eagle_head(tmp_path / "head", target, 300)}  # fmt: skip
    spec = {"ngram": NGRAM, "draft": draft_spec(draft), "eagle": head}[method]
    llm = LLM(target, num_kv_blocks=64, speculative_config=spec | {"disable_batch_size": 4})
    assert generate(llm, PROMPTS[:1], params)[0] == plain
    assert generate(llm, PROMPTS[:1], params)[0] == plain  # its prompt is cached now
    noise = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    busy = llm.generate(PROMPTS, [params, *[noise] * 4], use_tqdm=False)  # 5: speculation off
    assert busy[0].outputs[0].token_ids == plain
    assert llm.llm_engine.get_stats().num_draft_tokens > 0


def test_stop_inside_an_accepted_run_is_cut_exactly(tiny_llama, plain):
    # Stop at a token id that speculation would otherwise run past; the output must end there.
    ref = plain[0]
    stop_id = ref[len(ref) // 2]
    cut = ref.index(stop_id) + 1
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id])
    llm = LLM(tiny_llama, num_kv_blocks=64, speculative_config=NGRAM)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
    text_ref = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text_ref[10:13]
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text_ref[: text_ref.find(stop)] and out.finish_reason == "stop"
    for max_tokens in (1, 2, 7):
        out = llm.generate(
            PROMPTS[0],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
        assert out[0].outputs[0].token_ids == ref[:max_tokens]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_n_and_logprobs_work_with_speculation(sharp, method):
    """n seeded samples at temperature 1 under speculation: distinct samples whose logprobs
    (every entry) are HF's log_softmax at each position; with deterministic (n-gram) drafts
    each sample is also exactly the plain run's sample."""
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, logprobs=2,
                            ignore_eos=True)  # fmt: skip
    target, draft = sharp
    spec = draft_spec(draft) if method == "draft" else NGRAM
    llm = LLM(target, num_kv_blocks=128, speculative_config=spec)
    out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    if method == "draft":
        assert_some_accepted_some_rejected(llm)
    else:
        plain = LLM(target, num_kv_blocks=128).generate(PROMPTS[2], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    hf = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float64).eval()
    prompt = out.prompt_token_ids
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 12
        with torch.no_grad():
            ids = torch.tensor([prompt + c.token_ids[:-1]])
            exact = hf(ids).logits[0, len(prompt) - 1 :].log_softmax(-1)
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            top = exact[j].topk(2).indices.tolist()
            assert entry.keys() == {token, *top}
            for t, lp in entry.items():
                assert lp == pytest.approx(float(exact[j, t]), abs=1e-4)


def test_rollback_touches_no_kv_memory(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, speculative_config=NGRAM)
    engine = llm.llm_engine
    bm = engine.block_manager
    caches = [t for pair in engine.runner.kv_caches for t in pair]
    real_truncate = bm._truncate  # (truncate and the step's keep both go through it)
    calls = []

    def checksum(t):  # over the raw bits: the cache holds uninitialised (even NaN) slots
        return t.data_ptr(), t.view(torch.int32).sum(dtype=torch.int64).item()

    def checked_truncate(seq_id, seq, num_tokens):
        before = [checksum(t) for t in caches]
        real_truncate(seq_id, seq, num_tokens)
        assert before == [checksum(t) for t in caches]
        assert len(bm.block_table(seq_id)) == math.ceil(num_tokens / bm.block_size)
        calls.append(num_tokens)

    bm._truncate = checked_truncate
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    with torch.no_grad():
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                table = bm.block_table(seq.seq_id)
                assert len(table) == math.ceil(seq.num_computed_tokens / bm.block_size)
                assert all(bm.ref_count(b) >= 1 for b in table)
    assert calls and engine.get_stats().num_accepted_tokens > 0


def test_seeded_sampling_is_the_same_with_or_without_speculation_in_any_batch(tiny_llama):
    """Per-position seeded randomness: speculation and batch-mates change nothing."""
    seeded = SamplingParams(temperature=0.3, seed=3, max_tokens=30, ignore_eos=True)
    noise = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    alone = generate(LLM(tiny_llama, num_kv_blocks=128), [PROMPTS[0]], seeded)[0]
    spec = LLM(tiny_llama, num_kv_blocks=128, speculative_config=NGRAM)
    assert generate(spec, [PROMPTS[0]], seeded)[0] == alone
    busy = spec.generate(PROMPTS, [noise, noise, seeded, noise, noise], use_tqdm=False)
    assert busy[2].outputs[0].token_ids == generate(spec, [PROMPTS[2]], seeded)[0]
    assert spec.llm_engine.get_stats().num_accepted_tokens > 0


def test_sampled_drafts_from_a_draft_equal_to_the_target_are_all_accepted(tiny_llama):
    """At temperature > 0 a draft model samples from q and verification accepts with
    min(1, p/q): with q = p every draft passes (greedy drafts would pass only with p(argmax))."""
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=24, ignore_eos=True)
    rates = {}
    for sample in (True, False):
        spec = {**draft_spec(tiny_llama, k=4), "disable_batch_size": 64, "sample_drafts": sample}
        llm = LLM(tiny_llama, num_kv_blocks=128, speculative_config=spec)
        generate(llm, params=params)
        stats = llm.llm_engine.get_stats()
        assert stats.num_draft_tokens > 20
        rates[sample] = stats.acceptance_rate
    assert rates[True] > 0.99 and rates[False] < 0.9  # greedy drafts: accepted with p(argmax)


def test_greedy_drafts_are_the_argmax_of_the_penalised_logits():
    """A greedy draft is the argmax after the request's penalties (what the target's greedy
    sample will be), with no q: verification of greedy drafts reads none. A sampled row in the
    batch brings q, one-hot on the greedy rows."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    penalised = SamplingParams(temperature=0, repetition_penalty=4.0)  # 3.0 -> 0.75 for id 1
    rows = [
        (TokenHistory(penalised, [1], 1), 1),
        (TokenHistory(SamplingParams(temperature=0), [1], 1), 1),
    ]
    generator = torch.Generator().manual_seed(0)
    ids, q = draw_drafts(logits, rows, generator)
    assert ids.tolist() == [2, 1] and q is None
    sampled = (TokenHistory(SamplingParams(temperature=1.0), [1], 1), 1)
    ids, q = draw_drafts(logits, [rows[0], sampled], generator)
    assert ids[0] == 2 and q[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert torch.allclose(q[1], torch.softmax(logits[1], -1))

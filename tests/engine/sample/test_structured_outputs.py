"""Structured outputs: constraints as vLLM names them, their errors, and outputs that match them
with and without speculation (the exact law under speculation: test_spec_distribution.py)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import build_random_eagle_head

from pagedspec import LLM, SamplingParams, StructuredOutputsParams

CHOICES = ["yes", "no", "not sure"]
REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "k": {"enum": ["x", "y"]},
    },
    "required": ["n", "k"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "choice": StructuredOutputsParams(choice=CHOICES),
    "regex": StructuredOutputsParams(regex=REGEX),
    "json": StructuredOutputsParams(json=SCHEMA),
}
PROMPTS = ["The quick brown fox", "one two three one two three one two", "x"]


def matches(kind: str, text: str) -> bool:
    if kind == "choice":
        return text in CHOICES
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text)
    return set(value) == {"n", "k"} and 0 <= value["n"] <= 99 and value["k"] in ("x", "y")


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, num_kv_blocks=128)


def generate(llm: LLM, kind: str, temperature: float, n: int = 1, **extra) -> list:
    params = SamplingParams(n=n, temperature=temperature, max_tokens=40, seed=7,
                            structured_outputs=CONSTRAINTS[kind], **extra)  # fmt: skip
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.get_stats().num_free_blocks == engine.block_manager.num_blocks
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_constraint_and_end_where_it_may(llm, kind, temperature):
    for c in generate(llm, kind, temperature, n=2):
        assert c.finish_reason == "stop" and matches(kind, c.text), c  # EOS once complete


def test_exactly_one_constraint_with_the_fields_named():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"schema": {}})
    as_dict = SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs
    assert as_dict == StructuredOutputsParams(regex="a+")


@pytest.mark.parametrize(
    ("constraint", "field"),
    [({"regex": "[0-9"}, "regex"), ({"json": '{"type": "objekt"}'}, "json"),
     ({"grammar": "start: ::"}, "grammar"), ({"json": "{not json"}, "json")],
)  # fmt: skip
def test_a_constraint_that_does_not_compile_is_refused_before_it_runs(llm, constraint, field):
    engine = llm.llm_engine
    engine.add_request("ok", "x", SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}: "):
        engine.add_request("bad", "x", SamplingParams(structured_outputs=constraint))
    while engine.has_unfinished_requests():
        engine.step()
    assert "bad" not in engine.requests
    assert engine.get_stats().num_free_blocks == engine.block_manager.num_blocks


def test_a_model_without_a_tokenizer_refuses_constraints(tmp_path):
    from conftest import build_random_llama

    llm = LLM(build_random_llama(tmp_path, vocab_size=16), num_kv_blocks=8)
    with pytest.raises(ValueError, match="structured_outputs needs a model with a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(structured_outputs={"regex": "a"}), use_tqdm=False)


def test_logprobs_stay_those_of_the_raw_logits(llm):
    """The mask changes what is sampled, not the logprobs reported for it."""
    vocab = llm.llm_engine.vocab_size
    raw = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=1, logprobs=vocab),
                       use_tqdm=False)[0].outputs[0].logprobs[0]  # fmt: skip
    (c,) = generate(llm, "regex", 0.0, logprobs=2)[2:3]  # the prompt "x"
    first = c.token_ids[0]
    assert c.logprobs[0][first] == pytest.approx(raw[first], abs=1e-5)
    assert max(raw, key=raw.get) != first  # the constraint moved the argmax


@pytest.fixture(scope="module")
def proposers(tiny_llama, tmp_path_factory) -> dict[str, dict]:
    # a draft vocabulary of ids 0, 2, .. 198: its masks come from the target vocabulary's
    head = build_random_eagle_head(tmp_path_factory.mktemp("so_head"), tiny_llama, 100)
    common = {"num_speculative_tokens": 4, "max_draft_skip": 0, "disable_batch_size": 100}
    return {
        "ngram": {"method": "ngram"} | common,
        "draft": {"method": "draft", "draft_model": tiny_llama} | common,
        "eagle": {"method": "eagle", "draft_model": head} | common,
    }


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_greedy_constrained_tokens_are_the_same_under_every_proposer(
    llm, tiny_llama, proposers, method
):
    spec = LLM(tiny_llama, num_kv_blocks=128, speculative_config=proposers[method])
    for kind in CONSTRAINTS:
        plain = [c.token_ids for c in generate(llm, kind, 0.0)]
        assert [c.token_ids for c in generate(spec, kind, 0.0)] == plain
    stats = spec.llm_engine.get_stats()
    assert stats.num_draft_tokens > 0
    if method == "draft":  # the target drafting for itself: every masked draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_preempted_constrained_request_resumes_where_its_grammar_was(tiny_llama):
    """KV for two sequences at most: requests are preempted and recomputed; the matcher stands
    at the committed tokens throughout, so every answer matches and equals its answer alone."""
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=CONSTRAINTS["json"])
    alone = LLM(tiny_llama, num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    tight = LLM(tiny_llama, num_kv_blocks=8, block_size=16)
    outs = tight.generate(PROMPTS * 2, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions > 0
    for out, ref in zip(outs, alone * 2, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert matches("json", out.outputs[0].text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_constraint_wins_over_min_tokens_and_stop_token_bans(llm, temperature):
    """min_tokens past where the constraint is complete (it allows only EOS there) and a
    stop token it needs: the answer still matches, and ends where the constraint does."""
    eos = llm.llm_engine.outputs.eos_token_ids
    params = SamplingParams(temperature=temperature, max_tokens=30, min_tokens=12, seed=2,
                            structured_outputs=CONSTRAINTS["choice"])  # fmt: skip
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        assert out.error is None and matches("choice", c.text), c
        assert c.finish_reason in ("stop", "length")
        assert all(t in eos for t in c.token_ids[len(c.token_ids) - 1 :])  # only EOS once complete


def test_a_matcher_walks_past_the_eos_that_ends_a_complete_constraint(llm):
    """Verification may emit a constraint's last token and then EOS (a draft-tree leaf's row
    follows both): a copy walks past them; anything else after the end is refused."""
    from pagedspec.engine.sample.grammar import advanced

    engine = llm.llm_engine
    eos = engine.outputs.eos_token_ids
    matcher = engine.processor.grammars.matcher(StructuredOutputsParams(choice=["yes"]))
    done = engine.tokenizer.encode("yes", add_special_tokens=False)
    assert advanced(matcher, [*done, min(eos)], eos).is_stopped()
    with pytest.raises(RuntimeError, match="left its grammar"):
        advanced(matcher, [*done, done[0]], eos)

"""Regression tests for bugs found in the review of the engine loop, scheduler and speculation."""

from __future__ import annotations

import pytest
import torch

from pagedspec import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedspec.engine.sample import sample_jobs
from pagedspec.engine.sample.sample_jobs import SampleJob
from pagedspec.engine.worker.model_runner import ForwardOutput

GREEDY = SamplingParams(temperature=0)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
REPETITIVE = "one two three one two three one two three one two"


def test_seeded_request_under_speculation_does_not_depend_on_batch_composition(tiny_llama):
    # A seeded request's tokens must not change because another request in the batch has
    # drafts (FIELD-NOTES: "seeded outputs changed with batch composition").
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    alone = LLM(tiny_llama, num_kv_blocks=64, speculative_config=NGRAM)
    expected = alone.generate("x", seeded, use_tqdm=False)[0].outputs[0].token_ids

    busy = LLM(tiny_llama, num_kv_blocks=64, speculative_config=NGRAM)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = busy.generate(["x", REPETITIVE], [seeded, greedy], use_tqdm=False)
    assert busy.llm_engine.get_stats().num_draft_tokens > 0  # the neighbour did speculate
    assert outs[0].outputs[0].token_ids == expected


def _run_beside_a_good_request(tiny_llama, bad: SamplingParams, field: str) -> None:
    """A bad request is either rejected with a ValueError naming `field`, or it runs; either
    way the step loop must not crash and the good request must finish."""
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=32))
    engine.add_request("ok", "one two", SamplingParams(temperature=0, max_tokens=4))
    try:
        engine.add_request("bad", "one", bad)
    except ValueError as err:
        assert field in str(err)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done["ok"].outputs[0].token_ids) == 4
    assert engine.get_stats().num_free_blocks == 32


def test_out_of_vocab_stop_token_id_with_min_tokens_does_not_crash_the_step(tiny_llama):
    vocab = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=8)).vocab_size
    bad = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[vocab + 88])
    _run_beside_a_good_request(tiny_llama, bad, "stop_token_ids")


def test_logprobs_above_vocab_size_do_not_crash_the_step(tiny_llama):
    vocab = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=8)).vocab_size
    bad = SamplingParams(max_tokens=2, logprobs=vocab + 1)
    _run_beside_a_good_request(tiny_llama, bad, "logprobs")


def test_finished_text_keeps_text_held_back_for_an_incomplete_character(tiny_llama):
    # A token like " na\xc3" (byte-level BPE: text + the lead byte of a multi-byte character)
    # is held back by the incremental detokenizer. When the request finishes there, the held
    # text (" na" included) must not vanish: final text == tokenizer.decode(output tokens).
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=32))
    tok = engine.tokenizer
    token = next(
        t
        for t in range(3, engine.vocab_size)
        if (s := tok.decode([t])).endswith("\ufffd") and s.rstrip("\ufffd").strip()
    )
    forward = engine.runner.forward

    def forced(spans, **options):  # the model always prefers `token`
        logits = forward(spans, **options).logits.clone()
        logits[:, token] += 1e4
        return ForwardOutput(logits)

    engine.runner.forward = forced
    engine.add_request("r", "one two", SamplingParams(temperature=0, max_tokens=2))
    final = None
    while engine.has_unfinished_requests():
        final = engine.step()[-1]
    comp = final.outputs[0]
    assert comp.token_ids == [token, token]
    assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)


@pytest.fixture(autouse=True)
def _fast_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: stay light
    yield
    torch.set_num_threads(threads)


def test_logit_rows_back_to_back_are_viewed_not_copied(gen):
    """Jobs whose rows lie in order are sampled from a view of the logits; a fork (the same
    rows twice) or a gap gathers them."""
    logits = torch.randn(6, 10, generator=gen)

    def jobs(*rows_and_drafts):
        return [SampleJob(GREEDY, 0, 1, [1], row, [0] * d) for row, d in rows_and_drafts]

    got = sample_jobs.gather_rows(logits, jobs((0, 0), (1, 1), (3, 0)))
    assert torch.equal(got, logits[:4]) and got.data_ptr() == logits.data_ptr()
    for spec, rows in (
        (((0, 0), (0, 0)), [0, 0]),  # a fork: the same rows twice
        (((0, 0), (2, 0)), [0, 2]),  # a gap
    ):
        assert torch.equal(sample_jobs.gather_rows(logits, jobs(*spec)), logits[rows])


def test_seeded_samples_of_one_request_are_those_of_a_run_without_speculation(tiny_llama):
    """n = 2 seeded samples with a draft model: each sample's tokens are its own seeded
    samples (drafted from one seed, the two once agreed on tokens 2-5 wherever their first
    tokens agreed), the same as without speculation."""
    draft = {"method": "draft", "draft_model": tiny_llama, "num_speculative_tokens": 4,
             "max_draft_skip": 0, "disable_batch_size": 1000}  # fmt: skip
    params = [SamplingParams(n=2, temperature=1.0, top_k=2, seed=seed, max_tokens=6,
                             ignore_eos=True) for seed in range(20)]  # fmt: skip
    runs = []
    for spec in (None, draft):
        llm = LLM(tiny_llama, num_kv_blocks=256, speculative_config=spec)
        outs = llm.generate(["one two three"] * 20, params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
    assert llm.llm_engine.get_stats().num_accepted_tokens > 20
    assert runs[1] == runs[0]
    assert sum(a[1:5] != b[1:5] for a, b in runs[0]) >= 5  # the samples are independent

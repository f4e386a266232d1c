"""The engine step: a failed step harms no one, and what each owner of the step guarantees
(private params, stop-string hold-back, stop-token text, raw logprobs, prefix registration on
a prefill-only request, draft KV that never touches a registered block)."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
from conftest import engine_for

from pagedspec import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paged attention stores", "one two three four", "def add(a, b):"]


def run(engine: LLMEngine, requests: dict, late: dict | None = None, at_step: int = 2):
    """Drive the engine to the end; ``late`` requests join after ``at_step`` steps."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == at_step:
            for rid, (prompt, params) in (late or {}).items():
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
    bm = engine.block_manager
    assert bm.num_free_blocks() == bm.num_blocks  # nothing leaked
    return final


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    outs = run(engine_for(tiny_llama), {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    return {rid: o.outputs[0].token_ids for rid, o in outs.items()}


def _check_others(final, baseline, culprit):
    assert final[culprit].finished and final[culprit].outputs[0].finish_reason == "abort"
    assert "injected" in final[culprit].error
    for rid, tokens in baseline.items():
        assert final[rid].error is None
        assert final[rid].outputs[0].token_ids == tokens


def test_a_sampler_failure_aborts_only_its_request(tiny_llama, baseline):
    engine = engine_for(tiny_llama)
    sample = engine.step_sampler.sampler.__call__

    def failing(logits, batch):
        if (batch.temperature == 0.5).any():
            raise RuntimeError("injected sampler failure")
        return sample(logits, batch)

    engine.step_sampler.sampler = failing
    bad = SamplingParams(temperature=0.5, max_tokens=12)
    final = run(
        engine,
        {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)},
        late={"bad": ("x y z", bad)},
    )
    _check_others(final, baseline, "bad")


def test_a_model_failure_mid_batch_aborts_only_its_request(tiny_llama, baseline):
    engine = engine_for(tiny_llama)
    marker = 511  # a token id only the bad prompt holds
    forward = engine.runner.model.forward

    def failing(input_ids, *args):
        if (input_ids == marker).any():
            raise RuntimeError("injected kernel error")
        return forward(input_ids, *args)

    engine.runner.model.forward = failing
    final = run(
        engine,
        {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)},
        late={"bad": ([5, 6, marker], GREEDY)},
        at_step=3,
    )
    _check_others(final, baseline, "bad")


def test_a_commit_failure_on_a_finishing_step_aborts_its_request_and_frees_its_blocks(
    tiny_llama, baseline
):
    """The sample finished (max_tokens) before its commit failed: it must still be retired."""
    engine = engine_for(tiny_llama)
    commit = engine.spec.commit

    def failing(round, verified, i, record, *args):
        if record.request.request_id == "bad" and record.finished:
            raise RuntimeError("injected commit failure")
        return commit(round, verified, i, record, *args)

    engine.spec.commit = failing
    final = run(
        engine,
        {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)},
        late={"bad": ("x y z", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))},
    )
    _check_others(final, baseline, "bad")
    assert not engine.scheduler.has_unfinished()


def test_corrupted_params_abort_their_request_and_the_engine_keeps_serving(tiny_llama, baseline):
    engine = engine_for(tiny_llama)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    engine.add_request("bad", "x y z", SamplingParams(temperature=0.8, max_tokens=12))
    engine.step()
    engine.requests["bad"].params.top_p = 7.0  # got past validation somehow
    final = run(engine, {})
    assert final["bad"].outputs[0].finish_reason == "abort" and "top_p" in final["bad"].error
    for rid, tokens in baseline.items():
        assert final[rid].outputs[0].token_ids == tokens


def test_a_failure_nobody_causes_alone_moves_no_sequence(tiny_llama, baseline):
    engine = engine_for(tiny_llama)
    forward, calls = engine.runner.forward, []

    def flaky(spans, **options):
        calls.append(len(spans))
        if len(calls) == 3:
            raise RuntimeError("injected transient failure")
        return forward(spans, **options)

    engine.runner.forward = flaky
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    engine.step(), engine.step()
    before = {rid: list(r.samples[0].seq.token_ids) for rid, r in engine.requests.items()}
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()
    assert {rid: r.samples[0].seq.token_ids for rid, r in engine.requests.items()} == before
    final = run(engine, {})
    assert {rid: o.outputs[0].token_ids for rid, o in final.items()} == baseline


def test_changing_params_after_add_request_changes_nothing(tiny_llama):
    engine = engine_for(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", "The quick brown fox", params)
    params.max_tokens = 2
    params.temperature = 1.0
    assert len(run(engine, {})["r"].outputs[0].token_ids) == 6


def test_prompt_dicts_and_numpy_token_ids(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    ids = llm.tokenizer.encode("The quick brown fox")
    engine = llm.llm_engine
    final = run(
        engine,
        {
            "text": ({"prompt": "The quick brown fox"}, GREEDY),
            "ids": ({"prompt_token_ids": ids}, GREEDY),
            "numpy": (np.array(ids, dtype=np.int64), GREEDY),
            "numpy-list": ([np.int32(t) for t in ids], GREEDY),
        },
    )
    assert final["text"].prompt == "The quick brown fox" and final["ids"].prompt is None
    assert len({tuple(o.outputs[0].token_ids) for o in final.values()}) == 1
    for bad in ({"prompt": "a", "x": 1}, {"prompt_token_ids": "abc"}, [1.5, 2], np.ones((2, 2))):
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request("bad", bad, GREEDY)
    assert not engine.has_unfinished_requests()


def test_streamed_text_only_grows_when_a_stop_string_spans_tokens(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    prompt = "one two three four"
    full = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    tok = llm.tokenizer
    # a stop string that starts inside one token and ends inside a later one
    cut = len(tok.decode(full.token_ids[:4]))
    stop = full.text[cut - 2 : cut + 3]
    assert stop and full.text.find(stop) == cut - 2
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=12, stop=stop))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts[-1] == full.text[: cut - 2]
    for shorter, longer in zip(texts, texts[1:], strict=False):
        assert longer.startswith(shorter)


def test_stop_token_text_is_dropped_unless_asked_for(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    full = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    at = next(i for i, t in enumerate(full.token_ids) if i and t not in full.token_ids[:i])
    stop_id = full.token_ids[at]
    tok = llm.tokenizer
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop_id],
            include_stop_str_in_output=include,
        )  # fmt: skip
        out = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[: at + 1] and out.stop_reason == stop_id
        assert out.text == tok.decode(full.token_ids[: at + 1 if include else at])


def test_min_tokens_does_not_change_logprobs(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    first = llm.generate("The quick brown fox", plain, use_tqdm=False)[0].outputs[0]
    banned = first.token_ids[0]
    masked = SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logprobs=5,
        min_tokens=3, stop_token_ids=[banned],
    )  # fmt: skip
    out = llm.generate("The quick brown fox", masked, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != banned  # the mask changed what was sampled ...
    assert out.logprobs[0][banned] == pytest.approx(first.logprobs[0][banned], abs=1e-6)
    assert out.logprobs[0].keys() >= first.logprobs[0].keys() - {banned}  # ... not the law


def test_a_prefill_only_request_registers_its_prompt_for_prefix_caching(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    prompt = "Paged attention stores keys and values in fixed-size blocks of memory. " * 2
    once = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt, once, use_tqdm=False)
    llm.generate(prompt + "more", once, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_prefix_cache_hit_tokens >= 16


def test_draft_model_never_writes_a_registered_block_and_prefills_in_chunks(tiny_llama):
    # The target as its own draft: every draft is accepted iff the draft's KV is right,
    # through chunked prefill and prefix-cache hits that the draft never recomputed.
    spec = {"method": "draft", "draft_model": tiny_llama, "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, num_kv_blocks=64, max_num_batched_tokens=16, speculative_config=spec)
    engine = llm.llm_engine
    runner = engine.spec.proposer.runner
    forward, block_size = runner.forward, engine.block_manager.block_size
    pool = engine.block_manager._pool
    largest = []

    def checked(spans, **options):
        largest.append(sum(len(s.token_ids) for s in spans))
        for s in spans:
            for pos in range(s.start, s.start + len(s.token_ids)):
                assert not pool.is_registered(s.block_table[pos // block_size])
        return forward(spans, **options)

    runner.forward = checked
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate([prompt, prompt + "The"], params, use_tqdm=False)
    assert engine.get_stats().acceptance_rate == 1.0
    again = llm.generate([prompt + "The"], params, use_tqdm=False)
    stats = engine.get_stats()
    assert stats.num_prefix_cache_hit_tokens > 0 and stats.acceptance_rate == 1.0
    assert again[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    # the draft's prefill is chunked like the target's: a step's draft tokens stay within the
    # budget plus one catch-up token per sequence
    assert max(largest) <= 16 + 2


def test_an_abort_output_survives_a_step_that_raises(tiny_llama, baseline):
    """An abort's final output is handed out by the next step; if that step raises (a failure
    no request causes alone), the step after it still hands it out."""
    engine = engine_for(tiny_llama)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.abort_request("0")
    forward = engine.runner.forward

    def batch_fails(spans, **options):
        if len(spans) > 1:
            raise RuntimeError("injected transient failure")
        return forward(spans, **options)

    engine.runner.forward = batch_fails
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()
    engine.runner.forward = forward
    final = run(engine, {})
    assert final["0"].outputs[0].finish_reason == "abort"
    assert {rid: o.outputs[0].token_ids for rid, o in final.items() if rid != "0"} == {
        rid: tokens for rid, tokens in baseline.items() if rid != "0"
    }


def test_a_request_of_n_samples_holds_n_seats_once_forked(tiny_llama):
    """max_num_seqs counts sequences: a prompt holds n seats for its forks, and once forked
    its n samples hold n, so a new request takes the seat left."""
    engine = engine_for(tiny_llama, max_num_seqs=3)
    engine.add_request("n2", "one two three", SamplingParams(n=2, max_tokens=12, ignore_eos=True))
    engine.step()  # the prompt is done: two samples run
    engine.add_request("late", "four five", GREEDY)
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (3, 0)
    run(engine, {})


def test_a_step_runs_with_the_cycle_collector_paused(tiny_llama):
    """pagedspec.engine.core.gc_pause: the collector is off inside a step (so it never walks the
    step's live objects), back on when the step returns or raises, and left off where the caller had
    it off."""
    engine = engine_for(tiny_llama)
    forward, seen = engine.runner.forward, []

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        if len(seen) == 3:
            raise KeyboardInterrupt  # not a request's fault: the step raises
        return forward(*args, **kwargs)

    engine.runner.forward = watched
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        engine.step()
        assert seen == [False, False] and not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert seen == [False, False, False] and gc.isenabled()
    engine.step()  # the interrupted step runs again
    assert len(seen) == 4


def test_a_step_without_speculation_never_imports_spec_decode(tiny_llama):
    """The plain step lives below ``spec_decode`` (``pagedspec.engine.sample.round``): an
    engine without speculation runs prompts, forks and sampled decodes without loading it;
    with speculation it does."""
    code = (
        "import sys\n"
        "from pagedspec import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], num_kv_blocks=64, **eval(sys.argv[2]))\n"
        "llm.generate(['The quick brown fox'], SamplingParams(n=2, temperature=0.8, seed=1,\n"
        "             max_tokens=6), use_tqdm=False)\n"
        "print(any(m.startswith('pagedspec.engine.spec_decode') for m in sys.modules))\n"
    )
    for options, loaded in (
        ("{}", "False"),
        ("{'speculative_config': {'method': 'ngram'}}", "True"),
    ):
        out = subprocess.run([sys.executable, "-c", code, tiny_llama, options],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == loaded, options

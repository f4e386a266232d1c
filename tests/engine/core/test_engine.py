"""The engine loop end to end on a tiny random model: scheduling never changes results, stop
conditions are exact, bad input is rejected without harming other requests, no block leaks."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedspec import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedspec.engine.config import SCHEDULING_POLICIES
from pagedspec.scheduler.scheduler import POLICIES

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks of memory. Speculative",
    "one two three",
    "def add(a, b):\n    return",
    "Café, naïve, jalapeño",
    "x",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_free_blocks == llm.llm_engine.block_manager.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """HF transformers greedy decoding, one prompt at a time."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def test_greedy_matches_hf_transformers(tiny_llama, reference):
    assert run(LLM(tiny_llama, num_kv_blocks=128)) == reference


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_seqs=1),  # one at a time
        dict(max_num_batched_tokens=7),  # forced chunked prefill
        dict(enable_prefix_caching=False),
        dict(block_size=32),
    ],
    ids=["serial", "chunked", "no-prefix-cache", "block32"],
)
def test_batch_composition_never_changes_greedy_output(tiny_llama, reference, kwargs):
    assert run(LLM(tiny_llama, num_kv_blocks=128, **kwargs)) == reference


def test_reverse_order(tiny_llama, reference):
    assert run(LLM(tiny_llama, num_kv_blocks=128), PROMPTS[::-1]) == reference[::-1]


def test_forced_preemption_gives_the_same_tokens(tiny_llama, reference):
    llm = LLM(tiny_llama, num_kv_blocks=8, max_num_batched_tokens=32)
    assert run(llm) == reference
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_prefix_cache_hits_on_a_shared_system_prompt(tiny_llama):
    system = "Paged attention stores keys and values in fixed-size blocks of memory. " * 4
    prompts = [system + q for q in ("one two", "three four", "five six")]
    cached = LLM(tiny_llama, num_kv_blocks=128, max_num_seqs=1)
    plain = LLM(tiny_llama, num_kv_blocks=128, max_num_seqs=1, enable_prefix_caching=False)
    assert run(cached, prompts) == run(plain, prompts)
    ids = [cached.tokenizer.encode(p) for p in prompts]
    common = next(i for i, col in enumerate(zip(*ids, strict=False)) if len(set(col)) > 1)
    assert common >= 32
    expected = 2 * (common // 16 * 16)  # the 2nd and 3rd prompts reuse the full shared blocks
    assert cached.llm_engine.get_stats().num_prefix_cache_hit_tokens == expected
    assert plain.llm_engine.get_stats().num_prefix_cache_hit_tokens == 0


def test_streaming_steps_and_text_equal_full_decode(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64))
    tok = engine.tokenizer
    engine.add_request("a", PROMPTS[4], SamplingParams(temperature=0.8, seed=3, max_tokens=40))
    lengths, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
            final = out
    assert lengths == sorted(lengths) and final.finished
    comp = final.outputs[0]
    assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True) or (
        tok.decode(final.prompt_token_ids + comp.token_ids, skip_special_tokens=True)
        == tok.decode(final.prompt_token_ids, skip_special_tokens=True) + comp.text
    )


def test_stop_string_spanning_tokens_is_cut_exactly(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[5:9]  # four characters that cross a token boundary somewhere in the text
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < len(free[0].outputs[0].token_ids)


def test_stop_token_ids_and_min_tokens(tiny_llama, reference):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    ref = reference[0]
    stop_id = ref[3]
    first = ref.index(stop_id)
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    comp = out[0].outputs[0]
    assert comp.token_ids == ref[: first + 1] and comp.finish_reason == "stop"
    # min_tokens forbids the stop token until enough tokens are out
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(
            temperature=0, max_tokens=24, min_tokens=first + 2, stop_token_ids=[stop_id]
        ),
        use_tqdm=False,
    )
    comp = out[0].outputs[0]
    assert len(comp.token_ids) >= first + 2
    assert stop_id not in comp.token_ids[: first + 1]


def test_eos_stops_unless_ignored(tiny_llama, reference, tmp_path):
    """The same weights with EOS declared to be a token the model emits greedily."""
    import json
    import shutil

    eos_dir = tmp_path / "eos"
    shutil.copytree(tiny_llama, eos_dir)
    ref = reference[0]
    eos = ref[4]
    config = json.loads((eos_dir / "config.json").read_text())
    config["eos_token_id"] = eos
    (eos_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(eos_dir), num_kv_blocks=64)
    comp = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert comp.token_ids == ref[: ref.index(eos) + 1] and comp.finish_reason == "stop"
    comp = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert comp.token_ids == ref and comp.finish_reason == "length"


def test_n_samples_are_reproducible_and_different(tiny_llama):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    a = LLM(tiny_llama, num_kv_blocks=64).generate(PROMPTS[0], params, use_tqdm=False)[0]
    b = LLM(tiny_llama, num_kv_blocks=64).generate(PROMPTS[0], params, use_tqdm=False)[0]
    ids_a = [c.token_ids for c in a.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert ids_a == [c.token_ids for c in b.outputs]
    assert len({tuple(x) for x in ids_a}) == 3


def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(tiny_llama):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    alone = LLM(tiny_llama, num_kv_blocks=128).generate(PROMPTS[1], seeded, use_tqdm=False)
    busy_llm = LLM(tiny_llama, num_kv_blocks=128, seed=5)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = busy_llm.generate(PROMPTS, [noise, seeded, noise, noise, noise, noise], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_logprobs_match_log_softmax(tiny_llama):
    """Each reported logprob equals HF transformers' log_softmax (float64) of the next-token
    logits at that position; the entry holds the sampled token and the top 3."""
    llm = LLM(tiny_llama, num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float64).eval()
    for params in (
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=3, ignore_eos=True),
    ):
        out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
        comp = out.outputs[0]
        assert len(comp.logprobs) == len(comp.token_ids) == 8
        ids = out.prompt_token_ids + comp.token_ids[:-1]
        with torch.no_grad():
            exact = hf(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 :]
        exact = exact.log_softmax(-1)
        for j, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            top = set(exact[j].topk(3).indices.tolist())
            assert token in entry and set(entry) == top | {token}
            for t, lp in entry.items():  # vLLM's Logprob, and the logprob as a float
                assert lp == pytest.approx(float(exact[j, t]), abs=1e-4), (j, t)
                assert lp.logprob == float(lp) and lp.decoded_token == llm.tokenizer.decode([t])
                assert lp.rank == 1 + int((exact[j] > exact[j, t] + 1e-9).sum())
            assert copy.deepcopy(entry) == entry and pickle.loads(pickle.dumps(entry))[t].rank
            if params.temperature == 0:
                assert token == int(exact[j].argmax())
        path = sum(float(exact[j, t]) for j, t in enumerate(comp.token_ids))
        assert comp.cumulative_logprob == pytest.approx(path, abs=1e-3)
    plain = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None  # no logprobs asked for


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ([5] * 600, None, "max_model_len"),
        ([1, 2, 10_000], None, "token ids"),
        ([1, -1], None, "token ids"),
        ("hi", "not params", "SamplingParams"),
        ("hi", SamplingParams(max_tokens=2000), "KV blocks"),
    ],
)
def test_bad_requests_raise_and_harm_nobody(tiny_llama, prompt, params, match):
    # 20 blocks of 16 hold 320 tokens: less than max_model_len (512)
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=20))
    engine.add_request("ok", "one two", SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "x")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(3, "x")
    assert engine.abort_request("nope") is False
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out
    assert done.request_id == "ok" and len(done.outputs[0].token_ids) == 8
    assert engine.get_stats().num_free_blocks == 20


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2),
        dict(n=0),
        dict(max_tokens=0),
        dict(min_tokens=5, max_tokens=2),
        dict(stop=[""]),
        dict(stop_token_ids=[-3]),
        dict(logprobs=-1),
        dict(seed=-1),
        dict(temperature="hot"),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(top_p=float("inf")),
        dict(top_p=float("nan")),
        dict(min_p=float("inf")),
        dict(min_p=float("nan")),
        dict(top_k=-1.0),
        dict(include_stop_str_in_output="yes"),
    ],
)
def test_sampling_params_validation_names_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_random_requests_with_aborts_finish_and_free_every_block(tiny_llama):
    rng = random.Random(0)
    engine = LLMEngine(
        EngineConfig(model=tiny_llama, num_kv_blocks=40, max_num_seqs=16, max_num_batched_tokens=64)
    )
    tok = engine.tokenizer
    added, finished, aborted = 0, {}, set()
    while added < 200 or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if added < 200:
                n = rng.randint(1, 40)
                prompt = [rng.randrange(3, len(tok)) for _ in range(n)]
                params = SamplingParams(
                    n=rng.choice([1, 1, 2]),
                    temperature=rng.choice([0.0, 0.7, 1.0]),
                    top_k=rng.choice([0, 5]),
                    top_p=rng.choice([1.0, 0.9]),
                    max_tokens=rng.randint(1, 30),
                    seed=rng.choice([None, rng.randrange(100)]),
                    stop=rng.choice([None, "e"]),
                )
                engine.add_request(f"r{added}", prompt, params)
                added += 1
        if rng.random() < 0.1 and engine.requests:
            victim = rng.choice(sorted(engine.requests))
            assert engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert len(finished) == 200
    for rid, out in finished.items():
        reasons = {c.finish_reason for c in out.outputs}
        assert reasons <= {"stop", "length", "abort"}
        # an aborted request had an unfinished sample (else it was no longer abortable)
        assert ("abort" in reasons) == (rid in aborted)
    stats = engine.get_stats()
    assert stats.num_free_blocks == 40 and stats.num_running == stats.num_waiting == 0


def test_parallel_samples_count_against_max_num_seqs(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=4))
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("c", PROMPTS[2], SamplingParams(n=5))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert len(engine.scheduler.running) <= 4
    assert all(len(o.outputs) == 3 for o in finished.values()) and len(finished) == 2


def _drain(engine: LLMEngine) -> dict[str, list]:
    """Step to the end; every output each request got, in order (an abort's final output
    comes with the step after it, though the engine reports idle at once)."""
    seen: dict[str, list] = {}
    while True:
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        if not engine.has_unfinished_requests():
            return seen


def _assert_aborted(out, num_samples: int, tokens_before: list[list[int]] | None = None) -> None:
    assert out.finished
    assert len(out.outputs) == num_samples
    for c in out.outputs:
        assert c.finish_reason == "abort" and c.finished, (c.index, c.finish_reason)
    if tokens_before is not None:  # what was generated before the abort is kept, nothing more
        assert [c.token_ids for c in out.outputs] == tokens_before


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_abort_running_request_reports_abort_for_every_sample_and_frees_its_blocks(
    tiny_llama, tiny_draft, spec
):
    spec_config = {
        None: None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "max_draft_skip": 0},
        "draft": {"method": "draft", "draft_model": tiny_draft, "num_speculative_tokens": 3},
    }[spec]
    engine = LLMEngine(
        EngineConfig(model=tiny_llama, num_kv_blocks=48, speculative_config=spec_config)
    )
    many = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=60, ignore_eos=True)
    engine.add_request("victim", PROMPTS[1], many)
    engine.add_request("single", PROMPTS[0], SamplingParams(temperature=0, max_tokens=60))
    engine.add_request("bystander", PROMPTS[2], GREEDY)
    latest = {}
    for _ in range(4):
        for out in engine.step():
            latest[out.request_id] = out
    before = [list(c.token_ids) for c in latest["victim"].outputs]
    assert len(before) == 3 and all(before) and not latest["victim"].finished
    assert engine.abort_request("victim") and engine.abort_request("single")
    assert not engine.abort_request("victim")  # already gone
    seen = _drain(engine)
    assert len(seen["victim"]) == 1 and len(seen["single"]) == 1  # one final output each
    _assert_aborted(seen["victim"][0], 3, before)
    _assert_aborted(seen["single"][0], 1, [latest["single"].outputs[0].token_ids])
    # the bystander is unharmed: its greedy tokens are those of a run alone
    alone = run(LLM(tiny_llama, num_kv_blocks=48), [PROMPTS[2]])[0]
    assert seen["bystander"][-1].outputs[0].token_ids == alone
    assert seen["bystander"][-1].outputs[0].finish_reason == "length"
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_abort_waiting_and_half_prefilled_requests(tiny_llama):
    # max_num_seqs=2 keeps "waiting" out of the running set; a 7-token budget leaves "long"
    # half prefilled (its blocks allocated, no output yet) when it is aborted.
    engine = LLMEngine(
        EngineConfig(model=tiny_llama, num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=7)
    )
    engine.add_request("long", PROMPTS[1], SamplingParams(max_tokens=8))
    engine.add_request("first", PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=8))
    engine.add_request("waiting", PROMPTS[2], SamplingParams(n=2, max_tokens=8))
    engine.step()  # a prefill chunk of "long"
    stats = engine.get_stats()
    assert stats.num_waiting >= 1 and stats.num_free_blocks < stats.num_total_blocks
    assert engine.abort_request("waiting") and engine.abort_request("long")
    seen = _drain(engine)
    _assert_aborted(seen["waiting"][-1], 2, [[], []])  # all n samples, never started
    _assert_aborted(seen["long"][-1], 1, [[]])
    assert len(seen["waiting"]) == len(seen["long"]) == 1
    assert [c.finish_reason for c in seen["first"][-1].outputs] == ["length", "length"]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_abort_everything_under_preemption_frees_every_block(tiny_llama):
    engine = LLMEngine(
        EngineConfig(model=tiny_llama, num_kv_blocks=10, max_num_batched_tokens=32,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    )  # fmt: skip
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    while engine.get_stats().num_preemptions == 0:
        engine.step()
    assert engine.get_stats().num_waiting > 0  # some are preempted or never started
    for i in range(len(PROMPTS)):
        assert engine.abort_request(str(i))
    seen = _drain(engine)
    assert sorted(seen) == [str(i) for i in range(len(PROMPTS))]
    for outs in seen.values():
        assert len(outs) == 1
        assert outs[0].finished
        assert all(c.finish_reason == "abort" for c in outs[0].outputs)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 10
    assert stats.num_running == stats.num_waiting == 0


def test_priority_scheduling_serves_lower_values_first(tiny_llama):
    """scheduling_policy="priority": one seat, three requests; they finish in priority order
    (ties by arrival), each with the tokens it makes alone; a bad priority is a ValueError."""
    assert SCHEDULING_POLICIES == POLICIES  # the engine's option, the scheduler's values
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(model=tiny_llama, scheduling_policy="lifo")
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=32, max_num_seqs=1,
                                    scheduling_policy="priority"))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("bad", "x", params, priority="high")
    for request_id, priority in (("a", 5), ("b", 0), ("c", 9), ("d", 0)):
        engine.add_request(request_id, PROMPTS[0], params, priority)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    assert order == ["b", "d", "a", "c"]
    alone = LLM(tiny_llama, num_kv_blocks=32).generate(PROMPTS[0], params, use_tqdm=False)
    assert all(t == alone[0].outputs[0].token_ids for t in tokens.values())
    llm = LLM(tiny_llama, num_kv_blocks=32, max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False, priority=[3, 1])
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)
    ]


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 8},  # the prompt in chunks of 8
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
)  # fmt: skip
def test_prompt_logprobs_match_hf_across_chunks_and_cache_hits(tiny_llama, options):
    """prompt_logprobs: None, then per prompt token its logprob and the top 2, HF's float64
    log_softmax at 1e-4; with the prompt in chunks; the same request again (its prompt is in
    the prefix cache, which it does not use: every row is computed); n = 2."""
    llm = LLM(tiny_llama, num_kv_blocks=64, **options)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float64).eval()
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=2)
    prompt = PROMPTS[1] * 3  # two full blocks and more: the second time they are cached
    for _ in range(2):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        ids = out.prompt_token_ids
        assert len(ids) > 32 and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        with torch.no_grad():
            exact = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        for p in range(1, len(ids)):
            entry = out.prompt_logprobs[p]
            assert set(entry) == set(exact[p - 1].topk(2).indices.tolist()) | {ids[p]}
            for t, lp in entry.items():
                assert lp == pytest.approx(float(exact[p - 1, t]), abs=1e-4), (p, t)
        assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)
    plain = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert llm.llm_engine.get_stats().num_prefix_cache_hit_tokens >= 32  # the cache was there
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_priority_preempts_the_lowest_priority_under_memory_pressure(tiny_llama):
    """Four long requests in too few KV blocks for all, the lowest-priority one admitted first:
    every preemption takes a sequence of the lowest priority then running (not the youngest),
    never the priority-0 request; the tokens are those each request makes alone."""
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=12, block_size=16,
                                    scheduling_policy="priority"))  # fmt: skip
    victims, preempt = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq, out: (
        victims.append((seq.priority, max(s.priority for s in engine.scheduler.running))),
        preempt(seq, out),
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("b", PROMPTS[1], params, 3)  # admitted first: the oldest, the lowest
    engine.step()
    for request_id, priority in (("a", 0), ("c", 1), ("d", 2)):
        engine.add_request(request_id, PROMPTS[1], params, priority)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    assert victims and all(priority == lowest for priority, lowest in victims)
    assert all(priority > 0 for priority, _ in victims)
    alone = LLM(tiny_llama, num_kv_blocks=32).generate(PROMPTS[1], params, use_tqdm=False)
    assert all(t == alone[0].outputs[0].token_ids for t in tokens.values())

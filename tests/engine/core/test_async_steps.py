"""Async scheduling on the CPU (pagedspec.engine.core.async_step): each step launched before the
previous one is read gives the synchronous engine's tokens, outputs and block accounting, whatever
stops, aborts, failures or non-greedy requests come in between."""

from __future__ import annotations

import inspect

import pytest
from conftest import engine_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedspec import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from pagedspec.engine.core.graph_capture import capture_graphs, rerun_capture

PROMPTS = ["The quick brown fox", "Paged attention stores", "one two three four", "def add(a, b):"]


def launches(engine: LLMEngine, failed: int = 0) -> int:
    """Steps the engine launched async; ``failed`` of them raised (else they ran as launched)."""
    steps = inspect.unwrap(engine._next_step)  # (the AsyncStep, wrapped)
    assert steps.failed == failed
    return steps.launches


def run(
    engine: LLMEngine,
    requests: dict,
    abort: tuple[str, int] | None = None,
    late: dict | None = None,
) -> dict:
    """Every request's final output; ``abort``: (request id, step) to abort it at; ``late``:
    step -> requests to add before it."""
    late = late or {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, steps, texts = {}, 0, {}
    while engine.has_unfinished_requests() or any(step >= steps for step in late):
        for rid, (prompt, params) in late.get(steps, {}).items():
            engine.add_request(rid, prompt, params)
        if abort is not None and steps == abort[1]:
            assert engine.abort_request(abort[0])
        for out in engine.step():
            texts.setdefault(out.request_id, []).append(out.outputs[0].text)
            if out.finished:
                assert out.request_id not in final  # finished once
                final[out.request_id] = out
        steps += 1
    bm = engine.block_manager
    assert bm.num_free_blocks() == bm.num_blocks  # nothing leaked
    for chunks in texts.values():  # streamed text only grows
        assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:], strict=False))
    return final


def tokens(final: dict) -> dict:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for rid, o in final.items()}


@pytest.mark.parametrize("graphs", [False, True])
def test_async_steps_give_the_synchronous_tokens_with_stops_mid_flight(tiny_llama, graphs):
    """Also replaying graphs (rerun_capture standing in): the pending tokens are resolved in
    the graph's static buffers."""
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 14, 6)]
    requests = {str(i): (p, g) for i, (p, g) in enumerate(zip(PROMPTS, greedy, strict=True))}
    want = tokens(run(engine_for(tiny_llama), requests))
    # a stop token each request meets mid-way: the step launched after it is dropped
    stops = {rid: ids[len(ids) // 2] for rid, (ids, _) in want.items() if len(ids) > 4}
    for rid, stop in stops.items():
        prompt, params = requests[rid]
        params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                stop_token_ids=[stop])  # fmt: skip
        requests[rid] = (prompt, params)
    want = tokens(run(engine_for(tiny_llama), requests))
    assert any(reason == "stop" for _, reason in want.values())
    engine = engine_for(tiny_llama, async_scheduling=True)
    if graphs:
        capture_graphs(engine.config, engine.max_model_len, engine.runner, None, rerun_capture)
    assert tokens(run(engine, requests)) == want
    assert launches(engine) > 5
    assert not graphs or engine.runner.graphs.replays >= launches(engine)


def test_requests_that_end_by_length_cost_no_extra_step(tiny_llama):
    """A sequence whose pending token is its last (max_tokens, max_model_len) is not launched
    again: the async engine computes exactly the synchronous engine's rows."""
    requests = {str(i): (p, SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True))
                for i, p in enumerate(PROMPTS)}  # fmt: skip
    requests["edge"] = (list(range(100, 120)), SamplingParams(temperature=0, ignore_eos=True))
    rows = []
    for options in ({}, {"async_scheduling": True}):
        engine = engine_for(tiny_llama, max_model_len=26, **options)
        forward = engine.runner.forward
        computed = [0]

        def counted(spans, *args, forward=forward, computed=computed, **kwargs):
            computed[0] += sum(len(s.token_ids) for s in spans)
            return forward(spans, *args, **kwargs)

        engine.runner.forward = counted
        final = run(engine, requests)
        assert final["edge"].outputs[0].finish_reason == "length"
        rows.append(computed[0])
    assert rows[0] == rows[1]


def test_seeded_sampling_penalties_and_logprobs_run_async_as_synchronously(tiny_llama):
    """A seeded row draws from its position's generator: async, the synchronous tokens; a
    penalty counts the pending token; logprobs read with the tokens are the synchronous ones."""
    requests = {
        "seeded": (PROMPTS[1], SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=9)),
        "top-p": (PROMPTS[0], SamplingParams(temperature=1.2, top_p=0.8, seed=3, max_tokens=11)),
        "min": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=8, min_tokens=6)),
        "logprobs": (PROMPTS[2], SamplingParams(temperature=0.5, seed=2, max_tokens=7, logprobs=3)),
        # its greedy tokens on "a a a a" repeat the 5th at once: the penalty must count that
        # token while it is pending
        "penalty": ("a a a a", SamplingParams(temperature=0, max_tokens=8, presence_penalty=2.0)),
    }
    want = run(engine_for(tiny_llama), requests)
    engine = engine_for(tiny_llama, async_scheduling=True)
    got = run(engine, requests)
    assert tokens(got) == tokens(want)
    for rid in requests:
        ours, theirs = got[rid].outputs[0], want[rid].outputs[0]
        assert ours.logprobs == theirs.logprobs
        assert ours.cumulative_logprob == theirs.cumulative_logprob
    assert len(got["logprobs"].outputs[0].logprobs) == 7
    assert launches(engine) > 5


# what a request reads beyond its tokens: its prompt's logprobs, a constraint's matcher
OTHERS = {
    "prompt": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1)),
    "constraint": (
        PROMPTS[2],
        SamplingParams(
            temperature=0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(
                choice=["alpha beta gamma delta", "epsilon"]
            ),
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("kind", sorted(OTHERS))
def test_rows_that_read_more_than_their_token_run_synchronously(tiny_llama, kind):
    """Prompt logprobs and constraints make their steps synchronous: every output as the
    synchronous engine's; an unseeded sampled request keeps its law; once they are done the
    steps go async again."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    requests = {"greedy": (PROMPTS[0], greedy), kind: OTHERS[kind]}
    want = run(engine_for(tiny_llama), requests)
    engine = engine_for(tiny_llama, async_scheduling=True)
    got = run(engine, requests | {"free": (PROMPTS[3], SamplingParams(max_tokens=6))})
    assert tokens({r: got[r] for r in requests}) == tokens(want)
    assert got[kind].prompt_logprobs == want[kind].prompt_logprobs
    assert len(got["free"].outputs[0].token_ids) <= 6 and got["free"].outputs[0].finish_reason
    assert launches(engine) > 0


def test_a_request_that_joins_or_is_aborted_mid_flight(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = {str(i): (p, greedy) for i, p in enumerate(PROMPTS)}
    requests["long"] = (list(range(200, 240)), greedy)  # two full blocks to cache
    want = tokens(run(engine_for(tiny_llama), requests))
    engine = engine_for(tiny_llama, async_scheduling=True)
    got = run(engine, requests, abort=("2", 5))
    assert got["2"].outputs[0].finish_reason == "abort"
    aborted = got["2"].outputs[0].token_ids
    assert 0 < len(aborted) < 12 and aborted == want["2"][0][: len(aborted)]
    assert {rid: t for rid, t in tokens(got).items() if rid != "2"} == {
        rid: t for rid, t in want.items() if rid != "2"
    }
    # a prompt whose prefix the async steps cached, added to an idle engine that still holds
    # a launched step (of finished sequences)
    again = run(engine, {"again": (list(range(200, 240)), greedy)})
    assert again["again"].outputs[0].token_ids == want["long"][0]
    assert engine.get_stats().num_prefix_cache_hit_tokens == 32


def test_admissions_and_chunked_prefills_run_async_with_the_synchronous_tokens(tiny_llama):
    """Requests that join mid-run, a long prompt prefilled in chunks beside the decodes (its
    chunks launched like them), and a request of n = 2 samples, whose prompt's end runs
    synchronously (it forks there), then decodes async."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = {str(i): (p, greedy) for i, p in enumerate(PROMPTS[:2])}
    late = {
        3: {"late": (PROMPTS[2], greedy), "long": (list(range(50, 100)), greedy)},
        6: {
            "pair": (
                list(range(300, 340)),
                SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=7),
            )
        },
    }
    options = dict(max_num_batched_tokens=16)  # the long prompt takes 4 chunks
    want = run(engine_for(tiny_llama, **options), requests, late=late)
    engine = engine_for(tiny_llama, async_scheduling=True, **options)
    got = run(engine, requests, late=late)
    assert tokens(got) == tokens(want)
    assert [o.token_ids for o in got["pair"].outputs] == [o.token_ids for o in want["pair"].outputs]
    assert launches(engine) >= 10


def test_a_prompt_of_n_samples_ends_synchronously_and_its_samples_decode_async(tiny_llama):
    """Its prompt forks n samples at its end: its chunks run synchronously, then its samples
    decode async."""
    pair = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=7)
    requests = {"pair": (list(range(300, 340)), pair), "short": (PROMPTS[3], pair)}
    options = dict(max_num_batched_tokens=16)  # three chunks
    want = run(engine_for(tiny_llama, **options), requests)
    engine = engine_for(tiny_llama, async_scheduling=True, **options)
    got = run(engine, requests)
    for rid in requests:
        assert [o.token_ids for o in got[rid].outputs] == [o.token_ids for o in want[rid].outputs]
        assert len(got[rid].outputs) == 2
    assert launches(engine) == 6  # tokens 2-7


def test_a_long_prompt_alone_launches_its_chunks_back_to_back(tiny_llama):
    """Steps that sample nothing (chunks mid-prompt) leave no tokens for the next to read."""
    requests = {"long": (list(range(300, 340)), SamplingParams(temperature=0, max_tokens=5))}
    options = dict(max_num_batched_tokens=16)  # three chunks
    want = run(engine_for(tiny_llama, **options), requests)
    engine = engine_for(tiny_llama, async_scheduling=True, **options)
    assert tokens(run(engine, requests)) == tokens(want)
    assert launches(engine) == 3 + 4  # the chunks, then tokens 2-5


def test_a_step_that_may_preempt_runs_synchronously(tiny_llama):
    """Three full one-block prompts in a pool of four blocks: their next tokens need a block
    each, so the step preempts, synchronously, as the synchronous engine does."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = {str(i): ([7 + i] * 16, greedy) for i in range(3)}
    want = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=4))
    expected = tokens(run(want, requests))
    assert want.get_stats().num_preemptions > 0
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=4, async_scheduling=True))
    assert tokens(run(engine, requests)) == expected
    assert engine.get_stats().num_preemptions > 0 and launches(engine) > 0


def test_an_interrupt_mid_launch_loses_no_launched_step(tiny_llama):
    """Ctrl-C inside a launch (where the CPU's time goes): the step launched before stays for
    the next step to read, and the run goes on to the synchronous outputs."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = {str(i): (p, greedy) for i, p in enumerate(PROMPTS)}
    want = tokens(run(engine_for(tiny_llama), requests))
    engine = engine_for(tiny_llama, async_scheduling=True)
    forward, calls = engine.runner.forward, [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    engine.runner.forward = interrupted
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            continue
        final |= {o.request_id: o for o in outputs if o.finished}
    assert tokens(final) == want and calls[0] > 4
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_blocks


def test_a_failure_in_a_launched_step_aborts_only_its_request(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = {str(i): (p, greedy) for i, p in enumerate(PROMPTS)}
    want = tokens(run(engine_for(tiny_llama), requests))
    long_prompt = list(range(100, 130))  # positions past 33 are the culprit's alone
    engine = engine_for(tiny_llama, async_scheduling=True)
    forward = engine.runner.model.forward

    def failing(input_ids, positions, *args):
        if (positions > 33).any():
            raise RuntimeError("injected kernel error")
        return forward(input_ids, positions, *args)

    engine.runner.model.forward = failing
    got = run(engine, requests | {"bad": (long_prompt, greedy)})
    assert got["bad"].outputs[0].finish_reason == "abort" and "injected" in got["bad"].error
    assert len(got["bad"].outputs[0].token_ids) == 5  # those of positions 30-34: 34 failed
    assert {rid: t for rid, t in tokens(got).items() if rid != "bad"} == want
    assert launches(engine, failed=1) > 0  # the one launch that failed ran synchronously


def test_async_scheduling_refuses_speculation_and_tensor_parallelism():
    with pytest.raises(ValueError, match="async_scheduling needs speculative_config None"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)


KINDS = {
    "greedy": dict(temperature=0),
    "seeded": dict(temperature=0.9, top_p=0.9, seed=11),
    "penalty": dict(temperature=0, frequency_penalty=1.0),
    "logprobs": dict(temperature=0, logprobs=1),
    "pair": dict(n=2, temperature=0.7, seed=3),
    "min": dict(temperature=0, min_tokens=3),
}


@st.composite
def workloads(draw):
    """Requests (prompt, params, the step it joins at) and the engine's memory and budget."""
    requests = {}
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(3, 500), min_size=1, max_size=40))
        kind = draw(st.sampled_from(sorted(KINDS)))
        stop = draw(st.lists(st.integers(3, 500), max_size=2))
        max_tokens = draw(st.integers(KINDS[kind].get("min_tokens", 1), 12))
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=True,
                                **KINDS[kind])  # fmt: skip
        requests[f"{kind}-{i}"] = (prompt, params, draw(st.integers(0, 5)))
    options = dict(num_kv_blocks=draw(st.sampled_from([12, 24, 64])),
                   max_num_batched_tokens=draw(st.sampled_from([16, 48, 2048])))  # fmt: skip
    return requests, options


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=workloads())
def test_random_workloads_give_the_synchronous_outputs(tiny_llama, workload):
    """Mixed kinds joining at random steps, chunked prompts, tight memory (preemption runs
    synchronously): every output equal to the synchronous engine's, no block leaked."""
    requests, options = workload
    late: dict[int, dict] = {}
    for rid, (prompt, params, step) in requests.items():
        late.setdefault(step, {})[rid] = (prompt, params)
    outs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=tiny_llama, async_scheduling=async_scheduling,
                                        **options))  # fmt: skip
        final = run(engine, {}, late=late)
        outs.append({rid: [(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs]
                     for rid, o in final.items()})  # fmt: skip
        if async_scheduling:
            launches(engine)  # no launch failed
    assert outs[0] == outs[1]

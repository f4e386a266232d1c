"""The server's error paths in process (FastAPI's TestClient, a tiny model): what a client gets
when the engine itself fails under its request."""

from __future__ import annotations

import json

import pytest
from conftest import build_tiny_llama
from fastapi.testclient import TestClient

from pagedspec import EngineConfig, LLMEngine
from pagedspec.engine.distributed.comm import WorkerError
from pagedspec.engine.serve.app import create_app
from pagedspec.engine.serve.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("serve_errors_model"))


def test_lost_worker_is_a_json_error_then_the_server_stops_serving(model_dir):
    """A WorkerError (a tensor-parallel rank gone) fails the running request with OpenAI's JSON
    error, not a bare 500; the engine cannot step again, so /health turns 503 and new requests
    get 503, and no KV block stays held."""
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=32))

    def lost(*args, **kwargs):
        raise WorkerError("rank 1 died")

    engine.runner.forward = lost
    app = create_app(AsyncEngine(engine, max_queue=4), "tiny")
    body = {"prompt": "The quick brown", "max_tokens": 4}
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "InternalServerError"
        assert "rank 1 died" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and "rank 1 died" in r.json()["error"]["message"]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not engine.has_unfinished_requests()


def test_auto_tool_choice_parses_hermes_style_calls():
    """ "auto": calls written as <tool_call>{...}</tool_call> become tool_calls (unknown names
    and broken JSON stay text); the rest is the content."""
    from pagedspec.engine.serve.protocol import ChatCompletionRequest
    from pagedspec.engine.serve.tools import tool_calls

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool])
    text = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>\n<tool_call>{"name": "other", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = tool_calls(req, "auto", text)
    assert content == 'Let me look. \n<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert tool_calls(req, "auto", "no calls here") == ("no calls here", [])
    assert tool_calls(req, "auto", "<tool_call>{broken</tool_call>")[1] == []


def test_a_constraint_compiles_off_the_engine_thread(model_dir):
    """A constraint that takes 0.6 s to compile: the engine keeps stepping a running stream
    meanwhile (the compile runs in the handler's worker thread), then serves it from the
    cache; one that does not compile is a 400 before anything is queued."""
    import threading
    import time

    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64))
    grammars, real = engine.processor.grammars, engine.processor.grammars._compile
    compiling = threading.Event()

    def slow(params):
        compiling.set()
        time.sleep(0.6)
        return real(params)

    grammars._compile = slow
    steps, step = [], engine.step
    engine.step = lambda: steps.append(time.monotonic()) or step()
    app = create_app(AsyncEngine(engine, max_queue=4), "tiny")
    long = {"prompt": "The quick brown", "max_tokens": 400, "ignore_eos": True, "stream": True}
    constrained = {"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}}
    with TestClient(app) as client:
        results = {}
        worker = threading.Thread(target=lambda: results.setdefault(
            "r", client.post("/v1/completions", json=constrained)))  # fmt: skip
        with client.stream("POST", "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            worker.start()
            assert compiling.wait(5)
            start = time.monotonic()
            worker.join(10)
            during = [t for t in steps if start <= t <= start + 0.5]
        assert len(during) > 5, f"{len(during)} steps while the constraint compiled"
        assert results["r"].json()["choices"][0]["text"] in ("yes", "no")
        bad = client.post(
            "/v1/completions", json=constrained | {"structured_outputs": {"regex": "["}}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs.regex"


def test_an_echo_of_a_prompt_cut_short_has_none_for_the_logprobs_it_lacks():
    """A request aborted before its prompt was done (a drain's abort_all) has fewer prompt
    logprobs than prompt tokens: the echo lists None for the rest instead of failing."""
    from pagedspec.engine.outputs import RequestOutput
    from pagedspec.engine.serve.completions import _prompt_entries

    cut = RequestOutput("r", None, [5, 6, 7, 8], [], True, prompt_logprobs=[None, {6: -1.0}])
    assert _prompt_entries(cut) == [None, {6: -1.0}, None, None]
    assert _prompt_entries(RequestOutput("r", None, [5, 6], [], True)) == [None, None]

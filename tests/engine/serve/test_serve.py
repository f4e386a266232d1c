"""The OpenAI-compatible server, for real: ``python -m pagedspec.serve`` in a subprocess on a free
127.0.0.1 port with a tiny random model, driven by the official ``openai`` client and by plain
HTTP (httpx). Greedy answers are compared token for token with the offline ``LLM``.

One server serves the whole module (``--max-num-seqs 2 --max-queue 2``, so the queue bound is
easy to reach); the SIGTERM test stops it and therefore runs last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest
from conftest import build_tiny_llama
from prometheus_client.parser import text_string_to_metric_families

from pagedspec import LLM, SamplingParams

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 4096  # long enough for requests that outlast the test
LONG = 4000
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
PROMPTS = ["The quick brown", "Paged attention stores"]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        )
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """Every sample, by name (labels joined in as name{k=v})."""
        text = httpx.get(f"{self.url}/metrics").text
        return {
            s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def wait_idle(self, timeout: float = 20) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["pagedspec:num_requests_running"] == 0
            idle = idle and m["pagedspec:num_requests_waiting"] == 0
            if idle and m["pagedspec:kv_cache_used_blocks"] == 0:
                return m
            busy = {k: v for k, v in m.items() if "requests" in k or "used_blocks" in k}
            assert time.monotonic() < deadline, f"server never went idle: {busy}"
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve_model")
    return build_tiny_llama(path, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_kv_blocks=64)


def start_server(model_dir: str, *flags: str, stderr: int | None = None) -> Server:
    """``python -m pagedspec.serve`` with ``flags`` on a free port, once its /health answers."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "pagedspec.serve", "--model", model_dir, "--port", str(port),
        "--api-key", API_KEY, "--served-model-name", MODEL, "--num-kv-blocks", "1024",
        "--log-level", "warning", *flags,
    ]  # fmt: skip
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "the server exited during start-up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)
    return Server(proc, url)


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[Server]:
    flags = ("--max-num-seqs", "2", "--max-queue", "2", "--shutdown-timeout", "20")
    server = start_server(model_dir, *flags)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
    server.proc.wait()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **kwargs)


def test_completions_equal_offline(server, llm):
    expected = llm.generate(PROMPTS, greedy(max_tokens=12), use_tqdm=False)
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        e.outputs[0].text for e in expected
    ]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(
        server.client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == expected[0].outputs[0].text
    assert [c.finish_reason for chunk in chunks for c in chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_chat_equals_offline(server, llm):
    (expected,) = llm.chat(MESSAGES, greedy(max_tokens=10), use_tqdm=False)
    r = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids) == 10

    stream = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_plain_http_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 4, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_n_stop_and_seed(server, llm):
    params = greedy(max_tokens=16, n=2, stop=[" three", "jumps"])
    (expected,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    r = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, n=2, stop=params.stop
    )
    assert [c.text for c in r.choices] == [c.text for c in expected.outputs]
    assert [c.finish_reason for c in r.choices] == [c.finish_reason for c in expected.outputs]

    def sampled() -> list[str]:
        r = server.client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7, n=2,
            extra_body={"top_k": 20, "min_p": 0.01, "min_tokens": 2, "ignore_eos": True},
        )  # fmt: skip
        return [c.text for c in r.choices]

    assert sampled() == sampled()


def test_penalties_pass_through(server, llm):
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    plain, penalised = llm.generate(
        PROMPTS[:1] * 2,
        [greedy(max_tokens=24), greedy(max_tokens=24, **penalties)],
        use_tqdm=False,
    )
    assert plain.outputs[0].token_ids != penalised.outputs[0].token_ids  # the test can fail
    r = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
        presence_penalty=1.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    assert r.choices[0].text == penalised.outputs[0].text
    r = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "presence_penalty": 9}
    )
    _error(r, 400, "presence_penalty")


def test_logprobs_formats(server, llm):
    (expected,) = llm.chat(MESSAGES, greedy(max_tokens=3, logprobs=2), use_tqdm=False)
    r = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry, token, offline in zip(
        content, expected.outputs[0].token_ids, expected.outputs[0].logprobs, strict=True
    ):
        assert entry.logprob == pytest.approx(offline[token], abs=1e-5)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: top-1
        assert entry.bytes == list(entry.token.encode())

    r = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


def test_errors(server):
    post = server.http.post
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    _error(post("/v1/completions", json=ok | {"top_p": 2}), 400, "top_p")
    _error(post("/v1/completions", json=ok | {"temperature": "hot"}), 400, "temperature")
    _error(post("/v1/completions", json=ok | {"max_tokenz": 3}), 400, "max_tokenz")
    _error(post("/v1/completions", json=ok | {"n": 0}), 400, "n")
    _error(post("/v1/completions", json=ok | {"logprobs": -1}), 400, "logprobs")
    assert post("/v1/completions", json=ok | {"priority": 2}).status_code == 200  # fcfs: no effect
    _error(post("/v1/completions", json=ok | {"priority": "high"}), 400, "priority")
    _error(post("/v1/completions", json=ok | {"prompt": [7] * MAX_MODEL_LEN}), 400, "prompt")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": " x" * MAX_MODEL_LEN}]}
    _error(post("/v1/chat/completions", json=chat), 400, "messages")
    for message, field in (({"role": "user"}, "messages[0].content"),
                           ({"role": "robot", "content": "x"}, "messages[0].role")):  # fmt: skip
        chat = {"model": MODEL, "messages": [message]}
        _error(post("/v1/chat/completions", json=chat), 400, field)
    chat["messages"] = MESSAGES
    _error(post("/v1/chat/completions", json=chat | {"top_logprobs": 2}), 400, "top_logprobs")
    _error(post("/v1/chat/completions", json=chat | {"max_completion_tokens": 0}), 400,
           "max_completion_tokens")  # fmt: skip
    # a prompt plus max_tokens past the context: a 400 naming the field and its bound
    edge = ok | {"prompt": [7] * (MAX_MODEL_LEN - 2)}
    error = _error(post("/v1/completions", json=edge | {"max_tokens": 3}), 400, "max_tokens")
    assert "max_tokens must be <= 2" in error["message"]
    assert post("/v1/completions", json=edge).status_code == 200  # max_tokens 2: fits
    _error(post("/v1/completions", json=ok | {"max_tokens": MAX_MODEL_LEN}), 400, "max_tokens")
    both = ok | {"prompt": [[7, 7], [7] * (MAX_MODEL_LEN - 50)], "max_tokens": 100}
    _error(post("/v1/completions", json=both), 400, "max_tokens")
    for limit in ("max_tokens", "max_completion_tokens"):
        _error(post("/v1/chat/completions", json=chat | {limit: MAX_MODEL_LEN}), 400, limit)
    _error(post("/v1/completions", json=ok | {"model": "gpt-4"}), 404, "model")
    assert _error(httpx.post(f"{server.url}/v1/completions", json=ok), 401)["code"]
    wrong = {"Authorization": "Bearer nope"}
    _error(httpx.post(f"{server.url}/v1/completions", json=ok, headers=wrong), 401)
    broken = '{"model": "m", "prompt": }'  # the key is checked before the body is read
    as_json = {"Content-Type": "application/json"}
    _error(httpx.post(f"{server.url}/v1/completions", content=broken, headers=as_json), 401)
    error = _error(post("/v1/completions", content=broken, headers=as_json), 400)
    assert error["param"] is None and error["message"].startswith("invalid JSON at position 25")
    # strict types, as OpenAI's: no coercion of strings to numbers or booleans
    _error(post("/v1/completions", json=ok | {"n": "2"}), 400, "n")
    _error(post("/v1/completions", json=ok | {"stream": "yes"}), 400, "stream")
    _error(post("/v1/completions", json=ok | {"logprobs": 21}), 400, "logprobs")
    _error(post("/v1/chat/completions", json=chat | {"logprobs": True, "top_logprobs": 21}), 400,
           "top_logprobs")  # fmt: skip
    assert post("/v1/completions", json=ok | {"temperature": 1}).status_code == 200  # int: fine
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client.completions.create(model=MODEL, prompt="hi", top_p=-1)
    assert server.client.models.list().data[0].id == MODEL
    assert post("/v1/completions", json=ok).status_code == 200  # still serving


def test_queue_bound_503_and_disconnects_free_blocks(server):
    """Two requests run (--max-num-seqs 2), two wait (--max-queue 2), the fifth gets 503;
    then every client hangs up mid-stream and all their KV blocks come back."""
    before = server.wait_idle()
    long = {"model": MODEL, "prompt": "The quick", "max_tokens": LONG, "ignore_eos": True}
    long |= {"stream": True}
    streams, readers = [], []  # a dropped line iterator would close its connection
    try:
        for i in range(4):
            cm = server.http.stream("POST", "/v1/completions", json=long)
            r = cm.__enter__()
            streams.append(cm)
            assert r.status_code == 200
            readers.append(r.iter_lines())
            while i < 2 and not next(readers[-1]).startswith("data: {"):  # read until it runs
                pass
        m = server.metrics()
        assert m["pagedspec:num_requests_waiting"] == 2, m
        assert m["pagedspec:num_requests_running"] == 2, m
        assert m["pagedspec:kv_cache_used_blocks"] > 0
        full = server.http.post("/v1/completions", json=long)
        _error(full, 503)
        assert full.headers["Retry-After"] == "1"
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
    after = server.wait_idle(timeout=10)
    aborted = "pagedspec:request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 4
    generated = "pagedspec:generation_tokens_total"
    assert after[generated] - before[generated] < LONG  # aborted, not run to the end


def test_metrics_parse(server):
    server.client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=3)
    bad = {"model": MODEL, "prompt": "hi", "top_p": -1}
    assert server.http.post("/v1/completions", json=bad).status_code == 400
    m = server.wait_idle()
    for name in (
        "pagedspec:num_requests_waiting", "pagedspec:kv_cache_usage_perc",
        "pagedspec:prefix_cache_queries_total", "pagedspec:prefix_cache_hits_total",
        "pagedspec:spec_decode_num_draft_tokens_total",
        "pagedspec:spec_decode_num_accepted_tokens_total",
        "pagedspec:inter_token_latency_seconds_count",
    ):  # fmt: skip
        assert name in m, name
    assert m["pagedspec:kv_cache_usage_perc"] == 0.0
    assert m["pagedspec:prompt_tokens_total"] > 0
    assert m["pagedspec:generation_tokens_total"] >= 6
    assert m["pagedspec:time_to_first_token_seconds_count"] >= 2
    assert m["pagedspec:e2e_request_latency_seconds_count"] >= 2
    assert m["pagedspec:prefix_cache_queries_total"] >= m["pagedspec:prefix_cache_hits_total"]
    assert m["pagedspec:request_rejected_total{status=400}"] >= 1
    assert not [name for name in m if "_created" in name]  # vLLM leaves those series out


def test_echo_and_prompt_logprobs(server, llm):
    """echo puts the prompt (and, with logprobs, its logprobs: none for its first token) before
    the completion; vLLM's prompt_logprobs come per prompt token, as the offline engine's."""
    body = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 3, "temperature": 0}
    offline = llm.generate("The quick brown", greedy(max_tokens=3, prompt_logprobs=2),
                           use_tqdm=False)[0]  # fmt: skip
    r = server.http.post("/v1/completions", json=body | {"echo": True, "logprobs": 1}).json()
    choice = r["choices"][0]
    assert choice["text"] == "The quick brown" + offline.outputs[0].text
    lp = choice["logprobs"]
    num_prompt = len(offline.prompt_token_ids)
    assert len(lp["tokens"]) == num_prompt + 3 and lp["token_logprobs"][0] is None
    for got, entry, token in zip(lp["token_logprobs"][1:num_prompt], offline.prompt_logprobs[1:],
                                 offline.prompt_token_ids[1:], strict=True):  # fmt: skip
        assert got == pytest.approx(entry[token], abs=1e-5)
    r = server.http.post("/v1/completions", json=body | {"prompt_logprobs": 2}).json()
    listed = r["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == num_prompt
    for entry, expected in zip(listed[1:], offline.prompt_logprobs[1:], strict=True):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(expected, abs=1e-5)
    streamed = list(server.client.completions.create(model=MODEL, prompt="The quick brown",
                                                     max_tokens=3, temperature=0, echo=True,
                                                     logprobs=1, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice["text"]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert offsets[:num_prompt] == lp["text_offset"][:num_prompt]
    assert min(offsets[num_prompt:]) >= len("The quick brown")  # counted in every later delta


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "k": {"enum": ["x", "y"]}},
    "required": ["n", "k"],
    "additionalProperties": False,
}


def test_response_format_and_structured_outputs(server):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs, whole
    and streamed; what does not compile is a 400 naming the field the request used."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0.9, "seed": 3}
    schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
    r = server.http.post("/v1/chat/completions", json=chat | {"response_format": schema})
    value = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(value) == {"n", "k"} and 0 <= value["n"] <= 9 and value["k"] in ("x", "y")
    r = server.client.chat.completions.create(**chat, response_format={"type": "json_object"})
    content = r.choices[0].message.content  # any object: a random model may not close it
    assert content.startswith("{") and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 20, "temperature": 1.0}
    choice = {"structured_outputs": {"choice": ["red", "green", "blue"]}}
    assert server.http.post("/v1/completions", json=body | choice).json()["choices"][0][
        "text"] in ("red", "green", "blue")  # fmt: skip
    streamed = server.client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{4}", "".join(c.choices[0].text for c in streamed))
    post = server.http.post
    _error(post("/v1/completions", json=body | {"structured_outputs": {"regex": "[0-9"}}), 400,
           "structured_outputs.regex")  # fmt: skip
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}
    _error(post("/v1/chat/completions", json=chat | {"response_format": bad}), 400,
           "response_format.json_schema")  # fmt: skip
    _error(post("/v1/chat/completions", json=chat | {"response_format": {"type": "json_schema"}}),
           400, "response_format")  # fmt: skip
    _error(post("/v1/completions", json=body | choice | {"response_format": schema}), 400)
    _error(post("/v1/completions", json=body | {"structured_outputs": {"regex": "a", "choice":
           ["a"]}}), 400)  # fmt: skip
    server.wait_idle()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


def _valid_call(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return arguments in ({"city": "Paris"}, {"city": "Oslo"})
    return call.function.name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


def test_tool_calls_named_required_and_streamed(server):
    """A named function or "required": calls valid for their schemas (constrained decoding),
    in OpenAI's tool_calls, whole and streamed, with finish_reason "tool_calls"."""
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.9, seed=5,
                tools=[WEATHER, TIME])  # fmt: skip
    named = {"type": "function", "function": {"name": "get_time"}}
    r = server.client.chat.completions.create(**chat, tool_choice=named).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert [c.function.name for c in r.message.tool_calls] == ["get_time"]
    assert _valid_call(r.message.tool_calls[0])
    r = server.client.chat.completions.create(**chat, tool_choice="required").choices[0]
    assert r.finish_reason == "tool_calls" and r.message.tool_calls
    assert all(_valid_call(c) for c in r.message.tool_calls)
    for choice in (named, "required"):
        chunks = list(server.client.chat.completions.create(**chat, tool_choice=choice,
                                                            stream=True))  # fmt: skip
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for d in chunk.choices[0].delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert calls and all(
            _valid_call(SimpleNamespace(function=SimpleNamespace(**c))) for c in calls.values()
        )
    post = server.http.post
    body = {"model": MODEL, "messages": MESSAGES}
    _error(post("/v1/chat/completions", json=body | {"tool_choice": "required"}), 400,
           "tool_choice")  # fmt: skip
    other = {"type": "function", "function": {"name": "nope"}}
    _error(post("/v1/chat/completions", json=body | {"tools": [WEATHER], "tool_choice": other}),
           400, "tool_choice")  # fmt: skip
    both = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type":
            "json_object"}}  # fmt: skip
    _error(post("/v1/chat/completions", json=body | both), 400, "tool_choice")
    server.wait_idle()


def test_sigterm_finishes_running_requests_then_exits(server):
    """Runs last: it stops the module's server."""
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 60, "ignore_eos": True}
    body |= {"stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2]
    assert server.proc.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health")


def test_sigterm_drains_then_aborts_what_is_left(model_dir):
    """Past --shutdown-timeout a stream ends with an "abort" chunk and [DONE], a waiting
    non-streaming request gets a 503 body; while draining, /health (GET and HEAD) and new
    requests get 503; no traceback, exit 0."""
    server = start_server(model_dir, "--shutdown-timeout", "1", stderr=subprocess.PIPE)
    try:
        assert httpx.head(f"{server.url}/health").status_code == 200
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": LONG, "ignore_eos": True}
        whole: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: whole.append(server.http.post("/v1/completions", json=body))
        )
        waiting.start()
        with server.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            while server.metrics()["pagedspec:num_requests_running"] < 2:
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            assert httpx.get(f"{server.url}/health").status_code == 503
            assert httpx.head(f"{server.url}/health").status_code == 503
            refused = server.http.post("/v1/completions", json=body | {"max_tokens": 1})
            assert refused.status_code == 503
            rest = [line for line in lines if line]
        waiting.join(timeout=30)
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"abort"' in rest[-2]
        error = _error(whole[0], 503)
        assert error["type"] == "ServiceUnavailableError" and "shut down" in error["message"]
        assert server.proc.wait(timeout=30) == 0
        log = server.proc.stderr.read()
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait()

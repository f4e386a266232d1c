"""The online benchmark's pure parts against oracles: arrival schedules against their laws, the
metrics against numpy on hand-made results, SSE decoding, and the timed client against an
in-process fake server whose chunk delays are known (httpx's MockTransport: no sockets)."""

import asyncio
import json
import math
import time

import numpy as np
import pytest
from test_benchmarks import assert_every_number_shown

from benchmarks import report, servers, serving
from benchmarks.openai_client import RequestResult, SSEDecoder, send


def test_arrivals_are_seeded_poisson_at_the_rate():
    times = serving.arrival_times(20_000, rate=4.0, seed=1)
    assert times == serving.arrival_times(20_000, rate=4.0, seed=1)
    assert times != serving.arrival_times(20_000, rate=4.0, seed=2)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps > 0).all()
    # Exponential gaps with mean 1/4: mean and standard deviation 0.25 (±3% at n = 20k), and
    # P(gap > mean) = 1/e.
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.03)
    assert (gaps > 0.25).mean() == pytest.approx(math.exp(-1), abs=0.015)


def test_burstiness_sets_the_spread_and_inf_sends_all_at_once():
    gaps = np.diff(serving.arrival_times(20_000, rate=2.0, seed=0, burstiness=4.0))
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)  # the rate does not change
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / 4, rel=0.06)  # gamma: CV² = 1/k
    assert serving.arrival_times(5, math.inf, seed=0) == [0.0] * 5
    for rate, burst in ((0, 1), (-1, 1), (1, 0)):
        with pytest.raises(ValueError, match="rate and burstiness"):
            serving.arrival_times(3, rate, 0, burst)
    with pytest.raises(ValueError, match="--rates"):
        serving._rates("1,zero")
    assert serving._rates("0.5, inf") == [0.5, math.inf]


def _result(ttft, latency, tokens, itl=(), status=200, prompt=10):
    return RequestResult(status, ttft, latency, list(itl), "x", prompt, tokens, "length")


def test_summary_matches_numpy_and_counts_goodput():
    done = [_result(0.1, 1.1, 11, [0.1] * 10), _result(0.5, 0.9, 5, [0.1, 0.1, 0.2]),
            _result(3.0, 5.0, 21, [0.1] * 20), _result(0.2, 0.2, 1)]  # fmt: skip
    failed = [_result(None, 0.3, 0, status=500), _result(0.1, 0.2, 2)]
    failed[1].disconnected = True
    s = serving.summarize(done + failed, duration_s=10.0, slo={"ttft_s": 1.0, "tpot_s": 0.1})
    assert (s["completed"], s["failed"]) == (4, 2)
    assert (s["input_tokens"], s["output_tokens"]) == (40, 38)
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(3.8)
    tpot = [1.0 / 10, 0.4 / 4, 2.0 / 20]  # (e2e - ttft) / (tokens - 1); one token: no TPOT
    ttft, e2e = [0.1, 0.5, 3.0, 0.2], [1.1, 0.9, 5.0, 0.2]
    itl = [0.1] * 10 + [0.1, 0.1, 0.2] + [0.1] * 20
    for key, values in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e), ("itl_s", itl)):
        assert s[key]["mean"] == pytest.approx(np.mean(values)), key
        for q in (50, 99):
            assert s[key][f"p{q}"] == pytest.approx(np.percentile(values, q)), key
    # Within TTFT <= 1 s and TPOT <= 0.1 s: the first, second and fourth (no TPOT to miss).
    assert s["goodput"] == pytest.approx(0.3)
    tight = serving.summarize(done, 10.0, {"ttft_s": 1.0, "tpot_s": 0.099})
    assert tight["goodput"] == pytest.approx(0.1)  # only the one-token request


def test_sse_decoder_joins_data_lines_and_skips_the_rest():
    d = SSEDecoder()
    lines = [": keep-alive", "", "event: x", 'data: {"a":', "data:1}\r", "", "data: [DONE]",
             "id: 3", ""]  # fmt: skip
    events = [e for e in map(d.line, lines) if e is not None]
    assert events == ['{"a":\n1}', "[DONE]"]
    d.line("data: tail")
    assert d.flush() == "tail" and d.flush() is None


def _chunk(text, finish=None, usage=None, chat=False):
    choice = {"delta": {"content": text}} if chat else {"text": text}
    payload = {"choices": [choice | {"finish_reason": finish}]}
    return f"data: {json.dumps(payload | ({'usage': usage} if usage else {}))}\n\n".encode()


def _fake_server(delays: list[float], usage: dict | None, arrivals: list | None = None):
    """A streaming server: chunk i (text "t{i}") after delays[i] seconds, usage on the last."""
    import httpx

    async def handler(request: httpx.Request) -> httpx.Response:
        if arrivals is not None:
            arrivals.append(time.perf_counter())
        body = json.loads(request.content)
        if body.get("max_tokens", 1) < 0:
            return httpx.Response(400, json={"error": {"message": "max_tokens", "code": 400}})
        chat = request.url.path.endswith("chat/completions")

        async def stream():
            for i, delay in enumerate(delays):
                await asyncio.sleep(delay)
                last = i == len(delays) - 1
                yield _chunk(f"t{i}", "length" if last else None, usage if last else None, chat)
            yield b"data: [DONE]\n\n"

        if not body.get("stream"):
            payload = {"choices": [{"text": "whole", "finish_reason": "stop"}], "usage": usage}
            return httpx.Response(200, json=payload)
        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _send(transport, body, path="/v1/completions", **kw) -> RequestResult:
    import httpx

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://fake" + path, body, **kw)

    return asyncio.run(go())


def test_client_times_first_token_and_gaps():
    delays, usage = [0.2, 0.05, 0.15], {"prompt_tokens": 7, "completion_tokens": 3}
    r = _send(_fake_server(delays, usage), {"stream": True})
    assert r.ok and r.text == "t0t1t2" and r.finish_reason == "length"
    assert (r.prompt_tokens, r.output_tokens) == (7, 3)
    slack = 0.15  # a shared machine only ever adds time
    assert 0.2 <= r.ttft_s < 0.2 + slack
    assert len(r.itl_s) == 2
    for gap, delay in zip(r.itl_s, delays[1:], strict=True):
        assert delay - 0.01 <= gap < delay + slack
    assert r.latency_s >= sum(delays)
    # Chat chunks; no usage: the chunks with text are counted.
    r = _send(_fake_server([0, 0], None), {"stream": True}, "/v1/chat/completions")
    assert r.ok and r.text == "t0t1" and r.output_tokens == 2


def test_client_disconnects_and_reports_errors():
    r = _send(_fake_server([0, 0, 0, 5.0], None), {"stream": True}, disconnect_after=2)
    assert r.disconnected and not r.ok and r.text == "t0t1" and r.latency_s < 2.0
    bad = _send(_fake_server([0], None), {"stream": True, "max_tokens": -1})
    assert bad.status == 400 and not bad.ok and "max_tokens" in bad.error
    whole = _send(_fake_server([], {"prompt_tokens": 2, "completion_tokens": 5}), {})
    assert whole.ok and whole.text == "whole" and whole.output_tokens == 5


def test_requests_go_out_on_schedule():
    arrivals = []
    transport = _fake_server([0.01], {"completion_tokens": 1}, arrivals)
    requests = [("/v1/completions", {"prompt": "p"})] * 6
    start = time.perf_counter()
    results, seconds = asyncio.run(
        serving.run_rate("http://fake", "m", requests, 10.0, {}, seed=3, transport=transport)
    )
    assert all(r.ok for r in results) and seconds >= 0.01
    expected = serving.arrival_times(6, 10.0, seed=3)
    sent = sorted(t - start for t in arrivals)
    for got, want in zip(sent, expected, strict=True):
        assert want - 0.01 <= got < want + 0.2


def test_prometheus_text_parses_into_labelled_samples():
    text = (
        "# HELP pagedspec:kv_cache_used_blocks KV blocks in use.\n"
        "# TYPE pagedspec:kv_cache_used_blocks gauge\npagedspec:kv_cache_used_blocks 3.0\n"
        "# TYPE pagedspec:request_success counter\n"
        'pagedspec:request_success_total{finished_reason="abort"} 2.0\n'
    )
    assert servers.parse_metrics(text) == {
        "pagedspec:kv_cache_used_blocks": 3.0,
        'pagedspec:request_success_total{finished_reason="abort"}': 2.0,
    }


def test_peer_model_dir_names_the_architecture(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "model.safetensors").write_bytes(b"w")
    out = servers.peer_model_dir(str(src), tmp_path / "peer")
    assert json.loads((tmp_path / "peer" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    assert (tmp_path / "peer" / "model.safetensors").read_bytes() == b"w"
    assert servers.peer_model_dir(out, tmp_path / "again") == out  # already named: used as is
    with pytest.raises(ValueError, match="system must be"):
        servers.command("vllm", out, 1)


def _row(rate, ttft_p99, out_tps, completed=4):
    stats = {"mean": 0.1, "p50": 0.09, "p99": 0.3}
    return {"rate": rate, "completed": completed, "failed": 0, "duration_s": 2.5,
            "input_tokens": 40, "output_tokens": 100, "request_throughput": 1.6,
            "output_throughput": out_tps, "goodput": 1.2,
            "ttft_s": stats | {"p99": ttft_p99}, "tpot_s": stats, "itl_s": stats,
            "e2e_s": stats}  # fmt: skip


def _payload():
    machine = {"cpu": "cpu", "cores": 2, "torch_threads": 2, "python": "3", "torch": "2",
               "transformers": "5", "gpu": None, "git_commit": "abc", "command": "c"}  # fmt: skip
    config = {"num_prompts": 4, "input_len": "8:16", "output_len": "4", "chat_max_tokens": 9,
              "burstiness": 1.0, "warmup": 1, "seed": 0}  # fmt: skip
    ours, peer = [_row(2, 0.5, 50), _row("inf", 1, 90)], [_row(2, 1.5, 30), _row("inf", 1.5, 30)]
    systems = {"pagedspec": {"command": "a", "workloads": {"random": ours}},
               "transformers": {"command": "b", "workloads": {"random": peer}}}  # fmt: skip
    slo = {"ttft_s": 2.0, "tpot_s": 0.2}
    return {"benchmark": "serving", "machine": machine, "model": "m", "config": config,
            "slo": slo, "systems": systems, "plot": "serving.png"}  # fmt: skip


def test_serving_targets_and_section_show_every_number():
    payload = _payload()
    found = [(t["name"], t["value"], t["passed"]) for t in report.targets(payload)]
    ttft, tps = "p99 TTFT, transformers / pagedspec", "output tok/s, pagedspec / transformers"
    assert found == [
        (f"serving, random, rate 2: {ttft}", pytest.approx(3.0), True),
        (f"serving, random, rate inf: {ttft}", pytest.approx(1.5), False),
        (f"serving, random, all at once: {tps}", pytest.approx(3.0), True),
    ]
    assert_every_number_shown(payload, "serving.json")

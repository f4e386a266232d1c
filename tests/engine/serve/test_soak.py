"""The soak, short (~30-60 s): a real ``python -m pagedspec.serve`` subprocess with a tiny random
model under mixed load, faults and invalid requests, then every check of ``benchmarks.soak``.
Its pure parts (the plan and the verdicts) are checked without a server."""

import importlib.util
import json

import pytest

from benchmarks import soak
from benchmarks.openai_client import RequestResult

SHARES = {"invalid": 0.1, "disconnect": 0.1, "abort": 0.05}


def test_plan_mixes_the_kinds_and_every_invalid_request_is_invalid():
    reqs = soak.plan(2000, 0, SHARES, 12, 8)
    assert reqs == soak.plan(2000, 0, SHARES, 12, 8)
    share = lambda kind: sum(r["kind"] == kind for r in reqs) / len(reqs)
    for kind, want in SHARES.items():
        assert share(kind) == pytest.approx(want, abs=0.02), kind
    valid = [r for r in reqs if r["kind"] == "valid"]
    assert 0.4 < sum(r["body"]["stream"] for r in valid) / len(valid) < 0.6
    assert 0.4 < sum(r["endpoint"].endswith("chat/completions") for r in valid) / len(valid) < 0.6
    probes = [r for r in valid if r["probe"] is not None]
    assert {r["probe"] for r in probes} == set(range(8))
    for k in range(8):  # a probe's requests differ in streaming only: one output when greedy
        bodies = {json.dumps((r["endpoint"], r["body"] | {"stream": None}), sort_keys=True)
                  for r in probes if r["probe"] == k}  # fmt: skip
        assert len(bodies) == 1
        assert all(r["body"]["temperature"] == 0 for r in probes if r["probe"] == k)
    assert len({r["endpoint"] for r in probes}) == 2
    assert all(r["body"]["stream"] and r["disconnect_after"] for r in reqs
               if r["kind"] == "disconnect")  # fmt: skip
    for r in reqs:
        b = r["body"]
        chat = r["endpoint"].endswith("chat/completions")
        assert ("messages" if chat else "prompt") in b or r.get("invalid", "").startswith("no ")
        assert ("prompt" if chat else "messages") not in b


def test_verdicts_catch_each_failure():
    reqs = soak.plan(40, 1, SHARES, 6, 2)
    good = {"valid": RequestResult(200, 0.1, 0.2, [], "same", 3, 6, "length"),
            "invalid": RequestResult(400, error="bad"),
            "disconnect": RequestResult(200, disconnected=True),
            "abort": RequestResult(0, disconnected=True)}  # fmt: skip
    results = []
    for r in reqs:
        x = RequestResult(**vars(good[r["kind"]]))
        if r["kind"] == "valid":
            x.output_tokens = r["body"]["max_tokens"]
            x.finish_reason = "length" if r["body"]["ignore_eos"] else "stop"
        results.append(x)
    rss = [(t, 1000 + t) for t in range(10)]
    idle = dict.fromkeys(soak.IDLE_ZERO, 0.0)
    args = (reqs, results, {0: "same", 1: "same"}, rss, 10.0, idle, 0, 0.05)
    assert all(c["passed"] for c in soak.evaluate(*args).values())

    def failed(**change) -> list[str]:
        a = dict(zip(("reqs", "results", "alone", "rss", "seconds", "idle", "code", "tol"),
                     args, strict=True)) | change  # fmt: skip
        return [k for k, c in soak.evaluate(*a.values()).items() if not c["passed"]]

    valid = next(i for i, r in enumerate(reqs) if r["kind"] == "valid" and r["body"]["ignore_eos"])
    invalid = next(i for i, r in enumerate(reqs) if r["kind"] == "invalid")
    short = [RequestResult(**vars(x)) for x in results]
    short[valid].output_tokens -= 1
    assert failed(results=short) == ["valid_completed"]
    err = [RequestResult(**vars(x)) for x in results]
    err[invalid].status = 500
    assert failed(results=err) == ["no_5xx", "invalid_got_400"]
    err[invalid].status = 422
    assert failed(results=err) == ["invalid_got_400"]
    assert failed(alone={0: "same", 1: "other"}) == ["greedy_equals_alone"]
    assert failed(idle=idle | {"pagedspec:kv_cache_used_blocks": 2.0}) == ["no_leak_when_idle"]
    assert failed(rss=rss[:5] + [(t, 1200) for t in range(5, 10)]) == []  # a step before half
    grow = [(t, 1000 + 20 * t) for t in range(10)]  # 1100 -> 1180 over the second half
    assert failed(rss=grow) == ["rss_flat_second_half"]
    assert failed(code=-15) == ["sigterm_exit_0"]


@pytest.mark.skipif(
    importlib.util.find_spec("pagedspec.engine.serve") is None, reason="needs the server"
)
def test_short_soak_passes(tiny_llama, tmp_path):
    argv = ["--model", tiny_llama, "--num-requests", "80", "--duration", "20", "--max-tokens",
            "12", "--rss-every", "0.5", "--output-dir", str(tmp_path)]  # fmt: skip
    code = soak.main(argv)
    payload = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, {k: c["detail"] for k, c in payload["checks"].items() if not c["passed"]}
    assert set(payload["counts"]) == {"valid", "invalid", "disconnect", "abort"}
    assert payload["counts"]["invalid"]["statuses"] == {"400": payload["counts"]["invalid"]["sent"]}

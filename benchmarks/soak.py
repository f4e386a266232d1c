"""Soak: a pagedspec server under Poisson load near saturation for a while (default 1,000
requests over 10 minutes), mixing streamed and whole responses, completions and chat, clients
that disconnect mid-stream, clients that give up at a random moment, and invalid requests. Then
it checks: no 5xx; every invalid request got 400; every valid one completed as asked (finish
reason, token count); no KV block held and nothing running once idle (read through /metrics);
resident memory flat over the second half; greedy outputs during the soak equal the same
requests served alone; the server exits 0 on SIGTERM. Exits 1 on any failed check.
``python -m benchmarks.soak --help``.
"""

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import torch

from benchmarks import servers, serving, workload
from benchmarks.openai_client import RequestResult, send

CHATS = [json.loads(line)["messages"] for line in serving.CHAT_DATA.read_text().splitlines()
         if line.strip()]  # fmt: skip
# Requests that must be answered 400: (name, body fields replaced; None: removed). Those naming
# prompt are for completions, messages for chat; the rest for both.
INVALID = (
    ("max_tokens -1", {"max_tokens": -1}), ("temperature -0.5", {"temperature": -0.5}),
    ("top_p 1.5", {"top_p": 1.5}), ("n 0", {"n": 0}), ("unknown field", {"max_tokenz": 5}),
    ("stop_token_ids text", {"stop_token_ids": ["a"]}), ("empty prompt", {"prompt": ""}),
    ("no prompt", {"prompt": None}), ("prompt a number", {"prompt": 3.5}),
    ("no messages", {"messages": None}), ("messages a string", {"messages": "hi"}),
    ("message without role", {"messages": [{"content": "hi"}]}),
)  # fmt: skip
# The server's Prometheus gauges that must read 0 once it is idle (vLLM's names, our prefix).
IDLE_ZERO = ("pagedspec:kv_cache_used_blocks", "pagedspec:num_requests_running",
             "pagedspec:num_requests_waiting")  # fmt: skip
ABORTS = 'pagedspec:request_success_total{finished_reason="abort"}'


def plan(num: int, seed: int, shares: dict, max_tokens: int, num_probes: int) -> list[dict]:
    """Each request's kind (valid, invalid, disconnect, abort), endpoint, body and what the client
    does; every 4th valid request is a greedy probe (one of ``num_probes`` fixed prompts)."""
    rng, out, probe = random.Random(seed), [], 0
    for i in range(num):
        u, kind = rng.random(), "valid"
        for name, share in shares.items():
            if u < share:
                kind = name
                break
            u -= share
        chat = rng.random() < 0.5
        body = {"max_tokens": rng.randint(2, max_tokens), "ignore_eos": rng.random() < 0.8,
                "stream": rng.random() < 0.5}  # fmt: skip
        if rng.random() < 0.5:
            body |= {"temperature": 0.8, "seed": i}
        else:
            body |= {"temperature": 0}
        r = {"i": i, "kind": kind, "probe": None, "disconnect_after": None}
        if kind == "valid" and i % 4 == 0:  # a probe: one body per probe, only "stream" varies
            r["probe"], probe = probe % num_probes, probe + 1
            body |= {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            body.pop("seed", None)
            chat = r["probe"] % 2 == 0
        r["endpoint"] = "/v1/chat/completions" if chat else "/v1/completions"
        text = CHATS[(r["probe"] if r["probe"] is not None else i) % len(CHATS)]
        body |= {"messages": text} if chat else {"prompt": text[0]["content"]}
        if kind == "disconnect":
            body |= {"stream": True, "max_tokens": max_tokens, "ignore_eos": True}
            r["disconnect_after"] = rng.randint(1, 3)
        elif kind == "abort":
            r["abort_after_s"] = rng.uniform(0.0, 2.0)
        elif kind == "invalid":
            other = "prompt" if chat else "messages"
            choices = [(n, c) for n, c in INVALID if other not in c]
            r["invalid"], change = choices[rng.randrange(len(choices))]
            body = {k: v for k, v in (body | change).items() if v is not None}
        r["body"] = body
        out.append(r)
    return out


async def _one(client, url: str, model: str, r: dict) -> RequestResult:
    body = r["body"] | {"model": model}
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    work = send(client, url + r["endpoint"], body, r["disconnect_after"])
    if r["kind"] != "abort":
        return await work
    try:
        return await asyncio.wait_for(work, r["abort_after_s"])
    except asyncio.TimeoutError:
        return RequestResult(error="aborted by the client", disconnected=True)


async def drive(
    server: servers.Server, model: str, reqs: list[dict], rate: float, seed: int, rss_every_s: float
) -> tuple[list[RequestResult], list[tuple[float, int]], float]:
    """Sends ``reqs`` at ``rate`` while sampling the server's RSS; results, samples, seconds."""
    times = serving.arrival_times(len(reqs), rate, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    samples, done = [], asyncio.Event()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def sample():
            while not done.is_set():
                samples.append((time.perf_counter() - start, server.rss_bytes()))
                await asyncio.sleep(rss_every_s)

        async def one(at: float, r: dict) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await _one(client, server.url, model, r)

        sampler = asyncio.ensure_future(sample())
        results = await asyncio.gather(*(one(t, r) for t, r in zip(times, reqs, strict=True)))
        seconds = time.perf_counter() - start
        done.set()
        await sampler
    return list(results), samples, seconds


async def alone(server: servers.Server, model: str, reqs: list[dict]) -> dict[int, str]:
    """Each probe's text served alone (one request at a time, whole response)."""
    texts = {}
    async with httpx.AsyncClient(timeout=600) as client:
        for r in reqs:
            if r["probe"] is not None and r["probe"] not in texts:
                body = r["body"] | {"stream": False}
                texts[r["probe"]] = (await _one(client, server.url, model, r | {"body": body})).text
    return texts


def evaluate(reqs: list[dict], results: list[RequestResult], alone_texts: dict[int, str],
             rss: list[tuple[float, int]], seconds: float, idle: dict[str, float],
             exit_code: int | None, rss_tolerance: float) -> dict:  # fmt: skip
    """Every check: {name: {"passed", "detail"}}."""
    pairs = list(zip(reqs, results, strict=True))
    five = [(r["i"], x.status) for r, x in pairs if x.status >= 500]
    not_400 = [(r["i"], r["invalid"], x.status) for r, x in pairs
               if r["kind"] == "invalid" and x.status != 400]  # fmt: skip
    wrong = []
    for r, x in pairs:
        if r["kind"] != "valid":
            continue
        b = r["body"]
        exact = b.get("ignore_eos")
        tokens_ok = (
            x.output_tokens == b["max_tokens"] if exact else x.output_tokens <= b["max_tokens"]
        )
        reasons = ("length",) if exact else ("stop", "length")
        if not (x.ok and tokens_ok and x.finish_reason in reasons):
            wrong.append((r["i"], x.status, x.finish_reason, x.output_tokens, x.error))
    differ = [(r["i"], x.text[:24], alone_texts[r["probe"]][:24]) for r, x in pairs
              if r["probe"] is not None and x.ok and x.text != alone_texts[r["probe"]]]  # fmt: skip
    probes = sum(r["probe"] is not None and x.ok for r, x in pairs)
    half = [b for t, b in rss if t >= seconds / 2] or [0]
    growth = (max(half) - min(half)) / min(half) if min(half) else float("inf")
    leaked = {k: v for k, v in idle.items() if v}
    checks = {
        "no_5xx": (not five, f"{len(five)} responses >= 500: {five[:5]}"),
        "invalid_got_400": (not not_400, f"{len(not_400)} invalid not 400: {not_400[:5]}"),
        "valid_completed": (not wrong, f"{len(wrong)} valid requests wrong: {wrong[:5]}"),
        "no_leak_when_idle": (not leaked, f"held when idle: {leaked or 'nothing'}"),
        "rss_flat_second_half": (growth <= rss_tolerance,
                                 f"(max - min) / min = {growth:.2%} over {len(half)} samples"),
        "greedy_equals_alone": (not differ, f"{len(differ)} of {probes} probe outputs differ "
                                f"(request, its text, alone): {differ[:3]}"),
        "sigterm_exit_0": (exit_code == 0, f"exit status {exit_code}"),
    }  # fmt: skip
    return {k: {"passed": bool(ok), "detail": d} for k, (ok, d) in checks.items()}


def wait_idle(server: servers.Server, timeout_s: float = 60.0) -> dict[str, float]:
    """The IDLE_ZERO gauges once all read 0, or as they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = {k: m.get(k, float("nan")) for k in IDLE_ZERO}
        if not any(idle.values()) or time.monotonic() > deadline:
            return idle
        time.sleep(0.5)


def _mb(b: int) -> float:
    return round(b / 2**20, 1)


def summary(reqs: list[dict], results: list[RequestResult], rss: list, seconds: float) -> dict:
    """Requests by kind (sent, answered 200 whole, by HTTP status) and RSS figures (MB)."""
    counts = {}
    for r, x in zip(reqs, results, strict=True):
        c = counts.setdefault(r["kind"], {"sent": 0, "ok": 0, "statuses": {}})
        c["sent"] += 1
        c["ok"] += x.ok
        key = str(x.status or "none")
        c["statuses"][key] = c["statuses"].get(key, 0) + 1
    half = [b for t, b in rss if t >= seconds / 2] or [0]
    rss_mb = {"first": _mb(rss[0][1]), "half_min": _mb(min(half)), "half_max": _mb(max(half)),
              "last": _mb(rss[-1][1]), "samples": len(rss)}  # fmt: skip
    tokens = sum(x.output_tokens for x in results if x.ok)
    return {"counts": counts, "rss_mb": rss_mb, "output_tokens": tokens}


def build_parser():
    p = workload.parser(__doc__, model=False)
    p.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--duration", type=float, default=600.0, help="seconds the arrivals span")
    p.add_argument("--max-tokens", type=int, default=32, help="longest output (probes: this)")
    p.add_argument("--probes", type=int, default=8, help="distinct greedy probe prompts")
    for kind, share in (("invalid", 0.1), ("disconnect", 0.1), ("abort", 0.05)):
        p.add_argument(f"--{kind}", type=float, default=share, help="share of the requests")
    p.add_argument("--rss-every", type=float, default=1.0, help="seconds between RSS samples")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    # The KV cache is allocated untouched and the prefix cache keeps freed blocks until the
    # never-used ones run out, so RSS grows, by design, until every KV block has been written
    # once. A 128 MiB cache is warm within the first half; RSS growth after it is a leak.
    p.add_argument("--server-args", default=f"--kv-cache-memory {128 << 20}",
                   help="more flags for python -m pagedspec.serve")  # fmt: skip
    p.add_argument("--tag", default="soak", help="the JSON file's name")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the soak; 0 when every check passed, else 1."""
    args = build_parser().parse_args(argv)
    shares = {k: getattr(args, k) for k in ("invalid", "disconnect", "abort")}
    if args.num_requests < 1 or args.duration <= 0 or args.max_tokens < 2 or args.probes < 1:
        raise ValueError("--num-requests, --probes >= 1, --max-tokens >= 2, --duration > 0")
    if min(shares.values()) < 0 or sum(shares.values()) > 1:
        raise ValueError(f"--invalid, --disconnect, --abort must be >= 0 and sum to <= 1: {shares}")
    if args.model is None:
        from pagedspec.engine.loader.default_model import default_model_dir

        args.model = default_model_dir()
    reqs = plan(args.num_requests, args.seed, shares, args.max_tokens, args.probes)
    rate = args.num_requests / args.duration
    argv = servers.command("pagedspec", args.model, servers.free_port(), args.server_args)
    with servers.Server(argv, servers.scratch_dir() / f"{args.tag}-server.log") as server:
        model = server.model_id()
        asyncio.run(alone(server, model, reqs))  # warm-up
        results, rss, seconds = asyncio.run(
            drive(server, model, reqs, rate, args.seed, args.rss_every)
        )
        idle = wait_idle(server)
        alone_texts = asyncio.run(alone(server, model, reqs))
        aborts = server.metrics().get(ABORTS, 0.0)  # a labelled counter appears once counted
        exit_code = server.stop()
    checks = evaluate(reqs, results, alone_texts, rss, seconds, idle, exit_code, args.rss_tolerance)
    config = {k: getattr(args, k) for k in ("num_requests", "duration", "max_tokens", "probes",
              "rss_tolerance", "seed")} | {"shares": shares}  # fmt: skip
    payload = {"benchmark": "soak", "model": Path(args.model).name, "config": config,
               "machine": workload.machine_info(torch.device("cpu"), "benchmarks.soak"),
               "server": servers.shown(argv), "seconds": seconds, "rate": rate,
               "server_aborts": aborts, "checks": checks}  # fmt: skip
    payload |= summary(reqs, results, rss, seconds)
    workload.save(payload, args.output_dir, args.tag)
    failed = [k for k, c in checks.items() if not c["passed"]]
    print(f"soak: {len(failed)} failed checks: {failed}" if failed else "soak: every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

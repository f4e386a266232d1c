"""Online serving benchmark, in the manner of vLLM's ``bench serve``: each system is started as an
OpenAI-compatible server (pagedspec, and HF ``transformers serve`` as the peer, on the same
weights), then streamed requests arrive at each rate (Poisson, or all at once for "inf"); one
client for both. ``python -m benchmarks.serving --help``.
"""

import asyncio
import json
import math
import random
import time
from pathlib import Path

import httpx
import torch

from benchmarks import servers, workload
from benchmarks.openai_client import RequestResult, send
from benchmarks.timing import percentile

WORKLOADS = ("random", "chat")
CHAT_DATA = workload.DATA / "chat_heldout.jsonl"


def arrival_times(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is sent: the first at 0, then gaps drawn
    from a gamma distribution with mean 1 / ``rate`` (``burstiness`` 1: Poisson arrivals);
    all at 0 for an infinite rate."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def _stats(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarize(results: list[RequestResult], duration_s: float, slo: dict) -> dict:
    """One rate's figures over the requests that succeeded; goodput counts those within
    ``slo`` (``ttft_s``, ``tpot_s``) per second."""
    done = [r for r in results if r.ok]
    tpot = {id(r): (r.latency_s - r.ttft_s) / (r.output_tokens - 1)
            for r in done if r.output_tokens > 1}  # fmt: skip
    good = [r for r in done if r.ttft_s <= slo["ttft_s"] and tpot.get(id(r), 0) <= slo["tpot_s"]]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration_s,
        "input_tokens": sum(r.prompt_tokens or 0 for r in done), "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "goodput": len(good) / duration_s,
        "ttft_s": _stats([r.ttft_s for r in done]), "tpot_s": _stats(list(tpot.values())),
        "itl_s": _stats([x for r in done for x in r.itl_s]),
        "e2e_s": _stats([r.latency_s for r in done]),
    }  # fmt: skip


def make_requests(name: str, spec: workload.ModelSpec, args) -> list[tuple[str, dict]]:
    """(endpoint, body) per request, without the model and stream fields. random: seeded random
    token ids decoded to text (the server re-tokenizes, so prompt lengths move a little), output
    lengths fixed by ignoring EOS; chat: the dataset's conversations in turn, greedy answers up to
    ``--chat-max-tokens`` (its prompts have no reference answers: the model decides)."""
    if name == "chat":
        lines = [line for line in CHAT_DATA.read_text().splitlines() if line.strip()]
        chats = [json.loads(line)["messages"] for line in lines]
        body = {"max_tokens": args.chat_max_tokens, "temperature": 0}
        return [("/v1/chat/completions", body | {"messages": chats[i % len(chats)]})
                for i in range(args.num_prompts)]  # fmt: skip
    input_len = workload.parse_range(args.input_len, "--input-len")
    output_len = workload.parse_range(args.output_len, "--output-len")
    reqs = workload.make_workload(args.num_prompts, input_len, output_len, spec, args.seed)
    return [("/v1/completions", {"prompt": spec.tokenizer.decode(r.prompt_ids),
             "max_tokens": r.output_len, "temperature": 0}) for r in reqs]  # fmt: skip


async def run_rate(
    url: str,
    model: str,
    requests: list,
    rate: float,
    extra: dict,
    seed=0,
    burstiness=1.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[RequestResult], float]:
    """Streams ``requests`` (endpoint, body; ``extra`` added) arriving at ``rate``; their
    results and the seconds from the first send to the last response. ``transport``: httpx's
    (a test's fake server)."""
    times = arrival_times(len(requests), rate, seed, burstiness)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    stream = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=3600, limits=limits, transport=transport) as client:
        start = time.perf_counter()

        async def one(at: float, endpoint: str, body: dict) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send(client, url + endpoint, body | extra | stream)

        results = await asyncio.gather(*(one(t, *r) for t, r in zip(times, requests, strict=True)))
        return list(results), time.perf_counter() - start


def bench_system(system: str, model_dir: str, workloads: dict, args) -> dict:
    """Starts ``system``, warms it up, runs every workload at every rate; its rows."""
    scratch = servers.scratch_dir()
    if system == "transformers":
        model_dir = servers.peer_model_dir(model_dir, scratch / "peer-model")
    argv = servers.command(system, model_dir, servers.free_port(), args.server_args[system])
    rows = {name: [] for name in workloads}
    with servers.Server(argv, scratch / f"serving-{system}.log") as server:
        model = server.model_id()
        for name, requests in workloads.items():
            extra = servers.IGNORE_EOS[system] if name == "random" else {}
            warm = requests[: args.warmup]
            asyncio.run(run_rate(server.url, model, warm, math.inf, extra))
            for rate in args.rates:
                results, seconds = asyncio.run(run_rate(server.url, model, requests, rate, extra,
                                                        args.seed, args.burstiness))  # fmt: skip
                row = {"rate": "inf" if math.isinf(rate) else rate}
                row |= summarize(results, seconds, args.slo)
                rows[name].append(row)
                errors = sorted({str(r.error) for r in results if not r.ok})[:3]
                print(
                    f"{system} {name} rate {row['rate']}: {row['completed']} done, "
                    f"{row['output_throughput']:.1f} out tok/s; errors: {errors}",
                    flush=True,
                )
    return {"command": servers.shown(argv), "workloads": rows}


def plot(payload: dict, path: Path) -> None:
    """p99 TTFT, mean TPOT and p99 end-to-end latency against request rate, per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(payload["systems"].values()))["workloads"])
    panels = (("ttft_s", "p99", "p99 TTFT (s)"), ("tpot_s", "mean", "mean TPOT (s)"),
              ("e2e_s", "p99", "p99 end-to-end (s)"))  # fmt: skip
    fig, axes = plt.subplots(len(names), 3, figsize=(12, 3.6 * len(names)), squeeze=False)
    for row_axes, name in zip(axes, names, strict=True):
        for ax, (key, stat, label) in zip(row_axes, panels, strict=True):
            for system, s in payload["systems"].items():
                rows = s["workloads"][name]
                xs = list(range(len(rows)))
                ax.plot(xs, [r[key][stat] for r in rows], "o-", label=system)
                ax.set_xticks(xs, [str(r["rate"]) for r in rows])
            ax.set(xlabel="request rate (req/s)", ylabel=label, title=f"{name}: {label}")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rates(text: str) -> list[float]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        rates = [float(p) for p in parts]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates must be a comma-separated list of numbers > 0 or inf, "
                         f"got {text!r}")  # fmt: skip
    return rates


def build_parser():
    p = workload.parser(__doc__, model=False)
    p.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    p.add_argument("--systems", default="pagedspec,transformers")
    p.add_argument("--workloads", default="random,chat")
    p.add_argument("--rates", default="1,2,4,inf", help="requests/s; inf: all at once")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", default="64:256", help="random: prompt tokens, N or LO:HI")
    p.add_argument("--output-len", default="32:128", help="random: output tokens, N or LO:HI")
    p.add_argument("--chat-max-tokens", type=int, default=128)
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests per workload")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT <= this (s)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO: TPOT <= this (s)")
    for system in servers.SYSTEMS:
        p.add_argument(f"--{system}-args", default="", help=f"more flags for the {system} server")
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args) -> dict:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not systems or set(systems) - set(servers.SYSTEMS):
        raise ValueError(f"--systems must name some of {servers.SYSTEMS}, got {args.systems!r}")
    if not names or set(names) - set(WORKLOADS):
        raise ValueError(f"--workloads must name some of {WORKLOADS}, got {args.workloads!r}")
    if args.num_prompts < 1 or args.chat_max_tokens < 1 or args.warmup < 0:
        raise ValueError("--num-prompts and --chat-max-tokens must be >= 1, --warmup >= 0")
    args.rates, args.slo = _rates(args.rates), {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}
    args.server_args = {s: getattr(args, f"{s}_args") for s in servers.SYSTEMS}
    if args.model is None:
        from pagedspec.engine.loader.default_model import default_model_dir

        args.model = default_model_dir()
    spec = workload.resolve_model(args.model, "auto", None)
    workloads = {name: make_requests(name, spec, args) for name in names}
    config = {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len",
              "chat_max_tokens", "burstiness", "warmup", "seed")}  # fmt: skip
    machine = workload.machine_info(torch.device("cpu"), "benchmarks.serving")
    payload = {"benchmark": "serving", "machine": machine, "model": spec.name, "config": config,
               "slo": args.slo, "systems": {}}  # fmt: skip
    for system in systems:
        payload["systems"][system] = bench_system(system, args.model, workloads, args)
    workload.save(payload, args.output_dir, "serving", plot)
    return payload


if __name__ == "__main__":
    run(build_parser().parse_args())

"""Offline throughput and latency: pagedspec against HF transformers peers, over batch sizes.

Throughput (the default). For each batch size B (pagedspec's ``max_num_seqs``; the peers'
batch): ``B * waves`` requests with seeded random prompt and output lengths, all submitted at
once, greedy, ignore_eos. The requests of a smaller batch size are a prefix of the larger ones';
every system gets the same token ids. One wave (the default) keeps the sweep short enough for a
2-core CPU and a few-minute GPU check: B requests start together and the run ends as the batch
drains. More waves (--waves 2) queue requests behind the running ones, so finished slots are
refilled, which is where continuous batching gains over static batches. Per system and batch
size: generated and total tokens/s, requests/s, TTFT and TPOT (median, p99) from submission; for
pagedspec also peak KV blocks used, preemptions and speculation acceptance. The roofline column
is the decode ceiling measured on this device (``benchmarks/roofline.py``); pagedspec's fraction
of it counts prefill time as well.

Latency (--latency): pagedspec alone, without and with n-gram speculation. Each iteration
submits B grounded chat prompts (``benchmarks/data/spec_prompts.jsonl``, taken in turn) at once
and runs them to the end, each making exactly --output-len tokens; warm-up iterations first.
TTFT, TPOT and whole-batch latency, p50 / p90 / p99 over the measured requests (iterations for
the batch latency). Prefix caching is off so every iteration pays for its prefill.

    python -m benchmarks.throughput [--batch-sizes 1,4,16] [--input-len 32:256]
        [--output-len 32:128] [--peers hf-static,hf-batch | --no-peers] [--output-dir DIR]
    python -m benchmarks.throughput --latency [--batch-sizes 1,4] [--iters 5]
"""

import argparse
from dataclasses import asdict

from benchmarks import output, peers, report, roofline
from benchmarks.timing import quantiles, run_engine, summarize, ttft_tpot
from benchmarks.workload import (
    ModelSpec,
    chat_prompts,
    kv_blocks_needed,
    make_engine,
    make_workload,
    parse_int_list,
    parse_range,
    release_memory,
    resolve_device,
    resolve_model,
)

DUMMY_NOTE = (
    "dummy weights: pagedspec and the HF peers each use random weights for the same config; "
    "with ignore_eos every request makes exactly its requested tokens whatever their values, "
    "so the work and the throughput do not depend on the weights"
)


def fastest(runs: list[dict]) -> dict:
    """The run with the most generated tokens/s (an error if every run failed), with the rates
    of all runs alongside."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = max(ok, key=lambda r: r["output_tokens_per_s"])
    return best | {"output_tokens_per_s_runs": [r["output_tokens_per_s"] for r in ok]}


def build_engine(args, spec: ModelSpec, batch_size: int, num_kv_blocks: int):
    speculative = None
    if args.speculative_method is not None:
        speculative = {
            "method": args.speculative_method,
            "num_speculative_tokens": args.num_speculative_tokens,
            "draft_model": args.draft_model,
        }
    return make_engine(
        spec, args, batch_size, num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        speculative_config=speculative,
    )  # fmt: skip


def run_throughput(args, spec: ModelSpec, batch_sizes: list[int]) -> dict:
    """The sweep over batch sizes; returns the JSON payload."""
    device, dtype = resolve_device(args.device, args.dtype)
    input_len = parse_range(args.input_len, "input_len")
    output_len = parse_range(args.output_len, "output_len")
    if args.waves < 1 or args.repeats < 1:
        raise ValueError(f"waves and repeats must be >= 1, got {args.waves} and {args.repeats}")
    systems_run = [] if args.no_peers else [p for p in args.peers.split(",") if p]
    for p in systems_run:
        if p not in peers.PEERS:
            raise ValueError(f"peers must be among {peers.PEERS}, got {p!r}")
    rates = roofline.measure(device, dtype)
    cost = roofline.model_cost(spec.config, dtype)
    print(f"{device}: copy {rates.bandwidth_gbs:.1f} GB/s, GEMM {rates.matmul_gflops:.1f} GFLOP/s")
    if spec.load_format == "dummy":
        print(DUMMY_NOTE)
    workload = make_workload(max(batch_sizes) * args.waves, input_len, output_len, spec, args.seed)
    k = args.num_speculative_tokens if args.speculative_method else 0

    hf_model, peer_errors = None, {}
    if systems_run:
        hf_model = peers.load_hf_model(spec.hf_path, spec.config, dtype, device, args.seed)
        check = make_workload(2, (16, 64), (8, 8), spec, args.seed + 1)
        for p in systems_run:  # once each, before anything is timed
            try:
                peers.run_peer(p, hf_model, check, 2, args.max_num_batched_tokens)
            except Exception as e:  # a peer that cannot run here is reported, not faked
                peer_errors[p] = f"{type(e).__name__}: {e}"
                print(f"{p} unavailable: {peer_errors[p]}")

    results = []
    for b in batch_sizes:
        requests = workload[: b * args.waves]
        input_tokens = sum(len(r.prompt_ids) for r in requests)
        # Every system first serves B other requests of the same prompt lengths and 2 output
        # tokens: the prefill shapes, allocator pools and (ours) KV pages are then warm, as in
        # a server that has been running.
        warm = make_workload(b, input_len, (2, 2), spec, args.seed + 1)
        blocks = args.num_kv_blocks or kv_blocks_needed(requests + warm, b, k)
        # The systems take turns, --repeats rounds, and each keeps its fastest run (the least
        # disturbed by the rest of a shared machine); ours starts from a fresh engine each round
        # so that no round finds the prompts in the prefix cache.
        runs: dict[str, list[dict]] = {name: [] for name in ["pagedspec", *systems_run]}
        for _ in range(args.repeats):
            engine = build_engine(args, spec, b, blocks)
            run_engine(engine, warm)
            measured = run_engine(engine, requests)
            del engine
            release_memory(device)
            runs["pagedspec"].append(summarize(measured.timings, input_tokens) | measured.stats)
            for p in systems_run:
                if p in peer_errors:
                    runs[p].append({"error": peer_errors[p]})
                    continue
                try:
                    peers.run_peer(p, hf_model, warm, b, args.max_num_batched_tokens)
                    timings = peers.run_peer(p, hf_model, requests, b, args.max_num_batched_tokens)
                    runs[p].append(summarize(timings, input_tokens))
                except Exception as e:
                    runs[p].append({"error": f"{type(e).__name__}: {e}"})
                release_memory(device)
        systems = {name: fastest(system_runs) for name, system_runs in runs.items()}
        ours = systems["pagedspec"]["output_tokens_per_s"]
        ceiling = roofline.decode_ceiling(b, cost, rates)
        ratios = {
            p: ours / s["output_tokens_per_s"]
            for p, s in systems.items()
            if p != "pagedspec" and "error" not in s
        }
        results.append(
            {
                "batch_size": b,
                "num_requests": len(requests),
                "ceiling_tokens_per_s": ceiling,
                "roofline_fraction": ours / ceiling,
                "systems": systems,
                "ratios": ratios,
            }
        )
        done = ", ".join(f"{n} {s.get('output_tokens_per_s', 0):.1f}" for n, s in systems.items())
        print(f"batch {b}: generated tokens/s {done}; decode ceiling {ceiling:.0f}", flush=True)

    return {
        "model": {"name": spec.name, "load_format": spec.load_format} | asdict(cost),
        "weights_note": DUMMY_NOTE
        if spec.load_format == "dummy"
        else f"pagedspec and the HF peers load the same checkpoint ({spec.hf_path})",
        "roofline": asdict(rates),
        "results": results,
    }


def run_latency(args, spec: ModelSpec, batch_sizes: list[int]) -> dict:
    """No speculation and ngram speculation, each on one engine over every batch size."""
    if args.iters < 1 or args.warmup_iters < 0:
        raise ValueError(
            f"iters must be >= 1 and warmup_iters >= 0, got {args.iters}, {args.warmup_iters}"
        )
    prompts = chat_prompts(spec.tokenizer, "grounded")
    output_len = parse_range(args.output_len, "output_len")
    iterations = args.warmup_iters + args.iters
    # Iteration i of batch size B takes the prompts B * i ... B * (i + 1) - 1, cycled.
    workload = {
        b: make_workload(b * iterations, (1, 1), output_len, spec, args.seed, prompts)
        for b in batch_sizes
    }
    k, largest, results = args.num_speculative_tokens, max(batch_sizes), []
    for name, speculative in (
        ("no-spec", None),
        (f"ngram-k{k}", {"method": "ngram", "num_speculative_tokens": k}),
    ):
        blocks = kv_blocks_needed(workload[largest], largest, k if speculative else 0)
        engine = make_engine(
            spec, args, largest, blocks, enable_prefix_caching=False, speculative_config=speculative
        )
        for b, requests in workload.items():
            timings, batch_s, drafts, accepted = [], [], 0, 0
            for i in range(iterations):
                run = run_engine(engine, requests[i * b : (i + 1) * b])
                if i >= args.warmup_iters:
                    timings += run.timings
                    batch_s.append(max(t.last_token_s for t in run.timings))
                    drafts += run.stats["draft_tokens"]
                    accepted += run.stats["accepted_tokens"]
            ttft, tpot = ttft_tpot(timings)
            results.append(
                {
                    "config": name,
                    "batch_size": b,
                    "iterations": args.iters,
                    "ttft_s": quantiles(ttft),
                    "tpot_s": quantiles(tpot),
                    "batch_latency_s": quantiles(batch_s),
                    "acceptance_rate": accepted / drafts if drafts else None,
                }
            )
            print(f"{name} batch {b}: TTFT p50 {results[-1]['ttft_s']['p50']:.3f} s", flush=True)
        del engine
        release_memory(resolve_device(args.device, args.dtype)[0])
    return {"model": spec.name, "results": results}


def run(args: argparse.Namespace) -> dict:
    """The benchmark --latency picks; the JSON (and throughput's plot) go to --output-dir."""
    spec = resolve_model(args.model, args.load_format, args.model_config)
    device = resolve_device(args.device, args.dtype)[0]
    batch_sizes = parse_int_list(args.batch_sizes, "batch_sizes")
    kind = "latency" if args.latency else "throughput"
    payload = {
        "benchmark": kind,
        "machine": output.machine_info(device, "benchmarks.throughput"),
        "config": {k: v for k, v in vars(args).items() if k not in ("output_dir", "tag")}
        | {"batch_sizes": batch_sizes},
    }
    tag = args.tag or kind
    if args.latency:
        payload |= run_latency(args, spec, batch_sizes)
        output.save(payload, args.output_dir, tag)
    else:
        payload["config"]["peers"] = (
            [] if args.no_peers else [p for p in args.peers.split(",") if p]
        )
        payload |= run_throughput(args, spec, batch_sizes)
        output.save(payload, args.output_dir, tag, plot)
    print(report.section(payload, f"{tag}.json"))
    return payload


def plot(payload: dict, path) -> None:
    rows, m = payload["results"], payload["machine"]
    lines = []
    for name in dict.fromkeys(n for r in rows for n in r["systems"]):
        ok = [r for r in rows if "error" not in r["systems"].get(name, {"error": 1})]
        ys = [r["systems"][name]["output_tokens_per_s"] for r in ok]
        lines.append(([r["batch_size"] for r in ok], ys, name, "-"))
    sizes = [r["batch_size"] for r in rows]
    lines.append((sizes, [r["ceiling_tokens_per_s"] for r in rows], "decode ceiling", "k--"))
    title = f"{payload['model']['name']} on {m['gpu'] or m['cpu']} ({payload['model']['dtype']})"
    output.plot(path, lines, "batch size (max_num_seqs)", "generated tokens/s", title, log=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--latency", action="store_true", help="measure latency (see above), not throughput")
    add("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    add("--load-format", default="auto", choices=("auto", "dummy"))
    add("--model-config", help="with --load-format dummy: a benchmarks/model_configs name or path")
    add("--dtype", default="auto")
    add("--device", default="auto")
    add("--batch-sizes", default="1,2,4,8,16,32,64")
    add("--waves", type=int, default=1, help="requests per batch size = B x waves")
    add("--repeats", type=int, default=2, help="timed runs per system and size; fastest kept")
    add("--input-len", default="32:256", help="N or LO:HI (uniform)")
    add("--output-len", default="32:128", help="N or LO:HI (uniform)")
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--num-kv-blocks", type=int, default=None, help="default: all fit")
    add("--attention-backend", default="auto")
    add("--speculative-method", default=None, choices=("ngram", "draft"))
    add("--num-speculative-tokens", type=int, default=4, help="also latency's ngram k")
    add("--draft-model", default=None)
    add("--peers", default=",".join(peers.PEERS))
    add("--no-peers", action="store_true")
    add("--warmup-iters", type=int, default=2, help="latency: untimed iterations first")
    add("--iters", type=int, default=5, help="latency: measured iterations")
    add("--seed", type=int, default=0)
    add("--output-dir", default="benchmarks/results")
    add("--tag", default=None, help="output file name stem (default: throughput or latency)")
    return parser


def main() -> None:
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()

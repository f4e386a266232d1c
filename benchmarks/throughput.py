"""Offline throughput and latency: pagedspec against HF transformers peers, over batch sizes.

Throughput: per batch size B, B x --waves requests of seeded random lengths submitted at once,
greedy (--temperature > 0: sampled, top-k and top-p off, in pagedspec and the HF peers alike),
ignore_eos (a smaller B's requests are a prefix of a larger one's; more waves queue requests
behind the running ones). Generated and total tokens/s, requests/s, TTFT and TPOT from
submission; pagedspec's KV blocks, preemptions and share of the measured decode ceiling. Peers:
``hf-static``, ``generate`` over static left-padded batches of B, each run to its longest output
(only each request's own tokens count); ``hf-batch``, HF's paged continuous batching driven
directly (each request its own length), at most B requests and MAX_BATCH_TOKENS per step;
``llamacpp`` (when ``llama_cpp`` imports; ``make bench-peers``), llama.cpp's ``llama_batch``
continuous batching, one sequence id per request as llama-server runs it, on the GGUF its own
quantizer wrote at the precision matching pagedspec's (``--precision``, benchmarks.precisions).

Latency (--latency): pagedspec without and with ngram k=4; each iteration submits B grounded chat
prompts, each making --output-len tokens, after --warmup-iters untimed ones; TTFT, TPOT and
whole-batch latency percentiles. Prefix caching is off so every iteration pays for its prefill.
"""

import argparse
import math
import os
import time
from functools import partial

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks import llamacpp, workload
from benchmarks.precisions import PRECISIONS, Precision, engine_options, get_precision
from benchmarks.timing import (
    DeviceShare,
    RequestTiming,
    quantiles,
    run_engine,
    summarize,
    time_calls,
    ttft_tpot,
)
from benchmarks.workload import BenchRequest, kv_blocks_needed, make_engine, make_workload

# The quantised kernels' own rate bounds their runs (device_rates): engine internals by nature.
from pagedspec.engine.loader.model_loader import linear_formats
from pagedspec.engine.models.linear import Linear

HF_PEERS = ("hf-static", "hf-batch")
PEERS = (*HF_PEERS, "llamacpp")
MAX_BATCH_TOKENS = 2048


def load_hf_model(path: str | None, config, dtype, device, seed: int = 0):
    """``path``'s weights (a HF directory or .gguf), or (None) random ones from ``config``."""
    if path is not None:
        folder, gguf = os.path.split(path) if path.endswith(".gguf") else (path, None)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype).to(device)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


class _StepClock(LogitsProcessor, list):
    """Records when each generation step's logits come out (one call per new token)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize(scores.device) if scores.is_cuda else None
        self.append(time.perf_counter())
        return scores


def pad_id(model) -> int:
    """The model's pad token id (0 where it names none)."""
    values = (model.generation_config.pad_token_id, model.config.pad_token_id)
    return next((v for v in values if isinstance(v, int)), 0)


def sampling(temperature: float) -> dict:
    """HF generation options for ``temperature`` (0: greedy), top-k and top-p off as in ours."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


@torch.inference_mode()
def run_hf_static(
    model, requests: list[BenchRequest], batch_size: int, temperature: float = 0.0
) -> list[RequestTiming]:
    """Static batches of ``batch_size`` in request order, each run to its longest output."""
    device, pad, timings, start = model.device, pad_id(model), [], time.perf_counter()
    for lo in range(0, len(requests), batch_size):
        group = requests[lo : lo + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, r in enumerate(group):
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        longest = max(r.output_len for r in group)
        clock = _StepClock()
        config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest,
            pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id,
            **sampling(temperature))  # fmt: skip
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       generation_config=config, logits_processor=[clock])  # fmt: skip
        if len(clock) != longest:
            raise RuntimeError(f"hf-static made {len(clock)} steps, expected {longest}")
        t = [x - start for x in clock]
        timings += [RequestTiming(t[0], t[r.output_len - 1], r.output_len) for r in group]
    return timings


@torch.inference_mode()
def run_hf_batch(
    model, requests: list[BenchRequest], batch_size: int, temperature: float = 0.0
) -> list[RequestTiming]:
    """Transformers' paged continuous batching: up to ``batch_size`` requests per step."""
    longest, page = max(len(r.prompt_ids) + r.output_len for r in requests), 256
    # Every request fits at once: like pagedspec's sizing, no run is memory-bound.
    blocks = batch_size * (math.ceil(longest / page) + 1)
    cb_config = ContinuousBatchingConfig(page_size=page, max_requests_per_batch=batch_size,
        num_blocks=blocks, max_batch_tokens=MAX_BATCH_TOKENS)  # fmt: skip
    # No EOS: every request makes exactly its output_len tokens.
    gen_config = GenerationConfig(max_new_tokens=max(r.output_len for r in requests),
        eos_token_id=-1, pad_token_id=pad_id(model), **sampling(temperature))  # fmt: skip
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.output_len,
                                eos_token_id=-1, record_timestamps=True)  # fmt: skip
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    timings = []
    for i, r in enumerate(requests):
        result = results[f"r{i}"]
        if result.error is not None:
            raise RuntimeError(f"hf-batch request failed: {result.error}")
        stamps, made = result.timestamps or [], len(result.generated_tokens)
        if made != r.output_len or len(stamps) != r.output_len:
            raise RuntimeError(f"hf-batch made {made} tokens, expected {r.output_len}")
        timings.append(RequestTiming(stamps[0] - start, stamps[-1] - start, r.output_len))
    return timings


def run_llamacpp(path: str, warm: list, timed: list, batch_size: int) -> list[RequestTiming]:
    """llama.cpp on a fresh context (a KV stream per sequence, long enough for the longest
    request): ``warm`` first, then ``timed`` measured."""
    longest = max(len(r.prompt_ids) + r.output_len for r in warm + timed)
    threads = torch.get_num_threads()
    llama = llamacpp.LlamaCpp(path, batch_size, -(-longest // 256) * 256, MAX_BATCH_TOKENS, threads)
    try:
        llamacpp.run_batched(llama, warm, batch_size)
        return llamacpp.run_batched(llama, timed, batch_size)[0]
    finally:
        llama.close()


def pick_precision(args) -> Precision | None:
    """--precision's row (its dtype becomes --dtype), else the unquantized row of --dtype."""
    if args.precision is not None:
        p = get_precision(args.precision)
        if args.dtype not in ("auto", p.dtype):
            raise ValueError(f"--dtype {args.dtype} contradicts --precision {p.name} ({p.dtype})")
        args.dtype = p.dtype
        return p
    dtype = workload.resolve_device(args.device, args.dtype)[1]
    rows = (p for p in PRECISIONS.values() if p.quantization is None)
    return next((p for p in rows if getattr(torch, p.dtype) == dtype), None)


DUMMY_NOTE = "dummy weights: random, of the same config, for pagedspec and the HF peers (with "
DUMMY_NOTE += "ignore_eos the work, hence the throughput, does not depend on their values)"


# Decode roofline: a step of B sequences reads every matmul weight once and costs 2 FLOP per
# matmul parameter (layers + LM head; an untied embedding is only looked up) per token; attention
# over the KV cache is left out, so tokens/s <= B / max(bytes / bandwidth, 2 * params * B / flops).


def device_rates(device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> dict:
    """Read bandwidth and GEMM rate past caches and launch costs, fastest of 5. A decode step
    only reads its weights, so the bound is a read (a sum over a buffer far larger than the
    caches), not a copy, which also writes: 10-20% lower on the dev CPU.

    With ``quantization`` the rate is also that of its weight kernel: no library multiplies
    our numerics (int16 activations by int8 or 4-bit weights), and the integer dots outrun
    torch's float32 GEMM, so pricing the matmuls at the float rate made a "ceiling" below what
    the engine measured. The faster of the measured rates bounds the run."""
    read_bytes = 2 << 30 if device.type == "cuda" else 512 << 20
    fastest = lambda fn: min(time_calls(fn, 5, device=device))
    src = torch.ones(read_bytes // 4, dtype=torch.float32, device=device)
    read_bandwidth = read_bytes / fastest(src.sum) / 1e9
    del src
    # A CPU without bf16 arithmetic (AVX2) runs bf16 weights widened to float32, at float32's
    # rate, where torch's own bf16 GEMM crawls: the faster of the two bounds the kernels.
    gflops, sizes = {}, {}
    for gemm_dtype in {dtype, torch.float32} if device.type == "cpu" else {dtype}:
        n = 8192 if device.type == "cuda" else 2048
        if device.type == "cpu" and gemm_dtype != torch.float32:
            n = 512  # CPU half-precision GEMMs run at a few GFLOP/s: 2048 would take minutes
        a, b = (torch.randn(n, n, device=device).to(gemm_dtype) for _ in range(2))
        name = str(gemm_dtype).removeprefix("torch.")
        gflops[name] = 2 * n**3 / fastest(partial(torch.matmul, a, b)) / 1e9
        sizes[name] = n
    if quantization is not None:
        n = 2048
        linear = Linear(n, n, bias=False)
        linear.quantize(linear_formats(linear, quantization)[id(linear.weight)])
        x = torch.randn(n, n)
        name = f"{quantization} kernel"
        with torch.inference_mode():
            gflops[name] = 2 * n**3 / fastest(partial(linear, x)) / 1e9
        sizes[name] = n
    name = max(gflops, key=gflops.get)
    return {"read_bandwidth_gbs": read_bandwidth, "matmul_gflops": gflops[name],
            "device": str(device), "dtype": name, "read_bytes": read_bytes,
            "gemm_size": sizes[name]}  # fmt: skip


def model_cost(config, dtype: torch.dtype, quantization: str | None = None) -> dict:
    """Matmul parameters of ``config``'s model (on a weightless meta model) and their bytes
    (int8: a byte a weight plus a float16 scale per 32; q4_1: half a byte plus two float16 per
    32, its Q8_0 LM head counted at that size too)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embed.weight is head.weight
    params = sum(p.numel() for p in model.parameters() if tied or p is not embed.weight)
    dtype_name = str(dtype).removeprefix("torch.")
    per_weight = {"int8": 1 + 2 / 32, "q4_1": 0.5 + 4 / 32}.get(quantization, dtype.itemsize)
    return {"num_params": params, "lm_head_params": head.weight.numel(),
            "weight_bytes": params * per_weight, "dtype": dtype_name,
            "quantization": quantization}  # fmt: skip


def decode_ceiling(batch_size: int, cost: dict, rates: dict) -> float:
    """Upper bound on decode tokens/s: the slower of reading the weights and the batch's FLOPs."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    read_s = cost["weight_bytes"] / rates["read_bandwidth_gbs"]
    compute_s = 2 * cost["num_params"] * batch_size / rates["matmul_gflops"]
    return 1e9 * batch_size / max(read_s, compute_s)


def run_ceiling(batch_size: int, run: dict, cost: dict, rates: dict) -> float:
    """A timed run's generated tokens/s if its matmuls ran at the measured rates and nothing
    else cost time, prefill included: each prompt token's layer FLOPs and each request's one
    LM-head row (its first token) at the GEMM rate, every later token at
    ``decode_ceiling(batch_size)``. Attention, norms and the KV cache are left out."""
    head, layers = cost["lm_head_params"], cost["num_params"] - cost["lm_head_params"]
    prefill_flops = 2 * (layers * run["input_tokens"] + head * run["num_requests"])
    decode_tokens = run["output_tokens"] - run["num_requests"]
    seconds = prefill_flops / (rates["matmul_gflops"] * 1e9)
    seconds += decode_tokens / decode_ceiling(batch_size, cost, rates)
    return run["output_tokens"] / seconds


def run_throughput(args, spec, batch_sizes: list[int], precision: Precision | None) -> dict:
    """The sweep over batch sizes, pagedspec and the peers taking turns at each."""
    device, dtype = workload.resolve_device(args.device, args.dtype)
    input_len = workload.parse_range(args.input_len, "input_len")
    output_len = workload.parse_range(args.output_len, "output_len")
    options = engine_options(precision) if precision else {}  # ValueError if not in the engine
    quantization = {k: v for k, v in options.items() if k != "dtype"}
    others, rates = args.peers, device_rates(device, dtype, options.get("quantization"))
    cost = model_cost(spec.config, dtype, options.get("quantization"))
    skipped, peer_info = {}, {}
    if "llamacpp" in others:
        reason = llamacpp.unavailable_reason()
        if reason is None and precision is None:
            reason = f"no precision row for dtype {dtype}; pass --precision"
        if reason is None and args.temperature > 0:
            reason = "it runs greedy only here (--temperature > 0)"
        if reason is not None:  # skipped with its reason, not faked
            print(f"skipping peer llamacpp: {reason}", flush=True)
            others, skipped["llamacpp"] = [p for p in others if p != "llamacpp"], reason
        else:
            path = llamacpp.gguf_file(precision.gguf_type, llamacpp.source_gguf(spec))
            peer_info["llamacpp"] = {"version": llamacpp.version(), "gguf": path,
                                     "gguf_type": precision.gguf_type}  # fmt: skip
    uses_hf = any(p in HF_PEERS for p in others)
    hf_model = uses_hf and load_hf_model(spec.hf_path, spec.config, dtype, device, args.seed)
    requests = make_workload(max(batch_sizes) * args.waves, input_len, output_len, spec, args.seed)
    results = []
    for b in batch_sizes:
        timed = requests[: b * args.waves]
        input_tokens = sum(len(r.prompt_ids) for r in timed)
        # Every system first serves B other requests of the same prompt lengths and 2 output
        # tokens, so prefill shapes, allocator pools and our KV pages are warm, as in a server.
        warm = make_workload(b, input_len, (2, 2), spec, args.seed + 1)
        blocks = kv_blocks_needed(timed + warm, b, 0)
        # The systems take turns, --repeats rounds, each keeping its fastest (least disturbed)
        # run; ours from a fresh engine each round, so no round hits the prefix cache.
        runs: dict[str, list[dict]] = {name: [] for name in ["pagedspec", *others]}
        for _ in range(args.repeats):
            engine = make_engine(spec, args, b, blocks, **quantization)
            run_engine(engine, warm, temperature=args.temperature)
            share = DeviceShare(engine)  # (it holds the engine until deleted)
            measured = run_engine(engine, timed, temperature=args.temperature)
            figures = summarize(measured.timings, input_tokens) | measured.stats
            runs["pagedspec"].append(figures | share.figures())
            del engine, share
            workload.release_memory(device)
            for p in others:
                try:  # a peer that cannot run here is reported, not faked
                    if p == "llamacpp":
                        timings = run_llamacpp(peer_info[p]["gguf"], warm, timed, b)
                    else:
                        run = {"hf-static": run_hf_static, "hf-batch": run_hf_batch}[p]
                        run(hf_model, warm, b, args.temperature)
                        timings = run(hf_model, timed, b, args.temperature)
                    runs[p].append(summarize(timings, input_tokens))
                except Exception as e:
                    runs[p].append({"error": f"{type(e).__name__}: {e}"})
                workload.release_memory(device)
        systems = {}
        for name, rs in runs.items():  # the fastest run (an error if all failed), all rates too
            rates_ = [r["output_tokens_per_s"] for r in rs if "error" not in r]
            best = max(rs, key=lambda r: r.get("output_tokens_per_s", -1))
            systems[name] = best | ({"output_tokens_per_s_runs": rates_} if rates_ else {})
        ours, ceiling = systems["pagedspec"]["output_tokens_per_s"], decode_ceiling(b, cost, rates)
        ok = [p for p in others if "error" not in systems[p]]
        ratios = {p: ours / systems[p]["output_tokens_per_s"] for p in ok}
        row = {"batch_size": b, "num_requests": len(timed), "ceiling_tokens_per_s": ceiling}
        row["run_ceiling_tokens_per_s"] = run_ceiling(b, systems["pagedspec"], cost, rates)
        row |= {"roofline_fraction": ours / ceiling, "systems": systems, "ratios": ratios}
        results.append(row)
        done = ", ".join(f"{n} {s.get('output_tokens_per_s', 0):.1f}" for n, s in systems.items())
        print(f"batch {b}: generated tokens/s {done}; decode ceiling {ceiling:.0f}", flush=True)
    same = f"pagedspec and the HF peers load the same checkpoint ({spec.hf_path})"
    same = same if uses_hf else f"pagedspec loads {spec.hf_path}"
    model = {"name": spec.name, "load_format": spec.load_format} | cost
    note = DUMMY_NOTE if spec.load_format == "dummy" else same
    extra = {"precision": vars(precision)} if precision else {}
    extra |= {"peers": peer_info} if peer_info else {}
    extra |= {"skipped_peers": skipped} if skipped else {}
    return {"model": model, "weights_note": note, "roofline": rates, "results": results} | extra


def run_latency(args, spec, batch_sizes: list[int]) -> dict:
    """No speculation and ngram speculation, each on one engine over every batch size."""
    prompts = workload.chat_prompts(spec.tokenizer, "grounded")
    output_len = workload.parse_range(args.output_len, "output_len")
    iterations = args.warmup_iters + args.iters
    k, largest = 4, max(batch_sizes)
    # Iteration i at batch size B takes the prompts B * i ... B * (i + 1) - 1, cycled.
    make = lambda b: make_workload(b * iterations, (1, 1), output_len, spec, args.seed, prompts)
    requests, results = {b: make(b) for b in batch_sizes}, []
    configs = (("no-spec", None), (f"ngram-k{k}", {"method": "ngram", "num_speculative_tokens": k}))
    for name, ngram in configs:
        blocks = kv_blocks_needed(requests[largest], largest, k if ngram else 0)
        options = {"enable_prefix_caching": False, "speculative_config": ngram}
        engine = make_engine(spec, args, largest, blocks, **options)
        for b in batch_sizes:
            runs = [run_engine(engine, requests[b][i * b : (i + 1) * b]) for i in range(iterations)]
            runs = runs[args.warmup_iters :]
            ttft, tpot = ttft_tpot([t for run in runs for t in run.timings])
            drafts = sum(r.stats["draft_tokens"] for r in runs)
            accepted = sum(r.stats["accepted_tokens"] for r in runs)
            batch_s = [max(t.last_token_s for t in run.timings) for run in runs]
            results.append({"config": name, "batch_size": b, "iterations": len(runs),
                "ttft_s": quantiles(ttft), "tpot_s": quantiles(tpot),
                "batch_latency_s": quantiles(batch_s),
                "acceptance_rate": accepted / drafts if drafts else None})  # fmt: skip
            print(f"{name} batch {b}: TTFT p50 {results[-1]['ttft_s']['p50']:.3f} s", flush=True)
        del engine
        workload.release_memory(workload.resolve_device(args.device, args.dtype)[0])
    return {"model": spec.name, "results": results}


def run(args: argparse.Namespace) -> dict:
    """The benchmark --latency picks; the JSON (and throughput's plot) go to --output-dir."""
    spec = workload.resolve_model(args.model, args.load_format, args.model_config)
    batch_sizes = workload.parse_int_list(args.batch_sizes, "batch_sizes")
    kind = "latency" if args.latency else "throughput"
    precision = pick_precision(args)  # sets --dtype from --precision
    if args.latency and precision and precision.quantization:
        raise ValueError("--latency runs unquantized weights: --precision must be fp32 or bf16")
    if args.temperature < 0 or (args.latency and args.temperature):
        raise ValueError(f"--temperature must be >= 0, 0 with --latency; got {args.temperature}")
    device = workload.resolve_device(args.device, args.dtype)[0]
    config = {k: v for k, v in vars(args).items() if k not in ("output_dir", "tag")}
    config |= {"batch_sizes": batch_sizes}
    machine = workload.machine_info(device, "benchmarks.throughput")
    payload = {"benchmark": kind, "machine": machine, "config": config}
    if args.latency:
        payload |= run_latency(args, spec, batch_sizes)
    else:
        payload |= run_throughput(args, spec, batch_sizes, precision)
    workload.save(payload, args.output_dir, args.tag or kind, None if args.latency else plot)
    return payload


def plot(payload: dict, path) -> None:
    rows, m = payload["results"], payload["machine"]
    lines = []
    for name in dict.fromkeys(n for r in rows for n in r["systems"]):
        ok = [r for r in rows if "error" not in r["systems"].get(name, {"error": 1})]
        ys = [r["systems"][name]["output_tokens_per_s"] for r in ok]
        lines.append(([r["batch_size"] for r in ok], ys, name, "o-"))
    sizes = [r["batch_size"] for r in rows]
    lines.append((sizes, [r["ceiling_tokens_per_s"] for r in rows], "decode ceiling", "k--"))
    title = f"{payload['model']['name']} on {m['gpu'] or m['cpu']} ({payload['model']['dtype']})"
    workload.plot(path, lines, "batch size (max_num_seqs)", "generated tokens/s", title, log=True)


def build_parser() -> argparse.ArgumentParser:
    parser = workload.parser(__doc__)
    add = parser.add_argument
    add("--latency", action="store_true", help="measure latency (see above), not throughput")
    add("--load-format", default="auto", choices=("auto", "dummy"))
    add("--model-config", help="with --load-format dummy: a benchmarks/model_configs name or path")
    add("--batch-sizes", default="1,2,4,8,16,32,64")
    add("--waves", type=int, default=1, help="requests per batch size = B x waves")
    add("--repeats", type=int, default=2, help="timed runs per system and size; fastest kept")
    add("--input-len", default="32:256", help="N or LO:HI (uniform)")
    add("--output-len", default="32:128", help="N or LO:HI (uniform)")
    add("--temperature", type=float, default=0.0, help="throughput: 0 greedy, else sampled")
    add("--peers", default=list(HF_PEERS), type=lambda t: [p for p in t.split(",") if p],
        help=f"among {PEERS}; '' for none")  # fmt: skip
    add("--precision", choices=sorted(PRECISIONS), default=None,
        help="weights of pagedspec and llama.cpp (benchmarks.precisions)")  # fmt: skip
    add("--warmup-iters", type=int, default=2, help="latency: untimed iterations first")
    add("--iters", type=int, default=5, help="latency: measured iterations")
    add("--tag", default=None, help="output file name stem (default: throughput or latency)")
    add("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    add("--async-scheduling", action="store_true", help="EngineConfig(async_scheduling=True)")
    add("--tensor-parallel-size", type=int, default=1, help="ranks (CPU threads split among them)")
    return parser


if __name__ == "__main__":
    run(build_parser().parse_args())

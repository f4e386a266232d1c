"""Offline throughput: pagedspec against HF transformers peers, swept over batch sizes.

For each batch size B (pagedspec's ``max_num_seqs``; the peers' batch): ``B * waves`` requests
with seeded random prompt and output lengths, all submitted at once, greedy, ignore_eos. The
requests of a smaller batch size are a prefix of the larger ones'; every system gets the same
token ids. One wave (the default) keeps the sweep short enough for a 2-core CPU and a
few-minute GPU check: B requests start together and the run ends as the batch drains. More
waves (--waves 2) queue requests behind the running ones, so finished slots are refilled, which
is where continuous batching gains over static batches.

Per system and batch size: generated tokens/s, total (prompt + generated) tokens/s, requests/s,
TTFT and TPOT (median, p99) measured from submission; for pagedspec also peak KV blocks used,
preemptions and speculation acceptance. The roofline column is the decode ceiling measured on this
device (``benchmarks/roofline.py``); pagedspec's fraction of it counts prefill time as well.

    python -m benchmarks.throughput [--batch-sizes 1,4,16] [--input-len 32:256]
        [--output-len 32:128] [--peers hf-static,hf-batch | --no-peers] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks import peers as peers_mod
from benchmarks import roofline
from benchmarks.peers import BenchRequest, RequestTiming
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model_loader import resolve_device, resolve_dtype

MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
BLOCK_SIZE = 16  # KV block size of every engine the benchmarks build
DUMMY_NOTE = (
    "dummy weights: pagedspec and the HF peers each use random weights for the same config; "
    "with ignore_eos every request makes exactly its requested tokens whatever their values, "
    "so the work and the throughput do not depend on the weights"
)


@dataclass(frozen=True)
class ModelSpec:
    """Where pagedspec and the HF peers get the model from."""

    engine_model: str | None  # EngineConfig.model
    load_format: str
    hf_path: str | None  # weights for the peers; None: random init from ``config``
    config: object
    tokenizer: object | None
    name: str


def parse_range(text: str, name: str) -> tuple[int, int]:
    """ "32:256" -> (32, 256); "128" -> (128, 128). Both ends >= 1."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_int_list(text: str, name: str) -> list[int]:
    """ "16,1,4" -> [1, 4, 16] (sorted, distinct, each >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be a comma-separated list of integers >= 1, got {text!r}")
    return sorted(set(values))


def resolve_model(model: str | None, load_format: str, model_config: str | None) -> ModelSpec:
    """--model / --load-format / --model-config -> a ModelSpec (config read without weights)."""
    if model_config is not None:
        if load_format != "dummy":
            raise ValueError("--model-config needs --load-format dummy")
        path = MODEL_CONFIG_DIR / f"{model_config}.json"
        if not path.is_file():
            path = Path(model_config)
        if not path.is_file():
            names = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
            raise ValueError(
                f"model_config must be one of {names} or a config.json path, got {model_config!r}"
            )
        config = AutoConfig.from_pretrained(str(path))
        return ModelSpec(str(path), "dummy", None, config, None, path.stem)
    if model is None:
        from engine.default_model import default_model_dir

        path = default_model_dir()
        name = "SmolLM2-135M-Instruct"
    else:
        path, name = os.path.abspath(os.path.expanduser(model)), Path(model).name
    if path.endswith(".gguf"):
        folder, file = os.path.split(path)
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    else:
        config = AutoConfig.from_pretrained(path)
        has_tok = any(
            os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")
        )
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tok else None
    hf_path = None if load_format == "dummy" else path
    return ModelSpec(model, load_format, hf_path, config, tokenizer, name)


def special_token_ids(config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        ids.update(value if isinstance(value, list | tuple) else [] if value is None else [value])
    if tokenizer is not None:
        ids.update(tokenizer.all_special_ids)
    return ids


def random_prompt(rng: random.Random, length: int, vocab_size: int, banned: set[int]) -> list[int]:
    ids = []
    while len(ids) < length:
        token = rng.randrange(vocab_size)
        if token not in banned:
            ids.append(token)
    return ids


def make_workload(
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    banned: set[int],
    seed: int,
    prompts: list[list[int]] | None = None,
) -> list[BenchRequest]:
    """``num`` requests: seeded random token-id prompts (no special ids) of lengths drawn from
    ``input_len``, or ``prompts`` in turn; output lengths drawn from ``output_len``."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        out = rng.randint(*output_len)
        if prompts:
            ids = prompts[i % len(prompts)]
        else:
            ids = random_prompt(rng, rng.randint(*input_len), vocab_size, banned)
        requests.append(BenchRequest(ids, out))
    return requests


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """Prompts from a .txt file (one per line) or a .jsonl file ({"prompt": str} or
    {"prompt_token_ids": [...]} per line)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines] if path.endswith(".jsonl") else lines
    prompts = []
    for record in records:
        if isinstance(record, dict) and "prompt_token_ids" in record:
            prompts.append([int(t) for t in record["prompt_token_ids"]])
            continue
        text = record["prompt"] if isinstance(record, dict) else record
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as prompt_token_ids")
        prompts.append(tokenizer.encode(text, add_special_tokens=True))
    if not prompts:
        raise ValueError(f"prompts file {path!r} has no prompts")
    return prompts


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


def summarize(requests: list[BenchRequest], timings: list[RequestTiming]) -> dict:
    """Throughput and latency figures of one system's run (times in the JSON are seconds)."""
    elapsed = max(t.last_token_s for t in timings)
    out_tokens = sum(t.num_output_tokens for t in timings)
    in_tokens = sum(len(r.prompt_ids) for r in requests)
    ttft = [t.first_token_s for t in timings]
    tpot = [
        (t.last_token_s - t.first_token_s) / (t.num_output_tokens - 1)
        for t in timings
        if t.num_output_tokens > 1
    ]
    return {
        "elapsed_s": elapsed,
        "num_requests": len(timings),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "requests_per_s": len(timings) / elapsed,
        "ttft_median_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_median_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
    }


def fastest(runs: list[dict]) -> dict:
    """The run with the most generated tokens/s (an error if every run failed), with the rates
    of all runs alongside."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    best = max(ok, key=lambda r: r["output_tokens_per_s"])
    return best | {"output_tokens_per_s_runs": [r["output_tokens_per_s"] for r in ok]}


def kv_blocks_needed(requests: list[BenchRequest], batch_size: int, block_size: int, k: int) -> int:
    """Enough KV blocks for the ``batch_size`` longest requests at once: no run is memory-bound."""
    longest = sorted((len(r.prompt_ids) + r.output_len + k + 1 for r in requests), reverse=True)[
        :batch_size
    ]
    return sum(-(-n // block_size) for n in longest) + batch_size


@dataclass(frozen=True)
class EngineRun:
    timings: list[RequestTiming]
    token_ids: list[list[int]]
    stats: dict


def run_engine(
    engine: LLMEngine, requests: list[BenchRequest], ignore_eos: bool = True
) -> EngineRun:
    """Submit every request at once (greedy, at most ``output_len`` tokens each), step to
    completion; per-request timings and tokens, and engine stats over the run."""
    before = engine.get_stats()
    min_free = before.num_free_blocks
    first: dict[str, float] = {}
    done: dict[str, tuple[RequestTiming, list[int]]] = {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=ignore_eos)
        engine.add_request(str(i), r.prompt_ids, params)
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        steps += 1
        min_free = min(min_free, engine.get_stats().num_free_blocks)
        for out in outputs:
            tokens = out.outputs[0].token_ids
            if tokens and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                timing = RequestTiming(first[out.request_id], now, len(tokens))
                done[out.request_id] = (timing, list(tokens))
    after = engine.get_stats()
    drafts = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    rounds = after.num_verifications - before.num_verifications
    stats = {
        "steps": steps,
        "num_kv_blocks": after.num_total_blocks,
        "peak_kv_blocks_used": after.num_total_blocks - min_free,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "verifications": rounds,
        "acceptance_rate": accepted / drafts if drafts else None,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
    }
    ordered = [done[str(i)] for i in range(len(requests))]
    return EngineRun([t for t, _ in ordered], [ids for _, ids in ordered], stats)


def build_engine(args, spec: ModelSpec, batch_size: int, num_kv_blocks: int) -> LLMEngine:
    speculative = None
    if args.speculative_method is not None:
        speculative = {
            "method": args.speculative_method,
            "num_speculative_tokens": args.num_speculative_tokens,
            "draft_model": args.draft_model,
        }
    return LLMEngine(
        EngineConfig(
            model=spec.engine_model,
            load_format=spec.load_format,
            dtype=args.dtype,
            device=args.device,
            block_size=BLOCK_SIZE,
            max_num_seqs=batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks,
            attention_backend=args.attention_backend,
            speculative_config=speculative,
            seed=args.seed,
        )
    )


def release_memory(device: torch.device) -> None:
    """Let the next system start from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> dict:
    """The whole sweep; returns the JSON payload (also written, with the plot, to output_dir)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batch_sizes = parse_int_list(args.batch_sizes, "batch_sizes")
    input_len = parse_range(args.input_len, "input_len")
    output_len = parse_range(args.output_len, "output_len")
    if args.waves < 1:
        raise ValueError(f"waves must be >= 1, got {args.waves}")
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {args.repeats}")
    peers = [] if args.no_peers else [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in peers_mod.PEERS:
            raise ValueError(f"peers must be among {peers_mod.PEERS}, got {p!r}")
    spec = resolve_model(args.model, args.load_format, args.model_config)
    info = roofline.machine_info(device, "benchmarks.throughput")
    rates = roofline.measure(device, dtype)
    print(
        f"device {device}: copy {rates.bandwidth_gbs:.1f} GB/s, "
        f"{rates.dtype} GEMM {rates.matmul_gflops:.1f} GFLOP/s"
    )

    if spec.load_format == "dummy":
        print(DUMMY_NOTE)
    prompts = read_prompts(args.prompts_file, spec.tokenizer) if args.prompts_file else None
    banned = special_token_ids(spec.config, spec.tokenizer)
    vocab = int(spec.config.vocab_size)
    workload = make_workload(
        max(batch_sizes) * args.waves, input_len, output_len, vocab, banned, args.seed, prompts
    )
    check = make_workload(2, (16, 64), (8, 8), vocab, banned, args.seed + 1)
    k = args.num_speculative_tokens if args.speculative_method else 0

    hf_model, peer_errors = None, {}
    if peers:
        hf_model = peers_mod.load_hf_model(spec.hf_path, spec.config, dtype, device, args.seed)
        for p in peers:  # once each, before anything is timed
            try:
                peers_mod.run_peer(p, hf_model, check, 2, args.max_num_batched_tokens)
            except Exception as e:  # a peer that cannot run here is reported, not faked
                peer_errors[p] = f"{type(e).__name__}: {e}"
                print(f"{p} unavailable: {peer_errors[p]}")

    results, cost = [], None
    for b in batch_sizes:
        requests = workload[: b * args.waves]
        # Every system first serves B other requests of the same prompt lengths and 2 output
        # tokens: the prefill shapes, allocator pools and (ours) KV pages are then warm, as in
        # a server that has been running.
        warm = make_workload(b, input_len, (2, 2), vocab, banned, args.seed + 1, prompts)
        blocks = args.num_kv_blocks or kv_blocks_needed(requests + warm, b, BLOCK_SIZE, k)
        # The systems take turns, --repeats rounds, and each keeps its fastest run (the least
        # disturbed by the rest of a shared machine); ours starts from a fresh engine each round
        # so that no round finds the prompts in the prefix cache.
        runs: dict[str, list[dict]] = {name: [] for name in ["pagedspec", *peers]}
        for _ in range(args.repeats):
            engine = build_engine(args, spec, b, blocks)
            if cost is None:
                cost = roofline.model_cost(engine.runner.model)
            run_engine(engine, warm)
            measured = run_engine(engine, requests)
            del engine
            release_memory(device)
            runs["pagedspec"].append(summarize(requests, measured.timings) | measured.stats)
            for p in peers:
                if p in peer_errors:
                    runs[p].append({"error": peer_errors[p]})
                    continue
                try:
                    peers_mod.run_peer(p, hf_model, warm, b, args.max_num_batched_tokens)
                    peer_timings = peers_mod.run_peer(
                        p, hf_model, requests, b, args.max_num_batched_tokens
                    )
                    runs[p].append(summarize(requests, peer_timings))
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
        print_row(results[-1])

    payload = {
        "benchmark": "throughput",
        "machine": info,
        "config": {
            key: value for key, value in vars(args).items() if key not in ("output_dir", "tag")
        }
        | {"peers": peers, "batch_sizes": batch_sizes},
        "model": {"name": spec.name, "load_format": spec.load_format} | asdict(cost),
        "weights_note": DUMMY_NOTE
        if spec.load_format == "dummy"
        else f"pagedspec and the HF peers load the same checkpoint ({spec.hf_path})",
        "roofline": asdict(rates),
        "results": results,
    }
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload["plot"] = f"{args.tag}.png"
    plot(payload, out_dir / payload["plot"])
    (out_dir / f"{args.tag}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out_dir / (args.tag + '.json')} and {out_dir / payload['plot']}")
    return payload


# Issue 4's CPU targets: (batch size, peer, minimum pagedspec / peer generated tokens/s).
TARGETS = ((1, "hf-static", 1.5), (32, "hf-static", 2.0), (32, "hf-batch", 3.0))


def targets(payload: dict) -> list[dict]:
    """The targets this run measured (batch sizes and peers it included), for RESULTS.md."""
    by_size = {r["batch_size"]: r for r in payload["results"]}
    out = []
    for batch_size, peer, threshold in TARGETS:
        ratio = by_size.get(batch_size, {}).get("ratios", {}).get(peer)
        if ratio is not None:
            out.append(
                {
                    "name": f"throughput, batch {batch_size}: pagedspec vs {peer}",
                    "value": ratio,
                    "threshold": threshold,
                    "passed": ratio >= threshold,
                }
            )
    return out


def print_row(row: dict) -> None:
    b = row["batch_size"]
    print(
        f"\nbatch {b}: {row['num_requests']} requests, "
        f"decode ceiling {row['ceiling_tokens_per_s']:.0f} tok/s"
    )
    print(
        f"{'system':>10} {'out tok/s':>10} {'tot tok/s':>10} {'req/s':>7} {'TTFT ms':>13} "
        f"{'TPOT ms':>13} {'ours/peer':>9}"
    )
    for name, s in row["systems"].items():
        if "error" in s:
            print(f"{name:>10} unavailable: {s['error']}")
            continue
        ratio = row["ratios"].get(name)
        print(
            f"{name:>10} {s['output_tokens_per_s']:10.1f} {s['total_tokens_per_s']:10.1f} "
            f"{s['requests_per_s']:7.2f} "
            f"{s['ttft_median_s'] * 1e3:6.0f}/{s['ttft_p99_s'] * 1e3:<6.0f} "
            f"{s['tpot_median_s'] * 1e3:6.1f}/{s['tpot_p99_s'] * 1e3:<6.1f} "
            f"{'' if ratio is None else f'{ratio:9.2f}'}"
        )
    print(f"pagedspec reaches {row['roofline_fraction']:.1%} of the decode ceiling")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    sizes = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(n for r in rows for n in r["systems"]))
    for name in names:
        points = [
            (r["batch_size"], r["systems"][name]["output_tokens_per_s"])
            for r in rows
            if "error" not in r["systems"].get(name, {"error": 1})
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.plot(sizes, [r["ceiling_tokens_per_s"] for r in rows], "k--", label="decode ceiling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size (max_num_seqs)")
    ax.set_ylabel("generated tokens/s")
    m = payload["machine"]
    ax.set_title(
        f"{payload['model']['name']} on {m['gpu'] or m['cpu']} ({payload['model']['dtype']})"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument(
        "--model-config",
        default=None,
        help="with --load-format dummy: a name from benchmarks/model_configs or a config.json",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--waves", type=int, default=1, help="requests per batch size = B x waves")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed runs per system and batch size; fastest kept"
    )
    parser.add_argument("--input-len", default="32:256", help="N or LO:HI (uniform)")
    parser.add_argument("--output-len", default="32:128", help="N or LO:HI (uniform)")
    parser.add_argument("--prompts-file", default=None, help=".txt or .jsonl prompts, cycled")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: all fit")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--speculative-method", default=None, choices=("ngram", "draft"))
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--peers", default=",".join(peers_mod.PEERS))
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="benchmarks/results")
    parser.add_argument("--tag", default="throughput", help="output file name stem")
    return parser


def main() -> None:
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()

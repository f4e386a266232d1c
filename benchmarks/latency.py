"""Latency of single requests and small batches, with and without n-gram speculation.

Each iteration submits a batch of B grounded chat prompts (``benchmarks/data/spec_prompts.jsonl``,
taken in turn) at once and runs it to the end; each request makes exactly --output-len tokens
(ignore_eos). Warm-up iterations first, then measured ones. Reported per configuration and B:
TTFT, TPOT and whole-batch latency, median / p90 / p99 over the measured requests (iterations for
the batch latency). Prefix caching is off so every iteration pays for its prefill.

    python -m benchmarks.latency [--batch-sizes 1,4] [--iters 5] [--num-speculative-tokens 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import roofline
from benchmarks.peers import BenchRequest
from benchmarks.spec_decode import load_chat_prompts, make_engine
from benchmarks.throughput import (
    BLOCK_SIZE,
    kv_blocks_needed,
    parse_int_list,
    percentile,
    release_memory,
    resolve_model,
    run_engine,
)
from engine.model_loader import resolve_device

QUANTILES = (50, 90, 99)


def _quantiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


def measure(engine, batches: list[list[BenchRequest]], warmup: int) -> dict:
    """Run ``batches`` one after another; statistics over those after the first ``warmup``."""
    ttft, tpot, latency = [], [], []
    drafts = accepted = 0
    for i, batch in enumerate(batches):
        run = run_engine(engine, batch)
        if i < warmup:
            continue
        ttft += [t.first_token_s for t in run.timings]
        tpot += [
            (t.last_token_s - t.first_token_s) / (t.num_output_tokens - 1)
            for t in run.timings
            if t.num_output_tokens > 1
        ]
        latency.append(max(t.last_token_s for t in run.timings))
        drafts += run.stats["draft_tokens"]
        accepted += run.stats["accepted_tokens"]
    return {
        "iterations": len(latency),
        "ttft_s": _quantiles(ttft),
        "tpot_s": _quantiles(tpot),
        "batch_latency_s": _quantiles(latency),
        "acceptance_rate": accepted / drafts if drafts else None,
    }


def run(args) -> dict:
    device = resolve_device(args.device)
    spec = resolve_model(args.model, "auto", None)
    batch_sizes = parse_int_list(args.batch_sizes, "batch_sizes")
    if args.iters < 1 or args.warmup_iters < 0:
        raise ValueError(
            f"iters must be >= 1 and warmup_iters >= 0, got {args.iters} and {args.warmup_iters}"
        )
    prompts = load_chat_prompts(spec.tokenizer, "grounded")
    info = roofline.machine_info(device, "benchmarks.latency")
    k = args.num_speculative_tokens
    configs = {"no-spec": None, f"ngram-k{k}": k}
    requests = [BenchRequest(p, args.output_len) for p in prompts]
    largest = max(batch_sizes)
    results = []
    for name, k in configs.items():
        blocks = kv_blocks_needed(requests, largest, BLOCK_SIZE, k or 0)
        engine = make_engine(args, largest, blocks, k, None)
        for b in batch_sizes:
            iterations = args.warmup_iters + args.iters
            batches = [
                [requests[(i * b + j) % len(requests)] for j in range(b)] for i in range(iterations)
            ]
            row = {"config": name, "batch_size": b} | measure(engine, batches, args.warmup_iters)
            results.append(row)
            print_row(row)
        del engine
        release_memory(device)
    payload = {
        "benchmark": "latency",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "model": spec.name,
        "results": results,
    }
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.tag}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return payload


def print_row(row: dict) -> None:
    def ms(stat: dict) -> str:
        return "/".join(f"{stat[f'p{q}'] * 1e3:.1f}" for q in QUANTILES)

    acc = row["acceptance_rate"]
    print(
        f"{row['config']:>10} B={row['batch_size']:<3} TTFT {ms(row['ttft_s'])} ms  "
        f"TPOT {ms(row['tpot_s'])} ms  batch {ms(row['batch_latency_s'])} ms (p50/p90/p99)"
        + ("" if acc is None else f"  acceptance {acc:.0%}")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--warmup-iters", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="benchmarks/results")
    parser.add_argument("--tag", default="latency")
    return parser


def main() -> None:
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()

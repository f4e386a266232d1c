"""Speculative decoding: n-gram speculation against no speculation and HF prompt lookup.

1. Batch 1, greedy, two workloads of chat prompts (``benchmarks/data/spec_prompts.jsonl``):
   *grounded* (rewrite / correct / extract from a given passage: the answer copies its input) and
   *open* (free-form answers). For each: pagedspec without speculation and with ngram
   k ∈ --k-values; HF transformers ``generate`` plain and with ``prompt_lookup_num_tokens=k``;
   tokens/s, acceptance, and whether the tokens equal pagedspec's non-speculative ones.
   Requests stop at EOS or --max-tokens: greedy decoding is lossless, so every system makes the
   same tokens and tokens/s compares equal work.
2. Batch sweep, per workload: its prompts cycled to B requests, speculation forced on at every
   batch size (``disable_batch_size`` huge) vs off, and the engine default (``SpeculativeConfig``'s
   ``disable_batch_size``) at the largest B; the three take turns at each B, --sweep-repeats
   rounds, and each keeps its fastest run (so three engines are loaded at once). The first B
   where forced speculation is slower than none is the measured crossover that
   ``disable_batch_size`` should sit below; it depends on how often drafts are accepted, hence
   both workloads.

    python -m benchmarks.spec_decode [--k-values 2,4,6,8] [--batch-sizes 1,4,16,32,64]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import torch
from transformers import GenerationConfig

from benchmarks import roofline
from benchmarks.peers import BenchRequest, load_hf_model
from benchmarks.throughput import (
    BLOCK_SIZE,
    kv_blocks_needed,
    parse_int_list,
    release_memory,
    resolve_model,
    run_engine,
)
from engine import EngineConfig, LLMEngine, SpeculativeConfig
from engine.model_loader import resolve_device, resolve_dtype

PROMPTS_FILE = Path(__file__).parent / "data" / "spec_prompts.jsonl"
WORKLOADS = ("grounded", "open")
DEFAULT_DISABLE_BATCH_SIZE = next(
    f.default for f in fields(SpeculativeConfig) if f.name == "disable_batch_size"
)
# Targets on the CPU this project is developed on (see the module doc of each).
TARGET_VS_OURS = 1.8  # best ngram k vs no speculation, grounded workload
TARGET_VS_HF_LOOKUP = 1.2  # best ngram k vs best HF prompt-lookup k, grounded workload
TARGET_LARGE_BATCH = 0.95  # engine default vs no speculation at the largest batch


def load_chat_prompts(tokenizer, workload: str, limit: int | None = None) -> list[list[int]]:
    """The workload's chat prompts as token ids (chat template, generation prompt added)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if tokenizer is None:
        raise ValueError("the chat workloads need a model with a tokenizer")
    records = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    prompts = []
    for record in records:
        if record["workload"] != workload:
            continue
        text = tokenizer.apply_chat_template(
            record["messages"], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts[:limit]


def make_engine(
    args, max_num_seqs: int, num_kv_blocks: int, k: int | None, disable_batch_size: int | None
) -> LLMEngine:
    """No speculation when ``k`` is None; ngram with ``k`` drafts otherwise. Prefix caching is
    off: prompts repeat across runs and would otherwise skip their prefill."""
    speculative = None
    if k is not None:
        speculative = {"method": "ngram", "num_speculative_tokens": k}
        if disable_batch_size is not None:
            speculative["disable_batch_size"] = disable_batch_size
    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=BLOCK_SIZE,
            max_num_seqs=max_num_seqs,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=False,
            speculative_config=speculative,
            seed=args.seed,
        )
    )


class _Tally:
    """Totals of one system and k over the prompts of a workload."""

    def __init__(self) -> None:
        self.seconds, self.outputs = 0.0, []
        self.drafts = self.accepted = self.rounds = 0

    def result(self, speculative_stats: bool) -> dict:
        tokens = sum(len(o) for o in self.outputs)
        out = {"seconds": self.seconds, "tokens": tokens, "tokens_per_s": tokens / self.seconds}
        if speculative_stats:
            out["acceptance_rate"] = self.accepted / self.drafts if self.drafts else None
            rounds = self.rounds
            out["mean_accepted_length"] = (self.accepted + rounds) / rounds if rounds else None
        return out | {"outputs": self.outputs}


def _engine_one(engine: LLMEngine, request: BenchRequest, tally: _Tally) -> None:
    run = run_engine(engine, [request], ignore_eos=False)
    tally.seconds += run.timings[0].last_token_s
    tally.outputs.append(run.token_ids[0])
    tally.drafts += run.stats["draft_tokens"]
    tally.accepted += run.stats["accepted_tokens"]
    tally.rounds += run.stats["verifications"]


@torch.inference_mode()
def _hf_one(model, request: BenchRequest, k: int | None, tally: _Tally) -> None:
    """HF ``generate``, plain (k None) or with prompt lookup of k tokens."""
    pad = model.generation_config.pad_token_id
    config = GenerationConfig(
        max_new_tokens=request.output_len,
        do_sample=False,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=pad if pad is not None else model.config.pad_token_id,
        prompt_lookup_num_tokens=k,
    )
    ids = torch.tensor([request.prompt_ids], device=model.device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
    )
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    tally.seconds += time.perf_counter() - start
    tally.outputs.append(out[0, len(request.prompt_ids) :].tolist())


def batch_one(
    engine: LLMEngine | None, model, requests: list[BenchRequest], k: int | None
) -> dict[str, dict]:
    """Batch 1, one prompt at a time: pagedspec (``engine``, None to skip) and HF (``model``,
    None to skip) take turns on each prompt, so a disturbance on a shared machine falls on both
    alike. Each is warmed up on the first prompt first."""
    systems = {"pagedspec": engine, "hf": model}
    systems = {name: system for name, system in systems.items() if system is not None}
    tallies = {name: _Tally() for name in systems}
    for i, r in enumerate([requests[0], *requests]):
        for name, system in systems.items():
            tally = tallies[name] if i else _Tally()  # the first pass is the warm-up
            if name == "pagedspec":
                _engine_one(system, r, tally)
            else:
                _hf_one(system, r, k, tally)
    return {name: t.result(name == "pagedspec" and k is not None) for name, t in tallies.items()}


def batch_sweep(args, prompts: list[list[int]], batch_sizes: list[int]) -> dict:
    """Output tokens/s per batch size for no speculation, forced speculation (k =
    --sweep-k at every batch size) and, at the largest batch, the engine default."""
    largest = max(batch_sizes)
    workload = {
        b: [BenchRequest(prompts[i % len(prompts)], args.sweep_max_tokens) for i in range(b)]
        for b in batch_sizes
    }
    blocks = kv_blocks_needed(workload[largest], largest, BLOCK_SIZE, args.sweep_k)
    configs = {
        "off": (None, None, batch_sizes),
        "forced": (args.sweep_k, 1 << 30, batch_sizes),
        "default": (args.sweep_k, None, [largest]),
    }
    engines = {
        name: make_engine(args, largest, blocks, k, disable)
        for name, (k, disable, _) in configs.items()
    }
    # Warm-up at the largest batch: it touches every KV page and every allocation size that batch
    # brings. "default" runs only there; warmed at batch 1 like the others
    # it started cold and measured ~7% below "off" (0.93x, twice), against 1.00-1.03x warm.
    for engine in engines.values():
        run_engine(engine, workload[largest])
    # The configs take turns at each batch size, --sweep-repeats rounds; each keeps its fastest
    # run (the least disturbed), so a slow spell of a shared machine does not pick the winner.
    rows: dict[str, dict[int, dict]] = {name: {} for name in configs}
    for b in batch_sizes:
        for _ in range(args.sweep_repeats):
            for name, (_, _, sizes) in configs.items():
                if b not in sizes:
                    continue
                run = run_engine(engines[name], workload[b], ignore_eos=False)
                elapsed = max(t.last_token_s for t in run.timings)
                tokens = sum(len(t) for t in run.token_ids)
                best = rows[name].get(b)
                if best is None or tokens / elapsed > best["tokens_per_s"]:
                    rows[name][b] = {
                        "tokens_per_s": tokens / elapsed,
                        "tokens": tokens,
                        "seconds": elapsed,
                        "acceptance_rate": run.stats["acceptance_rate"],
                    }
                print(
                    f"  sweep {name:>7} batch {b:3d}: {tokens / elapsed:8.1f} tok/s "
                    f"({tokens} tokens)"
                )
    del engines
    release_memory(resolve_device(args.device))
    speedup = {
        b: rows["forced"][b]["tokens_per_s"] / rows["off"][b]["tokens_per_s"] for b in batch_sizes
    }
    slower = [b for b in batch_sizes if speedup[b] < 1.0]
    return {
        "k": args.sweep_k,
        "max_tokens": args.sweep_max_tokens,
        "repeats": args.sweep_repeats,
        "default_disable_batch_size": DEFAULT_DISABLE_BATCH_SIZE,
        "rows": {name: {str(b): v for b, v in r.items()} for name, r in rows.items()},
        "forced_speedup": {str(b): v for b, v in speedup.items()},
        # The first measured batch size where forced speculation loses (None: it never did).
        "crossover_batch_size": slower[0] if slower else None,
        "largest_batch_size": largest,
        "default_vs_off_at_largest": rows["default"][largest]["tokens_per_s"]
        / rows["off"][largest]["tokens_per_s"],
    }


def targets(payload: dict) -> list[dict]:
    """The targets, computed from the measured numbers (used by the table and RESULTS.md)."""
    out = []
    grounded = payload["workloads"].get("grounded")
    if grounded:
        ours = grounded["pagedspec"]
        best_k, best = max(
            ((k, v) for k, v in ours.items() if k != "none"), key=lambda kv: kv[1]["tokens_per_s"]
        )
        out.append(
            {
                "name": f"grounded: ngram (best k={best_k}) vs pagedspec without speculation",
                "value": best["tokens_per_s"] / ours["none"]["tokens_per_s"],
                "threshold": TARGET_VS_OURS,
            }
        )
        hf = grounded.get("hf")
        if hf:
            hf_k, hf_best = max(
                ((k, v) for k, v in hf.items() if k != "none"), key=lambda kv: kv[1]["tokens_per_s"]
            )
            out.append(
                {
                    "name": f"grounded: ngram (best k={best_k}) vs HF prompt lookup "
                    f"(best k={hf_k})",
                    "value": best["tokens_per_s"] / hf_best["tokens_per_s"],
                    "threshold": TARGET_VS_HF_LOOKUP,
                }
            )
    for workload, sweep in (payload.get("batch_sweep") or {}).items():
        out.append(
            {
                "name": f"{workload}, batch {sweep['largest_batch_size']}: engine default ngram "
                f"k={sweep['k']} vs no speculation",
                "value": sweep["default_vs_off_at_largest"],
                "threshold": TARGET_LARGE_BATCH,
            }
        )
    for t in out:
        t["passed"] = t["value"] >= t["threshold"]
    return out


def run(args) -> dict:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    spec = resolve_model(args.model, "auto", None)
    k_values = parse_int_list(args.k_values, "k_values")
    hf_k_values = parse_int_list(args.hf_k_values or args.k_values, "hf_k_values")
    info = roofline.machine_info(device, "benchmarks.spec_decode")
    prompts = {
        w: load_chat_prompts(spec.tokenizer, w, args.num_prompts) for w in args.workloads.split(",")
    }
    requests = {w: [BenchRequest(p, args.max_tokens) for p in ps] for w, ps in prompts.items()}
    every = [r for rs in requests.values() for r in rs]
    blocks = kv_blocks_needed(every, 1, BLOCK_SIZE, max(k_values))

    model = None
    if not args.no_hf:
        model = load_hf_model(spec.hf_path, spec.config, dtype, device, args.seed)
    systems = ["pagedspec"] + ([] if args.no_hf else ["hf"])
    results = {w: {system: {} for system in systems} for w in requests}
    for k in [None, *sorted(set(k_values) | set(hf_k_values))]:
        engine = None
        if k is None or k in k_values:
            engine = make_engine(args, 1, blocks, k, None)
        hf = model if k is None or k in hf_k_values else None
        key = "none" if k is None else str(k)
        for w, rs in requests.items():
            for system, result in batch_one(engine, hf, rs, k).items():
                results[w][system][key] = result
                _print_result(w, system, k, result)
        del engine
        release_memory(device)
    del model
    release_memory(device)
    for systems in results.values():
        reference = systems["pagedspec"]["none"]["outputs"]
        for runs in systems.values():
            for r in runs.values():
                same = sum(a == b for a, b in zip(r.pop("outputs"), reference, strict=True))
                r["same_tokens_as_reference"] = same / len(reference)

    sweep_sizes = parse_int_list(args.batch_sizes, "batch_sizes") if args.batch_sizes else []
    sweep = {}
    for w in args.sweep_workloads.split(",") if sweep_sizes else []:
        sweep[w] = batch_sweep(
            args, load_chat_prompts(spec.tokenizer, w, args.num_prompts), sweep_sizes
        )
    payload = {
        "benchmark": "spec_decode",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "model": spec.name,
        "workloads": results,
        "batch_sweep": sweep,
    }
    payload["targets"] = targets(payload)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload["plot"] = f"{args.tag}.png"
    plot(payload, out_dir / payload["plot"])
    (out_dir / f"{args.tag}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print_summary(payload)
    print(f"wrote {out_dir / (args.tag + '.json')} and {out_dir / payload['plot']}")
    return payload


def _print_result(workload: str, system: str, k: int | None, r: dict) -> None:
    label = f"{system} {'plain' if k is None else f'k={k}'}"
    acc = r.get("acceptance_rate")
    if acc is not None:
        label += f" (acceptance {acc:.0%}, {r['mean_accepted_length']:.2f} tokens/round)"
    print(f"{workload:>8} {r['tokens_per_s']:7.1f} tok/s, {r['tokens']:4d} tokens: {label}")


def print_summary(payload: dict) -> None:
    for workload, sweep in payload["batch_sweep"].items():
        print(
            f"{workload} batch sweep (k={sweep['k']}): forced speculation / none = "
            + ", ".join(f"B{b}: {v:.2f}" for b, v in sweep["forced_speedup"].items())
            + f"; crossover at B={sweep['crossover_batch_size']}"
        )
    for t in payload["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        print(f"{verdict}  {t['name']}: {t['value']:.2f}x (target >= {t['threshold']}x)")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    all_ks: set[int] = set()
    for workload, systems in payload["workloads"].items():
        for system, runs in systems.items():
            base = runs["none"]["tokens_per_s"]
            ks = sorted(int(k) for k in runs if k != "none")
            all_ks.update(ks)
            method = "pagedspec ngram" if system == "pagedspec" else "HF prompt lookup"
            speedups = [runs[str(k)]["tokens_per_s"] / base for k in ks]
            style = "-" if system == "pagedspec" else "--"
            ax.plot(ks, speedups, style, marker="o", label=f"{workload}: {method}")
    ax.set_xticks(sorted(all_ks))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("speculative tokens k")
    ax.set_ylabel("speedup over the same system without speculation")
    ax.set_title(f"{payload['model']}, batch 1, greedy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=8, help="per workload")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k-values", default="2,4,6,8")
    parser.add_argument("--hf-k-values", default=None, help="default: --k-values")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--batch-sizes", default="1,4,16,32,64", help="batch sweep; '' skips it")
    parser.add_argument("--sweep-workloads", default=",".join(WORKLOADS))
    parser.add_argument("--sweep-k", type=int, default=4)
    parser.add_argument("--sweep-max-tokens", type=int, default=32)
    parser.add_argument(
        "--sweep-repeats", type=int, default=2, help="rounds per batch size; the fastest counts"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="benchmarks/results")
    parser.add_argument("--tag", default="spec_decode")
    return parser


def main() -> None:
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()

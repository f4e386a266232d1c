"""Speculative decoding: n-gram and EAGLE against no speculation (and n-gram against HF).

ngram: batch 1, greedy, the *grounded* (answers copy a given passage) and *open* chat prompts of
data/spec_prompts.jsonl; pagedspec without and with ngram k in --k-values, HF ``generate`` plain
and with prompt lookup k. eagle: the EAGLE head (--eagle-head; default: the one shipped for the
default model) on held-out chat (data/chat_heldout.jsonl), batch 1, k=4, at temperature 0 and 0.8
(also argmax drafts, ``sample_drafts=False``, chains without the default draft tree's leaves,
and at temperature 0 chains always of k, with the default leaves and with one more): speedups,
tokens per verification (and of them, tokens from draft-tree leaves), acceptance per draft
position, and the draft cost: median ``propose`` call drafting k tokens, per token, over the
median target ``ModelRunner.forward`` without speculation (both timed by wrapping the methods).
Batch-1 configurations take turns on each prompt after a warm-up pass (stop at EOS or max tokens);
the EAGLE ones --eagle-passes times over their prompts, each pass's speedup reported beside the
pooled one (this CPU's speed drifts by 10-25% within minutes).
Then per method a batch sweep: off, forced on at every B, and the engine default (see ``sweep``).
"""

import collections
import itertools
import json
import statistics
import time

import torch
from transformers import GenerationConfig

from benchmarks import workload
from benchmarks.throughput import load_hf_model, pad_id
from benchmarks.timing import clocked, percentile, run_engine
from benchmarks.workload import BenchRequest, chat_prompts, kv_blocks_needed
from pagedspec import SpeculativeConfig
from pagedspec.engine.config import METHOD_DEFAULTS
from pagedspec.engine.entrypoints.llm import render_chat
from pagedspec.engine.spec_decode.tree import tree_slots

# A sweep run lasts 1.5-5 s and varies by +-10% between runs on a 2-core CPU: with the best of 2,
# the engine default measured 0.88x of off at batch 64 where 5 alternated runs each gave 0.97x.
# On a noisier Xeon VM a round's eagle default / off ratio ranged 0.75-1.23 at batch 16 (the
# two differ only in the last few steps), and with the best of 5 the default (off there) came
# out at 0.90x of off at batch 64: seven rounds, each ratio the median of the rounds' (sweep).
SWEEP_K, SWEEP_REPEATS, EAGLE_K, TEMPERATURE = 4, 7, 4, 0.8
HELDOUT = workload.DATA / "chat_heldout.jsonl"
# The EAGLE part at batch 1, name: (temperature, eagle config or None for no speculation).
# "eagle" is the engine default (METHOD_DEFAULTS: chains stop at min_draft_confidence,
# draft_leaves leaves where their paths score best); "-chain" without leaves; "eagle-k4"
# always drafts k, which the tokens-per-verification figure at k=4 and the draft cost are
# measured on, and "eagle-k4-wide" with one leaf more than the default (a wider tree: more
# tokens per verification, each verified row costing more time on a CPU).
T, ARGMAX, FULL = TEMPERATURE, {"sample_drafts": False}, {"min_draft_confidence": 0.0}
LEAVES = METHOD_DEFAULTS["eagle"]["draft_leaves"]
CHAIN, WIDE = {"draft_leaves": 0}, FULL | {"draft_leaves": LEAVES + 1}
EAGLE_RUNS = {"none": (0.0, None), "eagle": (0.0, {}), "eagle-chain": (0.0, CHAIN),
              "eagle-k4": (0.0, FULL), "eagle-k4-wide": (0.0, WIDE), "none-t": (T, None),
              "eagle-t": (T, {}), "eagle-t-chain": (T, CHAIN),
              "eagle-t-argmax": (T, ARGMAX)}  # fmt: skip
GREEDY_EAGLE = [n for n, (t, config) in EAGLE_RUNS.items() if t == 0 and config is not None]


@torch.inference_mode()
def hf_generate(model, request: BenchRequest, k: int | None) -> tuple[float, list[int], dict]:
    """Seconds and tokens of HF ``generate``, plain (k None) or with prompt lookup of k tokens."""
    config = GenerationConfig(
        max_new_tokens=request.output_len, do_sample=False, prompt_lookup_num_tokens=k,
        eos_token_id=model.generation_config.eos_token_id, pad_token_id=pad_id(model),
    )  # fmt: skip
    ids = torch.tensor([request.prompt_ids], device=model.device)
    mask, start = torch.ones_like(ids), time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    tokens = out[0, len(request.prompt_ids) :].tolist()  # on CUDA, waits for the work
    return time.perf_counter() - start, tokens, {}


def engine_call(engine, temperature: float = 0.0):
    """One request on ``engine`` -> (seconds to its last token, its tokens, the run's stats)."""

    def call(request: BenchRequest) -> tuple[float, list[int], dict]:
        run = run_engine(engine, [request], ignore_eos=False, temperature=temperature)
        return run.timings[0].last_token_s, run.token_ids[0], run.stats

    return call


def take_turns(systems: dict, requests: list[BenchRequest], passes: int = 1) -> dict[str, dict]:
    """Each system (name: call) on each request in turn, ``passes`` times over the requests after
    a warm-up pass: tokens/s (pooled, and of each pass), figures of its speculation, and its
    outputs (for ``same_tokens``)."""
    done = {name: [[] for _ in range(passes)] for name in systems}
    for call in systems.values():  # the warm-up
        call(requests[0])
    for p in range(passes):
        for r in requests:
            for name, call in systems.items():
                done[name][p].append(call(r))
    results = {}
    for name, by_pass in done.items():
        runs = [r for p in by_pass for r in p]
        seconds, tokens = sum(r[0] for r in runs), sum(len(r[1]) for r in runs)
        result = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        if passes > 1:
            result["tokens_per_s_by_pass"] = [_rate(p) for p in by_pass]
        stats = [r[2] for r in runs]
        if sum(s.get("draft_tokens", 0) for s in stats):
            total = lambda key, stats=stats: sum(s[key] for s in stats)
            accepted, rounds = total("accepted_tokens"), total("verifications")
            by_position = map(sum, zip(*(s["accepted_by_position"] for s in stats), strict=True))
            result |= {"acceptance_rate": accepted / total("draft_tokens"),
                       "mean_accepted_length": (accepted + rounds) / rounds,
                       "drafts_per_verification": total("draft_tokens") / rounds,
                       "acceptance_by_position": [a / rounds for a in by_position]}  # fmt: skip
            if total("leaf_tokens"):  # a draft tree's tokens from leaves
                result["leaf_tokens_per_verification"] = total("leaf_tokens") / rounds
        results[name] = result | {"outputs": [r[1] for r in runs]}
    return results


def _rate(runs: list[tuple[float, list[int], dict]]) -> float:
    """Tokens per second over ``take_turns`` runs (seconds, tokens, stats)."""
    return sum(len(r[1]) for r in runs) / sum(r[0] for r in runs)


def same_tokens(results: dict[str, dict], reference: str, names) -> None:
    """Each of ``names``' share of outputs equal to the reference's (the outputs are dropped)."""
    ref = results[reference]["outputs"]
    for name in names:
        out = results[name].pop("outputs")
        results[name]["same_tokens_as_reference"] = sum(map(list.__eq__, out, ref)) / len(ref)


def sweep(args, spec, prompts: list[list[int]], speculative: dict, sizes, default_sizes) -> dict:
    """Output tokens/s per batch size, ``prompts`` cycled: speculation off, forced on at every
    size (``disable_batch_size`` huge) and the engine default at ``default_sizes``. The configs
    take turns at each size, --sweep-repeats rounds, each keeping its fastest run. A config's
    ``vs_off`` is the median over the rounds of its tokens/s over off's in the same round: a
    round's runs are seconds apart, so the ratio cancels the host's slow drift that a ratio of
    two best runs keeps (on a noisy VM, two configs taking the same steps came out 0.90x apart
    that way). The first size where forced loses is the crossover that ``disable_batch_size``
    should sit below. Each row also has its tokens per verification and ``same_tokens``: the
    share of requests (over the rounds) whose greedy tokens equal off's in the same round."""
    forced = speculative | {"disable_batch_size": 1 << 30}
    configs = {"off": sizes, "forced": sizes, "default": default_sizes}
    n = args.sweep_max_tokens
    reqs = {b: [BenchRequest(prompts[i % len(prompts)], n) for i in range(b)] for b in sizes}
    blocks = kv_blocks_needed(reqs[sizes[-1]], sizes[-1], SWEEP_K)
    engines = {
        name: workload.make_engine(spec, args, sizes[-1], blocks, enable_prefix_caching=False,
                                   speculative_config=config)
        for name, config in (("off", None), ("forced", forced), ("default", speculative))
    }  # fmt: skip
    # Warm-up at each config's largest batch: it touches every KV page and allocation size (warmed
    # at batch 1, "default" once started cold and measured ~7% below "off").
    for name, engine in engines.items():
        run_engine(engine, reqs[max(configs[name])])
    rows: dict[str, dict] = {name: {} for name in engines}
    rates: dict[tuple[str, str], list[float]] = collections.defaultdict(list)  # (name, B): rounds
    same: dict[tuple[str, str], list[bool]] = collections.defaultdict(list)  # per request
    repeats = args.sweep_repeats
    for b, _, (name, engine) in itertools.product(sizes, range(repeats), engines.items()):
        if b in configs[name]:
            run = run_engine(engine, reqs[b], ignore_eos=False)
            seconds = max(t.last_token_s for t in run.timings)
            tokens = sum(len(t) for t in run.token_ids)
            row = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
            rates[name, str(b)].append(row["tokens_per_s"])
            if name == "off":
                reference = run.token_ids  # the configs take turns, off first
            same[name, str(b)] += [x == y for x, y in zip(run.token_ids, reference, strict=True)]
            if row["tokens_per_s"] > rows[name].get(str(b), {}).get("tokens_per_s", 0):
                rows[name][str(b)] = row | {
                    "acceptance_rate": run.stats["acceptance_rate"],
                    "tokens_per_verification": run.stats["mean_accepted_length"],
                }
            print(f"  sweep {name:>7} batch {b:3d}: {tokens / seconds:8.1f} tok/s", flush=True)
    del engines
    workload.release_memory(workload.resolve_device(args.device, args.dtype)[0])
    for (name, b), runs in rates.items():
        if name != "off":
            ratios = [x / y for x, y in zip(runs, rates["off", b], strict=True)]
            rows[name][b]["vs_off"] = statistics.median(ratios)
            rows[name][b]["same_tokens"] = statistics.mean(same[name, b])
    speedup = {b: row["vs_off"] for b, row in rows["forced"].items()}
    slower, b = [int(b) for b, x in speedup.items() if x < 1.0], str(sizes[-1])
    return {
        "method": speculative["method"], "k": SWEEP_K, "max_tokens": n, "repeats": repeats,
        "default_disable_batch_size": SpeculativeConfig.of(speculative).disable_batch_size,
        "rows": rows,
        "forced_speedup": speedup, "crossover_batch_size": slower[0] if slower else None,
        "largest_batch_size": sizes[-1],
        "default_vs_off_at_largest": rows["default"][b]["vs_off"],
    }  # fmt: skip


def run_ngram(args, spec) -> tuple[dict, dict]:
    """The batch-1 table per workload and the batch sweep per workload."""
    device, dtype = workload.resolve_device(args.device, args.dtype)
    k_values = workload.parse_int_list(args.k_values, "k_values")
    prompts = {w: chat_prompts(spec.tokenizer, w, args.num_prompts) for w in workload.WORKLOADS}
    requests = {w: [BenchRequest(p, args.max_tokens) for p in ps] for w, ps in prompts.items()}
    blocks = kv_blocks_needed([r for rs in requests.values() for r in rs], 1, max(k_values))
    model = load_hf_model(spec.hf_path, spec.config, dtype, device, args.seed)
    results = {w: {"pagedspec": {}, "hf": {}} for w in requests}
    for k in [None, *k_values]:
        config = {"method": "ngram", "num_speculative_tokens": k} if k else None
        engine = workload.make_engine(spec, args, 1, blocks, enable_prefix_caching=False,
                                      speculative_config=config)  # fmt: skip
        hf = lambda r, k=k, model=model: hf_generate(model, r, k)
        for w, rs in requests.items():
            turns = take_turns({"pagedspec": engine_call(engine), "hf": hf}, rs)
            for system, result in turns.items():
                results[w][system]["none" if k is None else str(k)] = result
                print(f"{w} {system} k={k}: {result['tokens_per_s']:.1f} tok/s", flush=True)
        del engine
        workload.release_memory(device)
    del model
    workload.release_memory(device)
    for systems in results.values():
        flat = {(s, k): r for s, runs in systems.items() for k, r in runs.items()}
        same_tokens(flat, ("pagedspec", "none"), list(flat))
    sizes = workload.parse_int_list(args.batch_sizes, "batch_sizes") if args.batch_sizes else []
    ngram = {"method": "ngram", "num_speculative_tokens": SWEEP_K}
    return results, {
        w: sweep(args, spec, prompts[w], ngram, sizes, sizes[-1:]) for w in prompts if sizes
    }


def heldout_chat_prompts(tokenizer) -> list[list[int]]:
    """The held-out chat prompts (``HELDOUT``), rendered with the chat template."""
    records = [json.loads(x) for x in HELDOUT.read_text().splitlines() if x.strip()]
    return [render_chat(tokenizer, r["messages"])[1] for r in records]


def eagle_kv_blocks(requests: list[BenchRequest], k: int, configs: list[dict | None]) -> int:
    """KV blocks for batch 1 at the widest draft tree among ``configs`` (eagle fields over k;
    None: no speculation): each config's chain and leaves, their defaults filled in."""
    eagle = {"method": "eagle", "num_speculative_tokens": k}
    specs = [SpeculativeConfig.of(eagle | c) for c in configs if c is not None]
    slots = max((tree_slots(s.num_speculative_tokens, s.draft_leaves) for s in specs), default=0)
    return kv_blocks_needed(requests, 1, slots)


def run_eagle(args, spec) -> dict:
    """The EAGLE part (see the module doc)."""
    prompts = heldout_chat_prompts(spec.tokenizer)[: args.eagle_prompts]
    requests = [BenchRequest(p, args.eagle_max_tokens) for p in prompts]
    blocks = eagle_kv_blocks(requests, EAGLE_K, [config for _, config in EAGLE_RUNS.values()])
    eagle = {"method": "eagle", "draft_model": args.eagle_head, "num_speculative_tokens": EAGLE_K}
    engines, systems = {}, {}
    for name, (temperature, config) in EAGLE_RUNS.items():
        key = None if config is None else tuple(config.items())
        if key not in engines:
            engines[key] = workload.make_engine(spec, args, 1, blocks, enable_prefix_caching=False,
                speculative_config=None if config is None else eagle | config)  # fmt: skip
        systems[name] = engine_call(engines[key], temperature)
    target_s = clocked(engines[None].runner, "forward")
    full = lambda scheduled, ks, *_: max(ks, default=0) == EAGLE_K  # drafts k tokens
    draft_s = clocked(engines[tuple(FULL.items())].spec.proposer, "propose", full)
    runs = take_turns(systems, requests, args.eagle_passes)
    same_tokens(runs, "none", [*GREEDY_EAGLE, "none"])  # greedy: lossless
    for name, r in runs.items():
        r["temperature"] = EAGLE_RUNS[name][0]
        r.pop("outputs", None)  # sampled: no reference to match
        print(f"eagle {name}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    draft, target = percentile(draft_s, 50) / EAGLE_K, percentile(target_s, 50)
    del engines, systems
    workload.release_memory(workload.resolve_device(args.device, args.dtype)[0])
    sizes = (
        workload.parse_int_list(args.eagle_batch_sizes, "eagle_batch_sizes")
        if args.eagle_batch_sizes
        else []
    )
    return {
        "head": args.eagle_head or "shipped (engine/spec_decode/heads/smollm2-135m-eagle)",
        "k": EAGLE_K, "num_prompts": len(requests), "max_tokens": args.eagle_max_tokens,
        "passes": args.eagle_passes,
        "runs": runs, "draft_cost": {"draft_s_per_token": draft, "target_step_s": target,
                                     "share": draft / target},
        "batch_sweep": sweep(args, spec, prompts, eagle, sizes, sizes) if sizes else None,
    }  # fmt: skip


def run(args) -> dict:
    """The parts --methods names; the JSON (and the n-gram plot) go to --output-dir."""
    spec = workload.resolve_model(args.model, "auto", None)
    methods = args.methods.split(",")
    device = workload.resolve_device(args.device, args.dtype)[0]
    config = {k: v for k, v in vars(args).items() if k != "output_dir"}
    machine = workload.machine_info(device, "benchmarks.spec_decode")
    payload = {"benchmark": "spec_decode", "machine": machine, "config": config, "model": spec.name}
    payload |= {"workloads": {}, "batch_sweep": {}}
    if "ngram" in methods:  # saved before the EAGLE part, which fails if its head is missing
        payload["workloads"], payload["batch_sweep"] = run_ngram(args, spec)
        workload.save(payload, args.output_dir, "spec_decode", plot)
    if "eagle" in methods:
        payload["eagle"] = run_eagle(args, spec)
        workload.save(
            payload, args.output_dir, "spec_decode", plot if payload["workloads"] else None
        )
    return payload


def plot(payload: dict, path) -> None:
    lines = []
    for workload_name, systems in payload["workloads"].items():
        for system, runs in systems.items():
            ks = sorted(int(k) for k in runs if k != "none")
            speedups = [runs[str(k)]["tokens_per_s"] / runs["none"]["tokens_per_s"] for k in ks]
            ours = system == "pagedspec"
            label = f"{workload_name}: {'pagedspec ngram' if ours else 'HF prompt lookup'}"
            lines.append((ks, speedups, label, "o-" if ours else "o--"))
    ylabel = "speedup over the same system without speculation"
    title = f"{payload['model']}, batch 1, greedy"
    workload.plot(path, lines, "speculative tokens k", ylabel, title, log=False)


def build_parser():
    parser = workload.parser(__doc__)
    add = parser.add_argument
    add("--methods", default="ngram", choices=("ngram", "eagle", "ngram,eagle"))
    add("--num-prompts", type=int, default=8, help="ngram: per workload")
    add("--max-tokens", type=int, default=96, help="ngram")
    add("--k-values", default="2,4,6,8", help="ngram")
    add("--batch-sizes", default="1,4,16,32,64", help="ngram sweep; '' skips it")
    add("--sweep-max-tokens", type=int, default=32, help="both sweeps")
    add("--sweep-repeats", type=int, default=SWEEP_REPEATS, help="both sweeps: rounds")
    add("--eagle-head", default=None, help="a head directory (default: the shipped head)")
    add("--eagle-prompts", type=int, default=8)
    add("--eagle-max-tokens", type=int, default=64)
    add("--eagle-passes", type=int, default=3, help="timed passes over the eagle prompts")
    add("--eagle-batch-sizes", default="2,4,8,16,64", help="eagle sweep; '' skips it")
    return parser


if __name__ == "__main__":
    run(build_parser().parse_args())

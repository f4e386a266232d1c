"""Structured outputs (issue 52) on the default model (or --model): validity, cost and speculation.

- validity: each schema of data/json_schemas.json (20: nested objects, enums, arrays, numbers,
  optional fields, patterns) asked for in a chat prompt at temperature 0 and 0.8, all at once:
  the share of answers that parse and validate (``jsonschema``), finish reasons;
- throughput: --batch-size requests of the grounded chat prompts, --max-tokens tokens each, EOS
  ignored, constrained to a schema (an array of records, long enough not to close early) and
  unconstrained, taking turns --rounds times: generated tokens/s, constrained / unconstrained;
- speculation: batch 1 on --eagle-prompts held-out chat prompts asking for the "record" schema,
  greedy, EAGLE (the shipped head, k=4) against no speculation, both constrained, over
  --eagle-passes passes after a warm-up one, taking turns: the median pass's speedup, tokens
  per verification (and draft-tree leaf tokens), identical tokens;
- mask cost: the engine's mask per sampled row at batch 1 (the step sampler's
  ``_mask_grammar``: bitmasks filled by llguidance, unpacked and applied to the logits) beside
  llguidance's own ``compute_bitmask`` on the same matchers (timed by wrapping both).
"""

import json
import statistics
import time

import jsonschema

import pagedspec.engine.sample.step_sampler as sampler_module
from benchmarks import workload
from benchmarks.spec_decode import HELDOUT
from pagedspec import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from pagedspec.engine.entrypoints.llm import render_chat

SCHEMAS = workload.DATA / "json_schemas.json"
RECORDS = {  # what the throughput and speculation runs ask for: a list of records
    "type": "array",
    "minItems": 8,
    "maxItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 32},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["id", "name", "score"],
        "additionalProperties": False,
    },
}


def ask(schema_name: str, schema: dict) -> list[dict]:
    text = f"Reply with JSON only: a {schema_name} matching this schema: {json.dumps(schema)}"
    return [{"role": "user", "content": text}]


def run_all_at_once(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> tuple:
    """(outputs in prompt order, seconds, generated tokens)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    final, start = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    seconds = time.perf_counter() - start
    outs = [final[str(i)] for i in range(len(prompts))]
    return outs, seconds, sum(len(c.token_ids) for c in outs)


def validity(engine: LLMEngine, max_tokens: int, seed: int) -> dict:
    schemas = json.loads(SCHEMAS.read_text())
    rows, prompts, params = [], [], []
    for temperature in (0.0, 0.8):
        for s in schemas:
            prompts.append(render_chat(engine.tokenizer, ask(s["name"], s["schema"]))[1])
            params.append(
                SamplingParams(
                    temperature=temperature,
                    max_tokens=max_tokens,
                    seed=seed,
                    structured_outputs={"json": s["schema"]},
                )
            )
            rows.append({"schema": s["name"], "temperature": temperature})
    outs, _, _ = run_all_at_once(engine, prompts, params)
    for row, out, s in zip(rows, outs, schemas * 2, strict=True):
        try:
            jsonschema.validate(json.loads(out.text), s["schema"])
            row["valid"] = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            row["valid"] = False
        row |= {"finish_reason": out.finish_reason, "tokens": len(out.token_ids)}
    return {"rows": rows, "valid_share": sum(r["valid"] for r in rows) / len(rows)}


def throughput(engine: LLMEngine, args) -> dict:
    chats = workload.chat_prompts(engine.tokenizer, "grounded")
    prompts = [chats[i % len(chats)] for i in range(args.batch_size)]
    runs = {"constrained": [], "unconstrained": []}
    for _ in range(args.rounds + 1):  # the first round warms up (the grammar's lexer is lazy)
        for name in runs:
            so = StructuredOutputsParams(json=RECORDS) if name == "constrained" else None
            params = SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, structured_outputs=so
            )
            _, seconds, tokens = run_all_at_once(engine, prompts, [params] * len(prompts))
            runs[name].append(tokens / seconds)
    runs = {name: r[1:] for name, r in runs.items()}
    ratios = [c / u for c, u in zip(runs["constrained"], runs["unconstrained"], strict=True)]
    return {
        "tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
        "constrained_vs_unconstrained": statistics.median(ratios),
    }


def speculation(plain: LLMEngine, eagle: LLMEngine, args) -> dict:
    """Passes over the prompts (the first a warm-up); in each, every prompt runs without and
    with EAGLE, in turns (off first on even prompts of even passes...), so the CPU's drift
    falls on both; the speedup is the median of the passes'."""
    lines = HELDOUT.read_text().splitlines()[: args.eagle_prompts]
    conversations = [json.loads(line)["messages"] for line in lines]
    prompts = [
        render_chat(plain.tokenizer, [*messages[:-1], *ask("list of records", RECORDS)])[1]
        for messages in conversations
    ]
    so = StructuredOutputsParams(json=RECORDS)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.eagle_max_tokens, structured_outputs=so
    )
    engines, passes, same = {"off": plain, "eagle": eagle}, [], True
    before = eagle.get_stats()
    for number in range(args.eagle_passes + 1):
        seconds, tokens = {"off": 0.0, "eagle": 0.0}, {"off": 0, "eagle": 0}
        for j, prompt in enumerate(prompts):
            got = {}
            for name in ("off", "eagle") if (j + number) % 2 == 0 else ("eagle", "off"):
                (out,), s, n = run_all_at_once(engines[name], [prompt], [params])
                seconds[name] += s
                tokens[name] += n
                got[name] = out.token_ids
            same &= got["off"] == got["eagle"]
        passes.append({name: tokens[name] / seconds[name] for name in seconds})
    after = eagle.get_stats()
    rounds = after.num_verifications - before.num_verifications
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    timed = passes[1:]
    return {
        "tokens_per_s": {name: statistics.median(p[name] for p in timed) for name in engines},
        "speedup": statistics.median(p["eagle"] / p["off"] for p in timed),
        "speedup_by_pass": [p["eagle"] / p["off"] for p in timed],
        "identical_tokens": same,
        "tokens_per_verification": (accepted + rounds) / rounds if rounds else None,
        "leaf_tokens": after.num_leaf_tokens - before.num_leaf_tokens,
    }


def mask_cost(engine: LLMEngine, args) -> dict:
    """µs per masked row at batch 1: the engine's (its bitmasks filled, unpacked and applied to
    the logits) and llguidance's bitmask alone, on the same matcher."""
    rows: list[float] = []
    library: list[float] = []
    real = sampler_module._mask_grammar

    def timed(logits, raw, jobs, *more):
        start = time.perf_counter()
        out = real(logits, raw, jobs, *more)
        rows.append((time.perf_counter() - start) / sum(job.num_rows for job in jobs))
        for job in jobs:
            start = time.perf_counter()
            job.grammar.compute_bitmask()
            library.append(time.perf_counter() - start)
        return out

    sampler_module._mask_grammar = timed
    try:
        prompt = render_chat(engine.tokenizer, ask("list of records", RECORDS))[1]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            structured_outputs={"json": RECORDS},
        )
        run_all_at_once(engine, [prompt], [params])
    finally:
        sampler_module._mask_grammar = real
    return {
        "engine_us_per_row": statistics.median(rows) * 1e6,
        "llguidance_bitmask_us": statistics.median(library) * 1e6,
        "rows": len(rows),
    }


def build(args, **options) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, seed=args.seed, **options
        )
    )


def run(args) -> dict:
    plain = build(args, max_num_seqs=max(args.batch_size, 40))
    eagle_spec = {"method": "eagle", "num_speculative_tokens": 4}
    if args.eagle_head:
        eagle_spec["draft_model"] = args.eagle_head
    eagle = build(args, speculative_config=eagle_spec)
    payload = {
        "benchmark": "structured",
        "machine": workload.machine_info(plain.runner.device, "benchmarks.structured"),
        "config": {
            k: getattr(args, k)
            for k in (
                "batch_size",
                "max_tokens",
                "rounds",
                "eagle_prompts",
                "eagle_passes",
                "eagle_max_tokens",
                "validity_max_tokens",
                "seed",
            )
        },
        "validity": validity(plain, args.validity_max_tokens, args.seed),
        "throughput": throughput(plain, args),
        "speculation": speculation(plain, eagle, args),
        "mask_cost": mask_cost(plain, args),
    }
    return payload


def build_parser():
    parser = workload.parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eagle-head", default=None, help="default: the shipped head")
    parser.add_argument("--eagle-prompts", type=int, default=6)
    parser.add_argument("--eagle-passes", type=int, default=3)
    parser.add_argument("--eagle-max-tokens", type=int, default=96)
    parser.add_argument("--validity-max-tokens", type=int, default=192)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    workload.save(run(args), args.output_dir, "structured")


if __name__ == "__main__":
    main()

"""EAGLE configurations against no speculation at batch 1: the tuning sweep behind the eagle
defaults (``engine/config.py``: the chain stop, the draft leaves).

Every configuration (--configs: a JSON list of SpeculativeConfig fields over method "eagle" and
--k) and no speculation take turns on each held-out chat prompt in --prompts (1-based; the
default 9:40 leaves out the first 8, which the spec_decode benchmark measures), after a warm-up
pass, --passes times: a drift of this CPU's speed hits every configuration alike. Prints the
speedup, tokens and drafts per verification; with --output-dir, writes eagle_sweep.json there.

    python -m benchmarks.eagle_sweep --configs '[{}, {"draft_leaves": 0}, {"draft_leaves": 3}]'
"""

import json
import os

from benchmarks import workload
from benchmarks.spec_decode import (
    eagle_kv_blocks,
    engine_call,
    heldout_chat_prompts,
    same_tokens,
    take_turns,
)
from benchmarks.workload import BenchRequest


def run(args) -> dict:
    spec = workload.resolve_model(args.model, "auto", None)
    first, last = workload.parse_range(args.prompts, "prompts")
    prompts = heldout_chat_prompts(spec.tokenizer)
    if last > len(prompts):
        raise ValueError(f"prompts must lie in 1:{len(prompts)}, got {args.prompts!r}")
    requests = [BenchRequest(p, args.max_tokens) for p in prompts[first - 1 : last]]
    configs = json.loads(args.configs)
    blocks = eagle_kv_blocks(requests, args.k, configs)
    eagle = {"method": "eagle", "num_speculative_tokens": args.k, "draft_model": args.eagle_head}
    systems = {}
    for config in [None, *configs]:
        name = "none" if config is None else json.dumps(config)
        speculative = None if config is None else eagle | config
        engine = workload.make_engine(
            spec, args, 1, blocks, enable_prefix_caching=False, speculative_config=speculative
        )
        systems[name] = engine_call(engine, args.temperature)
    runs = take_turns(systems, requests, args.passes)
    if args.temperature == 0:  # greedy speculation is lossless: the same tokens as none
        same_tokens(runs, "none", list(runs))
    base = runs["none"]["tokens_per_s"]
    rows = {}
    for name, r in runs.items():
        r.pop("outputs", None)
        rows[name] = {"speedup": r["tokens_per_s"] / base, **r}
        print(f"{name:40s} {rows[name]['speedup']:.3f}x  tokens/verification "
              f"{r.get('mean_accepted_length', 0):.2f}  drafts/verification "
              f"{r.get('drafts_per_verification', 0):.2f}")  # fmt: skip
    payload = {"config": vars(args), "runs": rows}
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "eagle_sweep.json"), "w") as f:
            json.dump(payload, f, indent=2)
    return payload


def build_parser():
    parser = workload.parser(__doc__, output_dir=None)
    add = parser.add_argument
    add("--configs", default='[{}, {"draft_leaves": 0}]', help="JSON list of eagle configs")
    add("--prompts", default="9:40", help="held-out chat prompts FIRST:LAST, 1-based")
    add("--k", type=int, default=4, help="num_speculative_tokens")
    add("--temperature", type=float, default=0.0)
    add("--max-tokens", type=int, default=64)
    add("--passes", type=int, default=2)
    add("--eagle-head", default=None, help="a head directory (default: the shipped head)")
    return parser


if __name__ == "__main__":
    run(build_parser().parse_args())

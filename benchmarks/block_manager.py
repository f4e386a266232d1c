"""Per-step KV bookkeeping cost of speculative decoding for a full batch of running sequences.

Each step, for every sequence: reserve 1 + k slots (append), build their slot ids, roll back the
0..k rejected ones (truncate) and commit the accepted tokens: what a step asks of memory/.
"""

import argparse
import platform
import random
import time

from benchmarks import output
from benchmarks.timing import percentile
from memory import BlockManager

PHASES = ("append", "slot_ids", "truncate", "commit")


def measure(args: argparse.Namespace, prefix_caching: bool) -> dict[str, float]:
    """Median / p90 / p99 µs per step (all sequences), plus the median µs of each phase."""
    rng = random.Random(args.seed)
    prompt_lens = [rng.randint(128, 1024) for _ in range(args.num_seqs)]
    span, total_steps = 1 + args.lookahead, args.warmup + args.steps
    blocks_per_seq = -(-(max(prompt_lens) + total_steps * span) // args.block_size) + 1
    manager = BlockManager(
        args.num_seqs * blocks_per_seq, args.block_size, enable_prefix_caching=prefix_caching
    )
    tokens = []
    for seq_id, length in enumerate(prompt_lens):
        prompt = [rng.randrange(50_000) for _ in range(length)]
        manager.allocate(seq_id, prompt)
        manager.commit(seq_id, prompt)
        tokens.append(prompt)
    seq_ids = range(args.num_seqs)
    times_us: dict[str, list[float]] = {phase: [] for phase in ("step", *PHASES)}
    for step in range(total_steps):
        # Drawn outside the timed region: the sampler's job, not memory's.
        rejected = [rng.randint(0, args.lookahead) for _ in seq_ids]
        new_tokens = [[rng.randrange(50_000) for _ in range(span)] for _ in seq_ids]
        lengths = [len(t) for t in tokens]
        t0 = time.perf_counter_ns()
        for seq_id in seq_ids:
            manager.append(seq_id, span)
        t1 = time.perf_counter_ns()
        for seq_id in seq_ids:
            manager.slot_ids(seq_id, lengths[seq_id], lengths[seq_id] + span)
        t2 = time.perf_counter_ns()
        for seq_id in seq_ids:
            manager.truncate(seq_id, lengths[seq_id] + span - rejected[seq_id])
        t3 = time.perf_counter_ns()
        for seq_id in seq_ids:
            tokens[seq_id] += new_tokens[seq_id][: span - rejected[seq_id]]
            manager.commit(seq_id, tokens[seq_id])
        t4 = time.perf_counter_ns()
        if step >= args.warmup:
            spans = ((t0, t4), (t0, t1), (t1, t2), (t2, t3), (t3, t4))
            for phase, (a, b) in zip(times_us, spans, strict=True):
                times_us[phase].append((b - a) / 1e3)
    for seq_id in seq_ids:
        manager.free(seq_id)
    assert manager.num_free_blocks() == manager.num_blocks
    step_us = times_us["step"]
    result = {
        name: percentile(step_us, q)
        for name, q in (("median_us", 50), ("p90_us", 90), ("p99_us", 99))
    }
    return result | {f"{phase}_us": percentile(times_us[phase], 50) for phase in PHASES}


def build_parser() -> argparse.ArgumentParser:
    parser = output.parser(__doc__, model=False)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = [{"prefix_caching": on, **measure(args, on)} for on in (True, False)]
    payload = {
        "benchmark": "block_manager",
        "config": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "python": platform.python_version(),
        "results": rows,
    }
    output.finish(payload, args.output_dir, "block_manager")


if __name__ == "__main__":
    main()

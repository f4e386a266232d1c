"""Per-step KV bookkeeping cost of speculative decoding for a full batch of running sequences.

Each step, for every sequence: reserve 1 + k slots (append), build their slot ids, roll back the
0..k rejected ones (truncate) and commit the accepted tokens - what the scheduler, model runner and
engine ask of memory/ per step. Prints a table and writes JSON to --output-dir.

    python -m benchmarks.block_manager [--num-seqs 256] [--steps 300] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from memory import BlockManager

PHASES = ("append", "slot_ids", "truncate", "commit")


def run(
    num_seqs: int,
    steps: int,
    warmup: int,
    lookahead: int,
    block_size: int,
    prefix_caching: bool,
    seed: int,
) -> dict[str, float]:
    """Median / p90 / p99 µs per step (all sequences), plus the median µs of each phase."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(128, 1024) for _ in range(num_seqs)]
    total_steps = warmup + steps
    max_len = max(prompt_lens) + total_steps * (1 + lookahead)
    manager = BlockManager(
        num_seqs * (-(-max_len // block_size) + 1), block_size, enable_prefix_caching=prefix_caching
    )
    tokens = []
    for seq_id, length in enumerate(prompt_lens):
        prompt = [rng.randrange(50_000) for _ in range(length)]
        manager.allocate(seq_id, prompt)
        manager.commit(seq_id, prompt)
        tokens.append(prompt)
    span = 1 + lookahead
    seq_ids = range(num_seqs)
    step_us: list[float] = []
    phase_us: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for step in range(total_steps):
        # Drawn outside the timed region: the sampler's job, not memory's.
        rejected = [rng.randint(0, lookahead) for _ in seq_ids]
        new_tokens = [[rng.randrange(50_000) for _ in range(span)] for _ in seq_ids]
        lengths = [len(t) for t in tokens]
        t0 = time.perf_counter_ns()
        for seq_id in seq_ids:
            manager.append(seq_id, span)
        t1 = time.perf_counter_ns()
        for seq_id in seq_ids:
            start = lengths[seq_id]
            manager.slot_ids(seq_id, start, start + span)
        t2 = time.perf_counter_ns()
        for seq_id in seq_ids:
            manager.truncate(seq_id, lengths[seq_id] + span - rejected[seq_id])
        t3 = time.perf_counter_ns()
        for seq_id in seq_ids:
            seq_tokens = tokens[seq_id]
            seq_tokens += new_tokens[seq_id][: span - rejected[seq_id]]
            manager.commit(seq_id, seq_tokens)
        t4 = time.perf_counter_ns()
        if step >= warmup:
            step_us.append((t4 - t0) / 1e3)
            for phase, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4)), strict=True):
                phase_us[phase].append((b - a) / 1e3)
    for seq_id in seq_ids:
        manager.free(seq_id)
    assert manager.num_free_blocks() == manager.num_blocks
    quantiles = statistics.quantiles(step_us, n=100)
    result = {
        "median_us": statistics.median(step_us),
        "p90_us": quantiles[89],
        "p99_us": quantiles[98],
    }
    result.update({f"{phase}_us": statistics.median(phase_us[phase]) for phase in PHASES})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    rows = []
    for prefix_caching in (True, False):
        stats = run(
            args.num_seqs,
            args.steps,
            args.warmup,
            args.lookahead,
            args.block_size,
            prefix_caching,
            args.seed,
        )
        rows.append({"prefix_caching": prefix_caching, **stats})

    header = f"{'prefix cache':>12} {'median':>8} {'p90':>8} {'p99':>8} " + " ".join(
        f"{phase:>9}" for phase in PHASES
    )
    print(
        f"block manager, {args.num_seqs} seqs, 1+{args.lookahead} slots/step, "
        f"block {args.block_size}: µs per step"
    )
    print(header)
    for row in rows:
        print(
            f"{'on' if row['prefix_caching'] else 'off':>12} {row['median_us']:8.1f} "
            f"{row['p90_us']:8.1f} {row['p99_us']:8.1f} "
            + " ".join(f"{row[f'{phase}_us']:9.1f}" for phase in PHASES)
        )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "block_manager.json"
    config = {k: v for k, v in vars(args).items() if k != "output_dir"}
    payload = {"config": config, "python": platform.python_version(), "results": rows}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Per-step KV bookkeeping cost of speculative decoding for a full batch of running sequences.

Each step, for every sequence: reserve 1 + k slots (append), build their slot ids, roll back the
0..k rejected ones (truncate) and commit the accepted tokens: what a step asks of memory/.
"""

import platform
import random
import time

from benchmarks import workload
from benchmarks.timing import percentile, quantiles
from pagedspec.memory import BlockManager

WARMUP, LOOKAHEAD, BLOCK_SIZE, SEED = 20, 4, 16, 0
PHASES = ("append", "slot_ids", "truncate", "commit")


def measure(num_seqs: int, steps: int, prefix_caching: bool) -> dict[str, float]:
    """Median / p90 / p99 µs per step (all sequences), plus the median µs of each phase."""
    rng, span, ids = random.Random(SEED), 1 + LOOKAHEAD, range(num_seqs)
    lengths = [rng.randint(128, 1024) for _ in ids]
    tokens = [[rng.randrange(50_000) for _ in range(n)] for n in lengths]
    per_seq = -(-(max(lengths) + (WARMUP + steps) * span) // BLOCK_SIZE) + 1
    manager = BlockManager(num_seqs * per_seq, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    for seq_id, prompt in enumerate(tokens):
        manager.allocate(seq_id, prompt)
        manager.commit(seq_id, prompt)
    times_us: dict[str, list[float]] = {p: [] for p in ("step", *PHASES)}
    for step in range(WARMUP + steps):
        # Drawn outside the timed region: the sampler's job, not memory's.
        rejected = [rng.randint(0, LOOKAHEAD) for _ in ids]
        new = [[rng.randrange(50_000) for _ in range(span)] for _ in ids]
        n = [len(t) for t in tokens]
        ticks = [time.perf_counter_ns()]
        for i in ids:
            manager.append(i, span)
        ticks.append(time.perf_counter_ns())
        for i in ids:
            manager.slot_ids(i, n[i], n[i] + span)
        ticks.append(time.perf_counter_ns())
        for i in ids:
            manager.truncate(i, n[i] + span - rejected[i])
        ticks.append(time.perf_counter_ns())
        for i in ids:
            tokens[i] += new[i][: span - rejected[i]]
            manager.commit(i, tokens[i])
        ticks.append(time.perf_counter_ns())
        if step >= WARMUP:
            times_us["step"].append((ticks[-1] - ticks[0]) / 1e3)
            for phase, a, b in zip(PHASES, ticks, ticks[1:], strict=False):
                times_us[phase].append((b - a) / 1e3)
    for seq_id in range(num_seqs):
        manager.free(seq_id)
    assert manager.num_free_blocks() == manager.num_blocks
    q = quantiles(times_us.pop("step"))
    result = {"median_us": q["p50"], "p90_us": q["p90"], "p99_us": q["p99"]}
    return result | {f"{phase}_us": percentile(times_us[phase], 50) for phase in PHASES}


def build_parser():
    parser = workload.parser(__doc__, model=False)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = [{"prefix_caching": on} | measure(args.num_seqs, args.steps, on) for on in (True, False)]
    config = dict(num_seqs=args.num_seqs, steps=args.steps, warmup=WARMUP, lookahead=LOOKAHEAD,
                  block_size=BLOCK_SIZE, seed=SEED)  # fmt: skip
    python = platform.python_version()
    payload = {"benchmark": "block_manager", "config": config, "python": python, "results": rows}
    workload.save(payload, args.output_dir, "block_manager")


if __name__ == "__main__":
    main()

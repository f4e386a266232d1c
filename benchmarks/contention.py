"""Throughput on a CPU shared with a busy process: quiet, and with one ``python -c "while True:
pass"`` beside the engine (issue 51).

The default model (or --model), greedy, EOS ignored: per batch size B, B random prompts of
--input-len tokens making --output-len tokens each, all submitted at once. Systems:
``pagedspec`` as it runs by default (its thread count follows the load,
``pagedspec.engine.worker.cpu_threads``); ``pagedspec-fixed``, its threads fixed at ``cpu_limit()``
(every CPU, whatever else runs: what it did before); and ``llamacpp`` where ``llama_cpp`` imports
(``make bench-peers``), llama.cpp's continuous batching on the fp32 GGUF (what pagedspec runs the
shipped Q4_1 file as), with ``cpu_limit()`` threads.
Per round, every (B, system) runs quiet and then contended, each time after a warm-up run under
the same conditions (the governor reads the load every 0.5 s); the figures are the median over
--rounds rounds of generated tokens/s, and of each round's contended / quiet ratio.
"""

import shlex
import statistics
import subprocess
import sys
import time

import torch

from benchmarks import llamacpp, workload
from benchmarks.throughput import run_llamacpp
from benchmarks.timing import run_engine, summarize
from pagedspec.engine.worker.cpu_threads import cpu_limit

HOG = [sys.executable, "-c", "while True: pass"]
SETTLE_S = 0.5  # for the busy process to start spinning before a contended run


def tokens_per_s(system, requests: list, batch: int) -> float:
    """Generated tokens/s of one run over ``requests`` (after a warm-up run of a few tokens)."""
    warm = [r._replace(output_len=4) for r in requests]
    if isinstance(system, str):  # a llama.cpp GGUF
        return summarize(run_llamacpp(system, warm, requests, batch), 0)["output_tokens_per_s"]
    run_engine(system, warm)
    return summarize(run_engine(system, requests).timings, 0)["output_tokens_per_s"]


def measure(system, requests: list, batch: int) -> tuple[float, float]:
    """(quiet, contended) tokens/s."""
    torch.set_num_threads(cpu_limit())  # torch's count is the process's: the last engine's
    quiet = tokens_per_s(system, requests, batch)
    hog = subprocess.Popen(HOG)
    try:
        time.sleep(SETTLE_S)
        return quiet, tokens_per_s(system, requests, batch)
    finally:
        hog.kill()
        hog.wait()


def run(args) -> dict:
    spec = workload.resolve_model(args.model, "auto", None)
    batches = workload.parse_int_list(args.batch_sizes, "--batch-sizes")
    requests = workload.make_workload(max(batches), (args.input_len,) * 2,
                                      (args.output_len,) * 2, spec, args.seed)  # fmt: skip
    blocks = workload.kv_blocks_needed(requests, max(batches), 0)
    limit, systems = cpu_limit(), {}
    systems["pagedspec"] = workload.make_engine(spec, args, max(batches), blocks)
    fixed = workload.make_engine(spec, args, max(batches), blocks, num_threads=limit)
    systems["pagedspec-fixed"] = fixed
    skipped = llamacpp.unavailable_reason()
    if skipped is None:
        systems["llamacpp"] = llamacpp.gguf_file("F32", llamacpp.source_gguf(spec))
    runs = {(b, name): [] for b in batches for name in systems}
    for _ in range(args.rounds):
        for b in batches:
            for name, system in systems.items():
                runs[b, name].append(measure(system, requests[:b], b))
                print(f"B={b} {name}: quiet / contended tok/s {runs[b, name][-1]}", flush=True)
    results = [
        {"batch_size": b, "system": name,
         "quiet_tokens_per_s": statistics.median(q for q, _ in r),
         "contended_tokens_per_s": statistics.median(c for _, c in r),
         "contended_vs_quiet": statistics.median(c / q for q, c in r)}
        for (b, name), r in runs.items()
    ]  # fmt: skip
    busy = shlex.join(["python", *HOG[1:]])
    config = dict(input_len=args.input_len, output_len=args.output_len, rounds=args.rounds,
                  seed=args.seed, cpu_limit=limit, busy_process=busy)  # fmt: skip
    return {"benchmark": "contention", "machine": workload.machine_info(fixed.runner.device,
            "benchmarks.contention"), "config": config, "llamacpp_skipped": skipped,
            "results": results}  # fmt: skip


def build_parser():
    parser = workload.parser(__doc__)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    workload.save(run(args), args.output_dir, "contention")


if __name__ == "__main__":
    main()

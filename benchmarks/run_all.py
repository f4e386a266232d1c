"""``make bench``: every benchmark at CPU size (about 50 minutes on 2 cores: EAGLE ~3-4 of them,
the serving benchmark ~12 (its peer is slow), the soak 10, sampled throughput 4, the host
overhead ~2 with its baseline commit's worktree, the shared CPU ~2), each in its own process
writing to benchmarks/results, then RESULTS.md regenerated; run_all.json records each command,
its exit status and wall time. The accuracy table takes ~2 minutes more (~10 with llama.cpp); where
llama_cpp imports (``make bench-peers``), llama.cpp also runs as a throughput peer at each
precision the engine has (~4 minutes each).
"""

import datetime
import shlex
import subprocess
import sys
import time

from benchmarks import llamacpp, workload
from benchmarks.precisions import PRECISIONS, engine_options

RESULTS = "benchmarks/results"
# name: "module flags..." (benchmarks.<module>).
FULL = {
    "throughput": "throughput --batch-sizes 1,4,16,32,64 --input-len 32:128 --output-len 32:64",
    "throughput-sampled": "throughput --batch-sizes 1,32 --input-len 64 --output-len 64 "
    "--temperature 0.8 --tag throughput-sampled",
    "latency": "throughput --latency --batch-sizes 1,4 --output-len 32 --warmup-iters 1 --iters 3",
    "spec_decode": "spec_decode --num-prompts 4 --max-tokens 48 --k-values 2,4,6,8 "
    "--batch-sizes 1,16,32,64 --sweep-max-tokens 24 --methods ngram,eagle --eagle-prompts 8 "
    "--eagle-max-tokens 64 --eagle-batch-sizes 2,4,8,16,64",
    "host_overhead": "host_overhead --batch-sizes 1,64,256 --methods off,ngram,eagle --steps 20 "
    "--warmup-steps 3 --rounds 9",
    "serving": "serving --rates 0.5,1,2,inf --num-prompts 32 --input-len 32:128 --output-len 32:64 "
    "--chat-max-tokens 64",
    "soak": "soak --num-requests 1000 --duration 600",
    "memory": "memory",
    "contention": "contention --rounds 5",
    "structured": "structured",
    "block_manager": "block_manager",
    "linear": "linear",
    "kernels": "kernels --spans 1,5,64 --iters 10",
    "accuracy": "accuracy",
}
# Issue 17's comparison with llama.cpp: 64-token prompts, 64 greedy tokens, batch 1 and 32;
# each system's fastest of 5 runs (with 2, batch 1 moved by up to 15% from run to run).
PEER_RUN = "throughput --batch-sizes 1,32 --input-len 64 --output-len 64 --repeats 5 "
PEER_RUN += "--peers llamacpp --precision {p} --tag throughput-llamacpp-{p}"


def peer_commands() -> dict[str, list[str]]:
    """The llama.cpp runs (module, flags...), one per precision the engine has; none, with the
    reason printed, where llama_cpp does not import."""
    reason = llamacpp.unavailable_reason()
    if reason is not None:
        print(f"=== skipping the llama.cpp runs: {reason}", flush=True)
        return {}
    runs = {}
    for name, precision in PRECISIONS.items():
        try:
            engine_options(precision)
        except ValueError as exc:
            print(f"=== skipping llama.cpp at {name}: {exc}", flush=True)
            continue
        runs[f"throughput-llamacpp-{name}"] = shlex.split(PEER_RUN.format(p=name))
    return runs


def commands() -> dict[str, list[str]]:
    """The command line of each benchmark."""
    lines = {name: shlex.split(line) for name, line in FULL.items()} | peer_commands()
    return {
        name: [sys.executable, "-m", f"benchmarks.{module}", *flags, "--output-dir", RESULTS]
        for name, (module, *flags) in lines.items()
    }


if __name__ == "__main__":
    # --peers-only (make bench-peers): the llama.cpp runs and the accuracy table alone.
    peers_only = sys.argv[1:] == ["--peers-only"]
    if sys.argv[1:] and not peers_only:
        sys.exit(f"usage: python -m benchmarks.run_all [--peers-only], got {sys.argv[1:]}")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs, start, chosen = [], time.perf_counter(), commands()
    if peers_only:
        chosen = {n: c for n, c in chosen.items() if n == "accuracy" or "llamacpp" in n}
    for name, cmd in chosen.items():
        shown = shlex.join(["python", *cmd[1:]])
        print(f"=== {name}: {shown}", flush=True)
        t0, rc = time.perf_counter(), subprocess.run(cmd).returncode
        seconds = time.perf_counter() - t0
        print(f"=== {name}: exit {rc} after {seconds:.0f} s", flush=True)
        runs.append({"name": name, "command": shown, "returncode": rc, "seconds": seconds})
    summary = {"benchmark": "run_all", "quick": False, "started": started, "runs": runs}
    if not peers_only:  # run_all.json records the full sweep
        workload.save(summary | {"total_s": time.perf_counter() - start}, RESULTS, "run_all")
    rc = subprocess.run([sys.executable, "-m", "benchmarks.report"]).returncode
    failed = [r["name"] for r in runs if r["returncode"] != 0] + (["report"] if rc else [])
    print(f"=== run_all: {time.perf_counter() - start:.0f} s; failed: {failed}")
    sys.exit(1 if failed else 0)

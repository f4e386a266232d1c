"""``make bench``: the CPU-sized sweep of every benchmark, then RESULTS.md regenerated from it.

Sized for a 2-core CPU (about 20 minutes): throughput over batch sizes 1..64 with both HF peers,
latency at batch 1 and 4, speculative decoding (ngram per k at batch 1 and its batch sweep; EAGLE
on held-out chat, ~3-4 minutes), the block manager's bookkeeping, the linear layers and the CPU
attention kernel. Each benchmark runs in its own process; run_all.json records each command, its
exit status and wall time. --quick: a tiny run of everything, written with its own RESULTS.md to
benchmarks/results-quick.

    python -m benchmarks.run_all [--quick] [--model DIR] [--output-dir DIR]
"""

import argparse
import datetime
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import output

# name: "module flags..." (benchmarks.<module>).
FULL = {
    "throughput": "throughput --batch-sizes 1,4,16,32,64 --input-len 32:128 --output-len 32:64",
    "latency": "throughput --latency --batch-sizes 1,4 --output-len 32 --warmup-iters 1 --iters 3",
    "spec_decode": "spec_decode --num-prompts 4 --max-tokens 48 --k-values 2,4,6,8 "
    "--batch-sizes 1,16,32,64 --sweep-max-tokens 24 --methods ngram,eagle --eagle-prompts 8 "
    "--eagle-max-tokens 64 --eagle-batch-sizes 16,64",
    "block_manager": "block_manager",
    "linear": "linear",
    "kernels": "kernels --spans 1,5,64 --iters 10",
}
QUICK = {
    "throughput": "throughput --batch-sizes 1,4 --input-len 16:64 --output-len 8:16 --repeats 1",
    "latency": "throughput --latency --batch-sizes 1,4 --output-len 16 --warmup-iters 1 --iters 2",
    "spec_decode": "spec_decode --num-prompts 2 --max-tokens 24 --k-values 2,4 --batch-sizes 1,4 "
    "--sweep-max-tokens 16 --methods ngram,eagle --eagle-prompts 2 --eagle-max-tokens 16 "
    "--eagle-batch-sizes 16",
    "block_manager": "block_manager --num-seqs 32 --steps 50",
    "linear": "linear --rows 1,8,64 --repeats 2",
    "kernels": "kernels --spans 1 --iters 2",
}
TAKES_MODEL = ("throughput", "spec_decode", "linear")  # modules with a --model flag


def commands(quick: bool, model: str | None, output_dir: Path) -> dict[str, list[str]]:
    """The command line of each benchmark."""
    out = {}
    for name, line in (QUICK if quick else FULL).items():
        module, *flags = shlex.split(line)
        flags += ["--output-dir", str(output_dir)]
        flags += ["--model", model] if model is not None and module in TAKES_MODEL else []
        out[name] = [sys.executable, "-m", f"benchmarks.{module}", *flags]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2)")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    output_dir = args.output_dir or Path("benchmarks/results" + "-quick" * args.quick)
    results_md = output_dir / "RESULTS.md" if args.quick else Path("benchmarks/RESULTS.md")
    output_dir.mkdir(parents=True, exist_ok=True)

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs, start = [], time.perf_counter()
    for name, cmd in commands(args.quick, args.model, output_dir).items():
        shown = shlex.join(["python", *cmd[1:]])
        print(f"=== {name}: {shown}", flush=True)
        t0, rc = time.perf_counter(), subprocess.run(cmd).returncode
        seconds = time.perf_counter() - t0
        print(f"=== {name}: exit {rc} after {seconds:.0f} s", flush=True)
        runs.append({"name": name, "command": shown, "returncode": rc, "seconds": seconds})
    summary = {"benchmark": "run_all", "quick": args.quick, "started": started, "runs": runs}
    summary["total_s"] = time.perf_counter() - start
    output.save(summary, output_dir, "run_all")
    report = [sys.executable, "-m", "benchmarks.report", "--results-dir", str(output_dir)]
    rc = subprocess.run([*report, "--output", str(results_md)]).returncode
    failed = [r["name"] for r in runs if r["returncode"] != 0] + (["report"] if rc else [])
    print(f"=== run_all: {summary['total_s']:.0f} s" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Peak resident memory of ``make demo``'s command, at each weight precision.

Each run is a child process (``python -m pagedspec generate`` on examples/prompts.jsonl, chat
template, 128 greedy tokens), its peak RSS read from the kernel's accounting of that child
(``os.wait4``: the same number as ``/usr/bin/time -v``'s "Maximum resident set size"). Issue
17's target is the float32 run: at most 0.9 GB.

That accounting takes the largest of the child and every process it waited for, so a run that
builds the C++ extension (g++ took GBs) would report the compiler's peak. Each command runs once
unmeasured first: the measured runs find the extension built and the default model converted,
as every ``make demo`` after the first does.
"""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import workload
from benchmarks.precisions import engine_options, get_precision

ROOT = Path(__file__).resolve().parent.parent  # make demo runs here
DEMO = ["-m", "pagedspec", "generate", "--input", "examples/prompts.jsonl", "--chat"]
DEMO += ["--temperature", "0"]


def demo_command(precision: str, max_tokens: int, model: str | None) -> list[str]:
    """make demo's command line (without the interpreter) at ``precision``."""
    options = engine_options(get_precision(precision))
    flags = ["--max-tokens", str(max_tokens)]
    flags += ["--dtype", options["dtype"]] if options["dtype"] != "float32" else []
    flags += ["--quantization", options["quantization"]] if "quantization" in options else []
    return [*DEMO, *flags, *(["--model", model] if model else [])]


def peak_rss(command: list[str]) -> tuple[int, float]:
    """(peak resident bytes, wall seconds) of ``python command...`` run to completion. Its
    output (a progress bar a token) is kept out of the benchmark's; a failed run's stderr is in
    the error."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(
            [sys.executable, *command], stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT
        )
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-2000:]
            raise RuntimeError(
                f"{shlex.join(command)} exited with status {child.returncode}:\n{tail}"
            )
    return usage.ru_maxrss * 1024, time.perf_counter() - start  # Linux counts KiB


def run(args: argparse.Namespace) -> dict:
    rows = []
    for precision in args.precisions.split(","):
        command = demo_command(precision, args.max_tokens, args.model)
        peak_rss(command)  # unmeasured: builds what a first run builds (module docstring)
        runs = [peak_rss(command) for _ in range(args.repeats)]
        rows.append({
            "precision": precision, "command": shlex.join(["python", *command]),
            "peak_rss_bytes": [rss for rss, _ in runs], "wall_s": [s for _, s in runs],
        })  # fmt: skip
        print(f"{precision}: peak {max(r for r, _ in runs) / 2**20:.0f} MiB", flush=True)
    config = {"max_tokens": args.max_tokens, "repeats": args.repeats, "model": args.model}
    return {
        "benchmark": "memory", "config": config, "results": rows,
        "machine": workload.machine_info(torch.device("cpu"), "benchmarks.memory"),
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="fp32,int8,q4_1", help="rows of benchmarks.precisions")
    p.add_argument("--max-tokens", type=int, default=128, help="make demo's 128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="a model directory or .gguf (default: the default model)")
    p.add_argument("--output-dir", default="benchmarks/results")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        for name in args.precisions.split(","):
            get_precision(name)
    except ValueError as exc:
        raise SystemExit(f"error: --precisions: {exc}") from exc
    workload.save(run(args), args.output_dir, "memory")


if __name__ == "__main__":
    main()

"""What the benchmarks share around a run: their common flags, and what they write (their JSON,
with the machine and the command that measured it, their plot and their RESULTS.md section)."""

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


def parser(doc: str, model: bool = True, output_dir: str = "benchmarks/results"):
    """An argument parser with --output-dir and, with ``model``, --model, --dtype, --device and
    --seed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--output-dir", default=output_dir)
    for flag, default in (("--model", None), ("--dtype", "auto"), ("--device", "auto")) * model:
        parser.add_argument(flag, default=default)
    if model:
        parser.add_argument("--seed", type=int, default=0)
    return parser


def machine_info(device: torch.device, module: str) -> dict:
    """What the numbers were measured on, and the command that measured them."""
    import transformers

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "git_commit": commit or None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", module, *sys.argv[1:]]),
    }  # fmt: skip


def save(payload: dict, out_dir: str | Path, tag: str, plot=None) -> None:
    """Writes ``payload`` to ``out_dir/tag.json``, and with ``plot(payload, path)`` given, its
    plot to ``out_dir/tag.png`` (named in the payload's "plot")."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        payload["plot"] = f"{tag}.png"
        plot(payload, out_dir / payload["plot"])
    (out_dir / f"{tag}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out_dir / tag}.json")


def finish(payload: dict, out_dir: str | Path, tag: str, plot=None) -> None:
    """``save``, then print the payload's targets and RESULTS.md section."""
    from benchmarks import report

    save(payload, out_dir, tag, plot)
    print(report.section(payload, f"{tag}.json"))


def plot(path: Path, lines: list[tuple], xlabel: str, ylabel: str, title: str, log: bool) -> None:
    """A line plot: ``lines`` holds (xs, ys, label, matplotlib format) per line; the xs are the
    ticks; ``log``: log-log axes, else a line at y = 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for xs, ys, label, fmt in lines:
        ax.plot(xs, ys, fmt, label=label)
    ticks = sorted({x for xs, *_ in lines for x in xs})
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    else:
        ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")

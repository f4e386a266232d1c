"""What the benchmarks share: common flags, the model, requests, the engine serving them, and what
they write (JSON with the machine and command, a plot, their RESULTS.md part)."""

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shlex
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from pagedspec import EngineConfig, LLMEngine

BLOCK_SIZE = 16  # KV block size of every engine the benchmarks build
DATA = Path(__file__).parent / "data"
WORKLOADS = ("grounded", "open")  # the kinds of chat prompt in data/spec_prompts.jsonl


BenchRequest = namedtuple("BenchRequest", "prompt_ids output_len")
# Where pagedspec (engine_model, load_format) and HF (hf_path; None: random weights) get the model.
ModelSpec = namedtuple("ModelSpec", "engine_model load_format hf_path config tokenizer name")


def parse_range(text: str, name: str) -> tuple[int, int]:
    """ "32:256" -> (32, 256); "128" -> (128, 128). Both ends >= 1."""
    parts = text.split(":")
    lo, hi = (parts[0], parts[-1]) if len(parts) <= 2 else ("0", "-1")
    if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
        raise ValueError(f"{name} must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return int(lo), int(hi)


def parse_int_list(text: str, name: str) -> list[int]:
    """ "16,1,4" -> [1, 4, 16] (sorted, distinct, each >= 1)."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or not all(x.isdigit() and int(x) >= 1 for x in values):
        raise ValueError(f"{name} must be a comma-separated list of integers >= 1, got {text!r}")
    return sorted({int(x) for x in values})


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """--device and --dtype as EngineConfig reads them: "auto" is CUDA where there is one, and
    bfloat16 there, float32 on the CPU."""
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(auto_device if device == "auto" else device)
    auto = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, auto if dtype == "auto" else getattr(torch, dtype)


def resolve_model(model: str | None, load_format: str, model_config: str | None) -> ModelSpec:
    """--model / --load-format / --model-config -> a ModelSpec (config read without weights)."""
    if model_config is not None:  # a model_configs/ name or a config.json, random weights
        path = Path(__file__).parent / "model_configs" / f"{model_config}.json"
        path = path if path.is_file() else Path(model_config)
        if load_format != "dummy" or not path.is_file():
            raise ValueError(f"--model-config needs --load-format dummy and a config: {path}")
        config = AutoConfig.from_pretrained(str(path))
        return ModelSpec(str(path), "dummy", None, config, None, path.stem)
    if model is None:
        from pagedspec.engine.loader.default_model import (
            default_model_dir,  # the engine has no public path
        )

        path, name = default_model_dir(), "SmolLM2-135M-Instruct"
    else:
        path, name = os.path.abspath(os.path.expanduser(model)), Path(model).name
    folder, gguf = os.path.split(path) if path.endswith(".gguf") else (path, None)
    files = ("tokenizer.json", "tokenizer.model")
    has_tokenizer = gguf or any(os.path.exists(os.path.join(path, f)) for f in files)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf) if has_tokenizer else None
    config = AutoConfig.from_pretrained(folder, gguf_file=gguf)
    hf_path = None if load_format == "dummy" else path
    return ModelSpec(model, load_format, hf_path, config, tokenizer, name)


def make_workload(num, input_len, output_len, spec: ModelSpec, seed: int, prompts=None):
    """``num`` requests: ``prompts`` in turn, or seeded random token ids (no special ids) of
    lengths drawn from ``input_len``; output lengths drawn from ``output_len``."""
    banned = set(spec.tokenizer.all_special_ids) if spec.tokenizer is not None else set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(spec.config, key, None)
        banned |= set(value) if isinstance(value, list | tuple) else {value} - {None}
    rng, requests = random.Random(seed), []
    for i in range(num):
        out = rng.randint(*output_len)
        if prompts:
            requests.append(BenchRequest(prompts[i % len(prompts)], out))
            continue
        ids, length = [], rng.randint(*input_len)
        while len(ids) < length:
            token = rng.randrange(spec.config.vocab_size)
            ids += [] if token in banned else [token]
        requests.append(BenchRequest(ids, out))
    return requests


def chat_prompts(tokenizer, workload: str, limit: int | None = None) -> list[list[int]]:
    """The workload's chat prompts as token ids (chat template, generation prompt added)."""
    from pagedspec.engine.entrypoints.llm import render_chat

    if workload not in WORKLOADS or tokenizer is None:
        raise ValueError(f"workload must be one of {WORKLOADS}, for a model with a tokenizer")
    lines = (DATA / "spec_prompts.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, filter(None, lines)) if r["workload"] == workload]
    return [render_chat(tokenizer, r["messages"])[1] for r in records[:limit]]


def kv_blocks_needed(requests: list[BenchRequest], batch_size: int, k: int) -> int:
    """Enough KV blocks for the ``batch_size`` longest requests at once: no run is memory-bound."""
    lengths = sorted((len(r.prompt_ids) + r.output_len + k + 1 for r in requests), reverse=True)
    return sum(-(-n // BLOCK_SIZE) for n in lengths[:batch_size]) + batch_size


def make_engine(spec: ModelSpec, args, max_num_seqs: int, blocks: int, **options) -> LLMEngine:
    """An engine for ``spec`` at ``args``' dtype, device, seed, TP size; ``options``: more."""
    tp = getattr(args, "tensor_parallel_size", 1)  # a flag of throughput.py only
    fields = dict(model=spec.engine_model, load_format=spec.load_format, seed=args.seed)
    fields |= dict(dtype=args.dtype, device=args.device, block_size=BLOCK_SIZE)
    fields |= dict(attention_backend=args.attention_backend)
    fields |= dict(max_num_seqs=max_num_seqs, num_kv_blocks=blocks, tensor_parallel_size=tp)
    fields |= dict(enforce_eager=getattr(args, "enforce_eager", False))  # throughput.py's flags
    fields |= dict(async_scheduling=getattr(args, "async_scheduling", False))
    return LLMEngine(EngineConfig(**fields, **options))


def release_memory(device: torch.device) -> None:
    """Let the next system start from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parser(doc: str, model: bool = True, output_dir: str = "benchmarks/results"):
    """An argument parser with --output-dir and, with ``model``, --model, --dtype, --device,
    --attention-backend and --seed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--output-dir", default=output_dir)
    flags = ("--model", None), ("--dtype", "auto"), ("--device", "auto")
    for flag, default in (*flags, ("--attention-backend", "auto")) * model:
        parser.add_argument(flag, default=default)
    if model:
        parser.add_argument("--seed", type=int, default=0)
    return parser


def machine_info(device: torch.device, module: str) -> dict:
    """What the numbers were measured on, and the command that measured them."""
    import transformers

    try:  # "model name" and, as x86 Linux writes them, "cpu family" and "model"
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n")[0].splitlines()  # the first processor's
        info = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        cpu = info["model name"]
    except (OSError, KeyError):
        info, cpu = {}, platform.processor() or platform.machine()
    # one "model name" ("AMD EPYC") can be several generations: the family and model tell them
    # apart (AMD's family 25 model 1 is Zen 3, family 26 is Zen 5)
    x86 = "cpu family" in info and "model" in info
    cpu_model = f"family {info['cpu family']} model {info['model']}" if x86 else None
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu": cpu, "cpu_model": cpu_model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "git_commit": commit or None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", module, *sys.argv[1:]]),
    }  # fmt: skip


def save(payload: dict, out_dir: str | Path, tag: str, plot=None) -> None:
    """Writes ``payload`` to ``out_dir/tag.json`` and, with ``plot(payload, path)`` given, its
    plot to ``out_dir/tag.png`` (named in the payload's "plot"); prints its RESULTS.md part.
    The JSON is written first: a missing matplotlib (the GPU check carries none) loses the plot
    only."""
    from benchmarks import report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{tag}.json").write_text(json.dumps(payload, indent=2) + "\n")
    if plot is not None:
        try:
            plot(payload, out_dir / f"{tag}.png")
        except ImportError as exc:
            print(f"note: no plot ({exc})")
        else:
            payload["plot"] = f"{tag}.png"
            (out_dir / f"{tag}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out_dir / tag}.json\n" + report.section(payload, f"{tag}.json"))


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

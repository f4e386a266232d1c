"""What the end-to-end benchmarks share: the model, the requests and the engine that serves them."""

import gc
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from engine import EngineConfig, LLMEngine

BLOCK_SIZE = 16  # KV block size of every engine the benchmarks build
MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
PROMPTS_FILE = Path(__file__).parent / "data" / "spec_prompts.jsonl"
WORKLOADS = ("grounded", "open")  # the kinds of chat prompt in PROMPTS_FILE


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class ModelSpec:
    """Where pagedspec and the HF peers get the model from."""

    engine_model: str | None  # EngineConfig.model
    load_format: str
    hf_path: str | None  # weights for the peers; None: random init from ``config``
    config: object
    tokenizer: object | None
    name: str


def parse_range(text: str, name: str) -> tuple[int, int]:
    """ "32:256" -> (32, 256); "128" -> (128, 128). Both ends >= 1."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_int_list(text: str, name: str) -> list[int]:
    """ "16,1,4" -> [1, 4, 16] (sorted, distinct, each >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be a comma-separated list of integers >= 1, got {text!r}")
    return sorted(set(values))


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """--device and --dtype as EngineConfig reads them: "auto" is CUDA where there is one, and
    bfloat16 there, float32 on the CPU."""
    cuda = torch.cuda.is_available()
    dev = torch.device(("cuda" if cuda else "cpu") if device == "auto" else device)
    auto = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, auto if dtype == "auto" else getattr(torch, dtype)


def resolve_model(model: str | None, load_format: str, model_config: str | None) -> ModelSpec:
    """--model / --load-format / --model-config -> a ModelSpec (config read without weights)."""
    if model_config is not None:
        if load_format != "dummy":
            raise ValueError("--model-config needs --load-format dummy")
        path = MODEL_CONFIG_DIR / f"{model_config}.json"
        path = path if path.is_file() else Path(model_config)
        if not path.is_file():
            names = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
            raise ValueError(f"model_config must be one of {names} or a config.json, got {path}")
        config = AutoConfig.from_pretrained(str(path))
        return ModelSpec(str(path), "dummy", None, config, None, path.stem)
    if model is None:
        from engine.default_model import default_model_dir  # the engine has no public path

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


def make_workload(
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    spec: ModelSpec,
    seed: int,
    prompts: list[list[int]] | None = None,
) -> list[BenchRequest]:
    """``num`` requests: ``prompts`` in turn, or seeded random token ids (no special ids) of
    lengths drawn from ``input_len``; output lengths drawn from ``output_len``."""
    banned = set(spec.tokenizer.all_special_ids) if spec.tokenizer is not None else set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(spec.config, key, None)
        banned.update(
            value if isinstance(value, list | tuple) else [] if value is None else [value]
        )
    rng, requests = random.Random(seed), []
    for i in range(num):
        out = rng.randint(*output_len)
        if prompts:
            requests.append(BenchRequest(prompts[i % len(prompts)], out))
            continue
        ids, length = [], rng.randint(*input_len)
        while len(ids) < length:
            token = rng.randrange(spec.config.vocab_size)
            if token not in banned:
                ids.append(token)
        requests.append(BenchRequest(ids, out))
    return requests


def chat_prompts(tokenizer, workload: str, limit: int | None = None) -> list[list[int]]:
    """The workload's chat prompts as token ids (chat template, generation prompt added)."""
    if workload not in WORKLOADS or tokenizer is None:
        raise ValueError(f"workload must be one of {WORKLOADS}, for a model with a tokenizer")
    records = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    texts = [
        tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        for r in records
        if r["workload"] == workload
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts[:limit]]


def kv_blocks_needed(requests: list[BenchRequest], batch_size: int, k: int) -> int:
    """Enough KV blocks for the ``batch_size`` longest requests at once: no run is memory-bound."""
    lengths = sorted((len(r.prompt_ids) + r.output_len + k + 1 for r in requests), reverse=True)
    return sum(-(-n // BLOCK_SIZE) for n in lengths[:batch_size]) + batch_size


def make_engine(spec: ModelSpec, args, max_num_seqs: int, blocks: int, **options) -> LLMEngine:
    """An engine for ``spec`` at ``args``' dtype, device and seed; ``options``: EngineConfig's."""
    fields = dict(model=spec.engine_model, load_format=spec.load_format, seed=args.seed)
    fields |= dict(dtype=args.dtype, device=args.device, block_size=BLOCK_SIZE)
    return LLMEngine(
        EngineConfig(**fields, max_num_seqs=max_num_seqs, num_kv_blocks=blocks, **options)
    )


def release_memory(device: torch.device) -> None:
    """Let the next system start from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

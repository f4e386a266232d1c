"""Offline batch generation: ``pagedspec generate`` (or ``python -m pagedspec generate``).

Prompts come from a .txt file (one per line), a .jsonl file (``{"prompt": ...}`` or
``{"messages": [...]}`` per line) or ``--prompt``. Results go to stdout or ``--output``.
Every option and the input are checked before the model loads: a bad one prints one
``error: ...`` line naming the option (or the input line) and exits with status 2. Torch and the
engine are imported only once the flags pass (a few seconds saved on ``--help`` and on errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pagedspec.engine.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    EngineConfig,
    SpeculativeConfig,
)
from pagedspec.engine.entrypoints.prompt_files import Line, Messages, read_prompts
from pagedspec.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedspec.engine.entrypoints.llm import LLM
    from pagedspec.engine.outputs import RequestOutput

T = TypeVar("T")

# Config field -> the option (argparse dest) that sets it.
SAMPLING_OPTIONS = {
    name: name
    for name in (
        "n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
        "presence_penalty", "frequency_penalty", "repetition_penalty",
    )
} | {"stop": "stop", "ignore_eos": "ignore_eos", "seed": "request_seed"}  # fmt: skip
SPECULATIVE_OPTIONS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_model": "draft_model",
}
NUM_THREADS_HELP = (
    "CPU kernel threads (default: the CPUs free to this process, fewer while other processes "
    "keep some busy)"
)
ENGINE_OPTIONS = {
    name: name
    for name in (
        "model", "dtype", "device", "load_format", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "num_kv_blocks", "block_size", "attention_backend", "seed",
        "tensor_parallel_size", "quantization", "kv_cache_dtype", "num_threads",
    )
}  # fmt: skip


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" once per option: not for None or False defaults (unset, off), nor
    where the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedspec generate",
        description="Generate completions for a batch of prompts with pagedspec.",
        formatter_class=HelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", type=Path, help=".txt (one prompt per line) or .jsonl file")
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--output", type=Path, help="write one JSON object per prompt to this .jsonl")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--system", help="system message for --chat prompts given as plain text")
    p.add_argument("--quiet", action="store_true", help="do not print the answers")
    add_engine_arguments(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass")
    s.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest (0 or -1: off)"
    )
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top")
    s.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtracted once per generated token"
    )
    s.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence so far"
    )
    s.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divides (or multiplies, if negative) the logit of any token seen; 1 = off",
    )
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer")
    s.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many")
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past the EOS token")
    s.add_argument("--request-seed", type=int, help="per-request seed (reproducible sampling)")
    return p


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model, engine and speculative-decoding flags (``engine_config`` reads them)."""
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q],
        help="weight-only quantisation, CPU float32 (int8: Q8_0, q4_1: Q4_1; default none)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache dtype: auto (the model's), or float16/bfloat16 under a float32 model",
    )
    g.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights"
    )
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="most tokens in one step"
    )
    g.add_argument(
        "--max-model-len", type=int, help="longest sequence (default: the model's context length)"
    )
    g.add_argument(
        "--num-kv-blocks", type=int, help="KV cache blocks (default: sized from free memory)"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="attention kernels"
    )
    g.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests)")
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="split the model over this many ranks"
    )
    g.add_argument("--num-threads", type=int, help=NUM_THREADS_HELP)
    d = p.add_argument_group("speculative decoding")
    d.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, help="off when not given")
    d.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per step")
    d.add_argument("--draft-model", help="draft model for --speculative-method draft")


def from_options(
    factory: Callable[..., T], options: dict[str, str], args: argparse.Namespace, **extra: Any
) -> T:
    """``factory(field=args.<option>, ..., **extra)``. Config errors start with the field's name;
    such an error is raised again naming the option too: "--top-p: top_p must be ..."."""
    try:
        return factory(**{field: getattr(args, dest) for field, dest in options.items()}, **extra)
    except ValueError as e:
        named = _named(e, options)
        if named is e:
            raise
        raise named from None


def _named(error: ValueError, options: dict[str, str]) -> ValueError:
    """``error`` naming its option ("--max-model-len: max_model_len must be ..."), when its
    message starts with one of ``options``' fields; else ``error`` itself."""
    dest = options.get(str(error).split(" ", 1)[0])
    return error if dest is None else ValueError(f"--{dest.replace('_', '-')}: {error}")


def _check_path(name: str, path: str | None) -> None:
    if path is not None and not os.path.exists(os.path.expanduser(path)):
        raise ValueError(f"{name} path does not exist: {path!r}")


def checked_speculative_config(attention_backend: str = "auto", **kwargs: Any) -> SpeculativeConfig:
    """The config, its defaults as under ``attention_backend`` (``SpeculativeConfig.of``)."""
    config = SpeculativeConfig.of(kwargs, attention_backend)
    _check_path("draft_model", config.draft_model)
    return config


def checked_engine_config(**kwargs: Any) -> EngineConfig:
    """The config, plus what loading would only find later: the dtype, device and model path."""
    config = EngineConfig(**kwargs)
    from pagedspec.engine.loader.model_loader import resolve_device, resolve_dtype

    resolve_dtype(config.dtype, resolve_device(config.device))
    _check_path("model", config.model)
    return config


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config ``add_engine_arguments``' flags give; ValueError naming the bad option."""
    spec = None
    if args.speculative_method:
        spec = from_options(
            checked_speculative_config,
            SPECULATIVE_OPTIONS,
            args,
            attention_backend=args.attention_backend,
        )
    return from_options(
        checked_engine_config,
        ENGINE_OPTIONS,
        args,
        enable_prefix_caching=not args.no_prefix_caching,
        speculative_config=spec,
    )


def check_args(args: argparse.Namespace) -> tuple[list[Line], SamplingParams, EngineConfig]:
    """The prompts, sampling parameters and engine config; ValueError naming the bad option."""
    items = read_prompts(args.prompt, args.input)
    params = from_options(SamplingParams, SAMPLING_OPTIONS, args)
    config = engine_config(args)
    if args.output is not None and not args.output.parent.is_dir():
        raise ValueError(f"--output: directory {str(args.output.parent)!r} does not exist")
    if args.output is not None and args.output.is_dir():
        raise ValueError(f"--output: {str(args.output)!r} is a directory, not a file")
    return items, params, config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        items, params, config = check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pagedspec.engine.entrypoints.llm import LLM

    try:  # what only the model can tell: its length, the KV that fits, how its heads split
        llm = LLM(**{f.name: getattr(config, f.name) for f in fields(config)})
        prompts = [_engine_prompt(item.prompt, args, llm.tokenizer) for item in items]
        per_line = [_line_params(params, item, llm) for item in items]
        start = time.perf_counter()
        outputs = llm.generate(prompts, per_line)
    except ValueError as e:
        print(f"error: {_named(e, ENGINE_OPTIONS)}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    if args.output:
        with args.output.open("w") as sink:
            for item, out in zip(items, outputs, strict=True):
                sink.write(json.dumps(_record(item.prompt, out)) + "\n")
    if not args.quiet:
        for item, out in zip(items, outputs, strict=True):
            prompt = item.prompt
            print(f"\n>>> {prompt if isinstance(prompt, str) else prompt[-1]['content']}")
            for c in out.outputs:
                print(f"{c.text.strip()}\n[{len(c.token_ids)} tokens, {c.finish_reason}]")
    print(_summary(llm, outputs, seconds), file=sys.stderr)
    return 0


def _line_params(params: SamplingParams, line: Line, llm: LLM) -> SamplingParams:
    """The flags' params, with the line's constraint; one that does not compile names its line."""
    if line.structured_outputs is None:
        return params
    try:
        llm.llm_engine.processor.check_constraint(line.structured_outputs)
    except ValueError as e:
        raise ValueError(f"{line.where}: {e}") from None
    return dataclasses.replace(params, structured_outputs=line.structured_outputs)


def _engine_prompt(item: str | Messages, args: argparse.Namespace, tokenizer: Any) -> str | dict:
    """Plain text, or a chat conversation rendered and tokenized (one BOS, from the template)."""
    if isinstance(item, str) and not args.chat:
        return item
    messages = item if isinstance(item, list) else [{"role": "user", "content": item}]
    if args.system and isinstance(item, str):
        messages = [{"role": "system", "content": args.system}, *messages]
    from pagedspec.engine.entrypoints.llm import render_chat

    return {"prompt_token_ids": render_chat(tokenizer, messages)[1]}


def _record(item: str | Messages, out: RequestOutput) -> dict:
    return {
        "prompt": item,
        "outputs": [
            {"text": c.text, "num_tokens": len(c.token_ids), "finish_reason": c.finish_reason}
            for c in out.outputs
        ],
        "prompt_tokens": len(out.prompt_token_ids),
    }


def _summary(llm: LLM, outputs: list[RequestOutput], seconds: float) -> str:
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    summary = (
        f"\n{len(outputs)} requests, {prompt_tokens} prompt tokens, {generated} generated tokens "
        f"in {seconds:.2f} s: {generated / seconds:.1f} generated tokens/s"
    )
    stats = llm.llm_engine.get_stats()
    if stats.num_draft_tokens:
        by_pos = ", ".join(
            f"{a / max(stats.num_verifications, 1):.2f}" for a in stats.accepted_by_position
        )
        summary += (
            f"\nspeculation: {stats.num_draft_tokens} drafted, {stats.num_accepted_tokens} "
            f"accepted ({stats.acceptance_rate:.1%}; {stats.num_leaf_tokens} at draft-tree "
            f"leaves), {stats.mean_accepted_length:.2f} tokens per verification, acceptance by "
            f"position [{by_pos}]"
        )
    return summary


if __name__ == "__main__":
    sys.exit(main())

"""Offline batch generation: ``python -m engine.generate`` (console script ``pagedspec-generate``).

Prompts come from a .txt file (one per line), a .jsonl file (``{"prompt": ...}`` or
``{"messages": [...]}`` per line) or ``--prompt``. Results go to stdout or ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine.config import ATTENTION_BACKENDS, SPECULATIVE_METHODS, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedspec-generate",
        description="Generate completions for a batch of prompts with pagedspec.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", type=Path, help=".txt (one prompt per line) or .jsonl file")
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--output", type=Path, help="write one JSON object per prompt to this .jsonl")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--system", help="system message for --chat prompts given as plain text")
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, help="default: the model's context length")
    g.add_argument("--num-kv-blocks", type=int, help="default: sized from free memory")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    g.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests)")
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--request-seed", type=int, help="per-request seed (reproducible sampling)")
    d = p.add_argument_group("speculative decoding")
    d.add_argument("--speculative-method", choices=SPECULATIVE_METHODS)
    d.add_argument("--num-speculative-tokens", type=int, default=4)
    d.add_argument("--draft-model", help="draft model for --speculative-method draft")
    p.add_argument("--quiet", action="store_true", help="do not print the answers")
    return p


def read_prompts(args: argparse.Namespace) -> list[str | list[dict]]:
    """Plain strings, or message lists for chat."""
    if args.prompt:
        items: list = list(args.prompt)
    elif args.input.suffix == ".jsonl":
        items = []
        for n, line in enumerate(args.input.read_text().splitlines(), 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "messages" in obj:
                items.append(obj["messages"])
            elif "prompt" in obj:
                items.append(obj["prompt"])
            else:
                raise ValueError(f"{args.input}:{n}: expected a 'prompt' or 'messages' key")
    else:
        items = [line for line in args.input.read_text().splitlines() if line.strip()]
    if not items:
        raise ValueError("no prompts given")
    return items


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    items = read_prompts(args)
    spec = None
    if args.speculative_method:
        spec = SpeculativeConfig(
            method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_model=args.draft_model,
        )
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        speculative_config=spec,
        seed=args.seed,
    )
    tokenizer = llm.tokenizer
    prompts = []
    for item in items:
        if isinstance(item, list) or args.chat:
            messages = item if isinstance(item, list) else [{"role": "user", "content": item}]
            if args.system and isinstance(item, str):
                messages = [{"role": "system", "content": args.system}, *messages]
            item = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        prompts.append(item)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.request_seed,
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start

    sink = args.output.open("w") if args.output else None
    prompt_tokens = generated = 0
    for item, out in zip(items, outputs, strict=True):
        prompt_tokens += len(out.prompt_token_ids)
        generated += sum(len(c.token_ids) for c in out.outputs)
        if sink:
            record = {
                "prompt": item,
                "outputs": [
                    {
                        "text": c.text,
                        "num_tokens": len(c.token_ids),
                        "finish_reason": c.finish_reason,
                    }
                    for c in out.outputs
                ],
                "prompt_tokens": len(out.prompt_token_ids),
            }
            sink.write(json.dumps(record) + "\n")
        if not args.quiet:
            shown = item if isinstance(item, str) else item[-1]["content"]
            print(f"\n>>> {shown}")
            for c in out.outputs:
                print(f"{c.text.strip()}\n[{len(c.token_ids)} tokens, {c.finish_reason}]")
    if sink:
        sink.close()
    summary = (
        f"\n{len(outputs)} requests, {prompt_tokens} prompt tokens, {generated} generated tokens "
        f"in {seconds:.2f} s: {generated / seconds:.1f} generated tokens/s"
    )
    stats = llm.llm_engine.get_stats()
    if spec is not None and stats.num_draft_tokens:
        by_pos = ", ".join(
            f"{a / max(stats.num_verifications, 1):.2f}" for a in stats.accepted_by_position
        )
        summary += (
            f"\nspeculation: {stats.num_draft_tokens} drafted, {stats.num_accepted_tokens} "
            f"accepted ({stats.acceptance_rate:.1%}), {stats.mean_accepted_length:.2f} tokens "
            f"per verification, acceptance by position [{by_pos}]"
        )
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``pagedspec bench``: offline throughput of a model at a set of batch sizes.

Per batch size B: B requests of ``--input-len`` random prompt tokens (seeded), each making
``--output-len`` tokens (``ignore_eos``; greedy unless ``--temperature``), submitted at once
after one warm-up request; the table gives the wall time, generated and total tokens/s, and
``--output-json`` writes its rows with the config. The model and engine flags are
``pagedspec generate``'s. The repository's ``benchmarks/`` runs the peers (HF transformers,
llama.cpp) beside it; this command measures one installed engine on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from pagedspec.engine.entrypoints.generate import HelpFormatter, add_engine_arguments, engine_config
from pagedspec.engine.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedspec bench",
        description="Offline throughput of a model at a set of batch sizes.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--output-json", type=Path, help="write the rows and the config here")
    add_engine_arguments(p)
    return p


def batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: positive integers, comma-separated; ValueError naming the flag."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers like 1,16, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = batch_sizes(args.batch_sizes)
        for name in ("input_len", "output_len"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True
        )
        config = engine_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch  # (only once the flags pass)

    from pagedspec.engine.entrypoints.llm import LLM

    llm = LLM(**{f.name: getattr(config, f.name) for f in fields(config)})
    vocab = llm.llm_engine.vocab_size
    generator = torch.Generator().manual_seed(0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)  # warm-up
    rows = []
    for b in sizes:
        prompts = [
            {"prompt_token_ids": torch.randint(0, vocab, (args.input_len,), generator=generator)
             .tolist()}
            for _ in range(b)
        ]  # fmt: skip
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        rows.append({"batch_size": b, "seconds": seconds, "generated_tokens": generated,
                     "generated_tok_s": generated / seconds,
                     "total_tok_s": (generated + b * args.input_len) / seconds})  # fmt: skip
    print(f"{'batch':>6} {'seconds':>9} {'gen tok/s':>10} {'total tok/s':>12}")
    for r in rows:
        print(f"{r['batch_size']:>6} {r['seconds']:>9.2f} {r['generated_tok_s']:>10.1f} "
              f"{r['total_tok_s']:>12.1f}")  # fmt: skip
    if args.output_json is not None:
        record = {"rows": rows, "input_len": args.input_len, "output_len": args.output_len,
                  "temperature": args.temperature, "config": asdict(config)}  # fmt: skip
        args.output_json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

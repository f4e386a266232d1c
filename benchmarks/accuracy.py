"""Accuracy of each weight precision (benchmarks.precisions), pagedspec and llama.cpp side by side.

(a) Greedy agreement with pagedspec fp32: the default model's HF fixture prompts (those of
tests/engine/loader/test_default_model.py, plain, and examples/prompts.jsonl through the chat
template),
--max-tokens tokens each, EOS ignored; the share of outputs identical to fp32's and the mean
length of their common prefix with it.
(b) Perplexity on a held-out text, data/alice_ch1-2.txt (Lewis Carroll, Alice's Adventures in
Wonderland, chapters I-II: Project Gutenberg eBook #11, public domain; held out from anything
tuned here, though likely in the model's pretraining data: compare precisions, not absolute
values), in non-overlapping windows of --window tokens, each token after a window's first scored.
pagedspec's logits come from its own ModelRunner (its model, kernels and paged KV cache,
teacher-forced in chunks); llama.cpp's from one ``llama_batch`` per window, every token's logits.
fp32 against llama.cpp F32 is the cross-check: the same weights must give nearly the same
perplexity.
"""

import argparse
import json
import math
import time
from collections.abc import Sequence

import torch

from benchmarks import llamacpp, workload
from benchmarks.precisions import PRECISIONS, engine_options, get_precision
from benchmarks.timing import run_engine
from benchmarks.workload import BenchRequest
from pagedspec.engine.worker.spans import Span

# tests/engine/loader/test_default_model.py's prompts: the ones HF transformers checks the default
# model on.
FIXTURE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
)
EXAMPLES = workload.DATA.parent.parent / "examples" / "prompts.jsonl"
TEXT = workload.DATA / "alice_ch1-2.txt"
CHUNK = 256  # pagedspec's teacher-forced chunk: bounds its logits to CHUNK x vocab floats


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Share of ``outputs`` identical to ``reference`` (same prompts, same order), and the
    length of their common prefixes, in tokens: each and the mean."""
    if len(reference) != len(outputs) or not reference:
        raise ValueError(f"need as many outputs as references (>= 1): {len(outputs)} vs "
                         f"{len(reference)}")  # fmt: skip
    prefixes = [common_prefix(r, o) for r, o in zip(reference, outputs, strict=True)]
    same = sum(list(r) == list(o) for r, o in zip(reference, outputs, strict=True))
    return {"identical": same / len(reference), "mean_common_prefix": sum(prefixes) / len(prefixes),
            "tokens_per_output": sum(map(len, reference)) / len(reference),
            "common_prefixes": prefixes}  # fmt: skip


def token_nll(logits: torch.Tensor, targets: Sequence[int]) -> torch.Tensor:
    """Negative log-likelihood of each target under its row of ``logits`` (float64)."""
    x = torch.as_tensor(logits).double()
    index = torch.as_tensor(targets, dtype=torch.long).unsqueeze(1)
    return torch.logsumexp(x, dim=-1) - x.gather(1, index).squeeze(1)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.mean().item())


def windows(ids: Sequence[int], size: int) -> list[list[int]]:
    """``ids`` cut into consecutive windows of ``size`` tokens (a last one of >= 2 kept)."""
    if size < 2:
        raise ValueError(f"window must be >= 2 tokens, got {size}")
    cut = [list(ids[i : i + size]) for i in range(0, len(ids), size)]
    return [w for w in cut if len(w) >= 2]


def fixture_prompts(tokenizer) -> list[list[int]]:
    """The fixture prompts, then the examples' (chat ones through the template), as token ids
    (text encoded as the engine encodes it)."""
    from pagedspec.engine.entrypoints.llm import render_chat

    records = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    plain = [*FIXTURE_PROMPTS, *(r["prompt"] for r in records if "prompt" in r)]
    chats = [render_chat(tokenizer, r["messages"])[1] for r in records if "messages" in r]
    return [tokenizer.encode(p, add_special_tokens=True) for p in plain] + chats


def pagedspec_side(spec, args, options: dict, requests, chunks: list[list[int]]) -> dict:
    """pagedspec at ``options``: greedy tokens of ``requests`` and the NLL of every scored
    token of ``chunks``, teacher-forced through the engine's ModelRunner."""
    quant = {k: v for k, v in options.items() if k != "dtype"}
    args = argparse.Namespace(**vars(args) | {"dtype": options["dtype"]})
    blocks = workload.kv_blocks_needed(requests, len(requests), 0)
    engine = workload.make_engine(spec, args, len(requests), blocks, **quant)
    tokens = run_engine(engine, requests).token_ids
    del engine
    blocks = -(-args.window // workload.BLOCK_SIZE)
    engine = workload.make_engine(spec, args, 1, blocks, enable_prefix_caching=False, **quant)
    # No request is in flight: the runner may use blocks 0.. as one sequence's table.
    table, nll = list(range(blocks)), []
    for w in chunks:
        for lo in range(0, len(w) - 1, CHUNK):
            hi = min(lo + CHUNK, len(w))
            logits = engine.runner.forward([Span(w[lo:hi], lo, hi - lo, table)]).logits
            targets = w[lo + 1 : hi + 1]
            nll.append(token_nll(logits[: len(targets)], targets))
    return {"tokens": tokens, "nll": torch.cat(nll)}


def llamacpp_side(path: str, requests, chunks: list[list[int]], window: int) -> dict:
    """llama.cpp on ``path``: greedy tokens of ``requests`` (batched, one sequence each) and
    the NLL of every scored token of ``chunks`` (one batch per window)."""
    threads = torch.get_num_threads()
    longest = max(len(r.prompt_ids) + r.output_len for r in requests)
    llama = llamacpp.LlamaCpp(path, len(requests), -(-longest // 256) * 256, 2048, threads)
    try:
        tokens = llamacpp.run_batched(llama, requests, len(requests))[1]
    finally:
        llama.close()
    llama, nll = llamacpp.LlamaCpp(path, 1, -(-window // 256) * 256, window, threads), []
    try:
        for w in chunks:
            logits = llama.decode(w, range(len(w)), [0] * len(w), [True] * len(w))
            nll.append(token_nll(torch.from_numpy(logits[:-1].copy()), w[1:]))
            llama.clear(0)
    finally:
        llama.close()
    return {"tokens": tokens, "nll": torch.cat(nll)}


def _scores(side: dict, reference: list[list[int]]) -> dict:
    return greedy_agreement(reference, side["tokens"]) | {"perplexity": perplexity(side["nll"])}


def run(args) -> dict:
    spec = workload.resolve_model(args.model, "auto", None)
    precisions = [get_precision(n) for n in args.precisions.split(",") if n]
    prompts = fixture_prompts(spec.tokenizer)
    requests = [BenchRequest(ids, args.max_tokens) for ids in prompts]
    ids = spec.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    chunks = windows(ids, args.window)
    source = llamacpp.source_gguf(spec)  # ValueError unless the model is a GGUF
    skipped = llamacpp.unavailable_reason()
    if skipped:
        print(f"skipping llama.cpp: {skipped}", flush=True)
    memo: dict[tuple, dict] = {}  # pagedspec runs by engine options

    def ours(options: dict) -> dict:
        key = tuple(sorted(options.items()))
        if key not in memo:
            t0 = time.perf_counter()
            memo[key] = pagedspec_side(spec, args, options, requests, chunks)
            print(f"pagedspec {options}: {time.perf_counter() - t0:.0f} s", flush=True)
        return memo[key]

    # float32 weights, compute and KV cache: the rows' 16-bit caches are part of what is scored
    reference = ours({"dtype": "float32"})["tokens"]
    rows = []
    for p in precisions:
        row = {"precision": p.name, "note": p.note, "gguf_type": p.gguf_type}
        try:
            options = engine_options(p)  # ValueError while the engine lacks an option
            row["pagedspec_options"] = ", ".join(f"{k}={v}" for k, v in options.items())
            row["pagedspec"] = _scores(ours(options), reference)
        except ValueError as exc:
            row["pagedspec"] = {"error": str(exc)}
        if skipped:
            row["llamacpp"] = {"error": skipped}
        else:
            t0, path = time.perf_counter(), llamacpp.gguf_file(p.gguf_type, source)
            row["llamacpp"] = _scores(llamacpp_side(path, requests, chunks, args.window), reference)
            print(f"llama.cpp {p.gguf_type}: {time.perf_counter() - t0:.0f} s", flush=True)
        rows.append(row)
    machine = workload.machine_info(torch.device("cpu"), "benchmarks.accuracy")
    text = {"file": TEXT.name, "tokens": len(ids), "windows": len(chunks),
            "scored_tokens": sum(len(w) - 1 for w in chunks)}  # fmt: skip
    peer = {"error": skipped} if skipped else {"version": llamacpp.version()}
    payload = {"benchmark": "accuracy", "machine": machine, "config": vars(args),
               "model": spec.name, "text": text, "rows": rows, "llamacpp": peer,
               "prompts": {"num": len(prompts), "max_tokens": args.max_tokens}}  # fmt: skip
    workload.save(payload, args.output_dir, args.tag)
    return payload


def build_parser():
    parser = workload.parser(__doc__)
    add = parser.add_argument
    add("--precisions", default=",".join(PRECISIONS), help=f"among {sorted(PRECISIONS)}")
    add("--max-tokens", type=int, default=64, help="greedy tokens per fixture prompt")
    add("--window", type=int, default=512, help="perplexity window in tokens")
    add("--tag", default="accuracy", help="output file name stem")
    return parser


if __name__ == "__main__":
    run(build_parser().parse_args())

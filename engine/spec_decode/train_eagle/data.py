"""Stage 1: self-distilled conversations. Each instruction goes through the target's chat template
and is answered by our engine (even indices greedy, odd ones at temperature 0.7; the engine's seed
makes a chunk reproducible, per-request seeds would slow sampling down); the token
ids of prompt and answer are saved in chunk files under ``<work_dir>/answers/``. A finished chunk
is never redone, so a killed run resumes at the first missing chunk."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from tqdm.auto import tqdm

SAMPLED_TEMPERATURE = 0.7


def chunk_path(work_dir: str, name: str, index: int) -> str:
    return os.path.join(work_dir, name, f"chunk_{index:05d}.jsonl")


def write_jsonl(path: str, records: list[dict]) -> None:
    """Write then rename: a chunk file exists only once it is complete."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(path + ".tmp", path)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _answer(llm, conversations: list, temperatures: list[float], max_tokens: int) -> list[dict]:
    from engine import SamplingParams

    params = [SamplingParams(temperature=t, max_tokens=max_tokens) for t in temperatures]
    outs = llm.chat(conversations, params, use_tqdm=False)
    return [
        {
            "prompt_ids": list(out.prompt_token_ids),
            "answer_ids": list(out.outputs[0].token_ids),
            "temperature": t,
            "finish_reason": out.outputs[0].finish_reason,
        }
        for out, t in zip(outs, temperatures, strict=True)
    ]


def make_llm(model: str, max_num_seqs: int, seed: int):
    from engine import LLM

    return LLM(model=model, dtype="float32", max_num_seqs=max_num_seqs, seed=seed)


def generate_answers(
    llm_factory,
    prompts: list[str],
    work_dir: str,
    max_tokens: int,
    chunk_size: int,
    on_chunk: Callable[[dict], object] | None = None,
) -> None:
    """Answer every prompt, chunk by chunk, skipping finished chunks. ``llm_factory()`` builds
    the engine (only if some chunk is missing). ``on_chunk`` gets each written chunk's seconds
    and answer tokens (a run killed mid-stage has recorded every chunk it finished)."""
    num_chunks = (len(prompts) + chunk_size - 1) // chunk_size
    todo = [i for i in range(num_chunks) if not os.path.isfile(chunk_path(work_dir, "answers", i))]
    if not todo:
        return
    llm = llm_factory()
    start = time.perf_counter()
    answered = 0
    bar = tqdm(total=len(prompts), initial=(num_chunks - len(todo)) * chunk_size,
               desc="Stage 1: answering", unit="prompt")  # fmt: skip
    last = start
    for i in todo:
        idx = list(range(i * chunk_size, min(len(prompts), (i + 1) * chunk_size)))
        conversations = [[{"role": "user", "content": prompts[j]}] for j in idx]
        temps = [0.0 if j % 2 == 0 else SAMPLED_TEMPERATURE for j in idx]
        records = _answer(llm, conversations, temps, max_tokens)
        for j, r in zip(idx, records, strict=True):
            r["index"] = j
            r["prompt"] = prompts[j]
        write_jsonl(chunk_path(work_dir, "answers", i), records)
        tokens = sum(len(r["answer_ids"]) for r in records)
        answered += tokens
        now = time.perf_counter()
        if on_chunk is not None:
            on_chunk({"seconds": now - last, "answer_tokens": tokens})
        last = now
        bar.update(len(idx))
        elapsed = time.perf_counter() - start
        bar.set_postfix(tok_s=f"{answered / elapsed:.0f}")
    bar.close()


def load_conversations(work_dir: str, name: str = "answers") -> list[dict]:
    folder = os.path.join(work_dir, name)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl"))
    return [r for f in files for r in read_jsonl(os.path.join(folder, f))]


def generate_heldout_chat(llm_factory, path: str, work_dir: str, max_tokens: int) -> int:
    """Greedy answers to the held-out chat prompts (``{"messages": [...]}`` per line), saved as
    one chunk under ``<work_dir>/heldout_chat/``; returns how many."""
    out = chunk_path(work_dir, "heldout_chat", 0)
    if os.path.isfile(out):
        return len(read_jsonl(out))
    conversations = [r["messages"] for r in read_jsonl(path)]
    llm = llm_factory()
    records = _answer(llm, conversations, [0.0] * len(conversations), max_tokens)
    for j, r in enumerate(records):
        r["index"] = j
    write_jsonl(out, records)
    return len(records)

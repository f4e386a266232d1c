"""Stage 1: self-distilled conversations. Each instruction goes through the target's chat template
and is answered by our engine (even indices greedy, odd ones at temperature 0.7; the engine's seed
makes a chunk reproducible, per-request seeds would slow sampling down); the token
ids of prompt and answer are saved in chunk files under ``<work_dir>/answers/``, and the features
the target computed while answering (``capture``) in the chunk's feature file, written first, so
that stage 2 finds them. A finished chunk is never redone, so a killed run resumes at the first
missing chunk."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch
from safetensors.torch import save_file
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


def feature_path(work_dir: str, name: str, chunk_file: str) -> str:
    stem = chunk_file.removesuffix(".jsonl")
    return os.path.join(work_dir, "features", f"{name}_{stem}.safetensors")


def write_features(
    path: str, records: list[dict], feats: list[torch.Tensor], layers: tuple[int, ...]
) -> None:
    """One chunk's feature file, written then renamed: each conversation's L tokens and their
    features [L, (len(layers) + 1) H]. Stage 1 has no features for the last token (it is
    sampled, never fed): its row is zeros, which no trained position reads (position i reads
    feature i - 1 and is trained on feature i and token i + 1, i <= L - 2)."""
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in records]
    if any(len(f) not in (len(s) - 1, len(s)) for f, s in zip(feats, seqs, strict=True)):
        raise ValueError("a conversation of L tokens needs the features of L or L - 1 of them")
    feats = [f if len(f) == len(s) else torch.cat([f, f.new_zeros(1, f.shape[1])])
             for f, s in zip(feats, seqs, strict=True)]  # fmt: skip
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    tensors = {
        "features": torch.cat(feats),
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.long),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([len(r["prompt_ids"]) for r in records]),
        "temperatures": torch.tensor([float(r["temperature"]) for r in records]),
        "feature_layers": torch.tensor(layers, dtype=torch.long),
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)


def answer(
    llm, conversations: list, temperatures: list[float], max_tokens: int, layers: tuple[int, ...]
) -> tuple[list[dict], list[torch.Tensor] | None]:
    """The records of ``llm``'s answers and their features (None if some conversation lacks
    any: stage 2 then computes the chunk's)."""
    from pagedspec import SamplingParams
    from pagedspec.engine.entrypoints.llm import render_chat
    from pagedspec.engine.tools.train_eagle.capture import generate_with_features

    params = [SamplingParams(temperature=t, max_tokens=max_tokens) for t in temperatures]
    prompts = [render_chat(llm.tokenizer, c)[1] for c in conversations]
    outs, feats = generate_with_features(llm, prompts, params, layers)
    records = [
        {
            "prompt_ids": list(out.prompt_token_ids),
            "answer_ids": list(out.outputs[0].token_ids),
            "temperature": t,
            "finish_reason": out.outputs[0].finish_reason,
        }
        for out, t in zip(outs, temperatures, strict=True)
    ]
    return records, None if any(f is None for f in feats) else feats


def _write_chunk(
    work_dir: str,
    name: str,
    index: int,
    records: list[dict],
    feats: list[torch.Tensor] | None,
    layers: tuple[int, ...],
) -> None:
    """Chunk ``index`` of ``name``: its features, then the chunk (which marks it done). Without
    features, a file a killed run left for this chunk goes: its sampled answers were another
    draw."""
    path = chunk_path(work_dir, name, index)
    features_path = feature_path(work_dir, name, os.path.basename(path))
    if feats is not None:
        write_features(features_path, records, feats, layers)
    elif os.path.isfile(features_path):
        os.remove(features_path)
    write_jsonl(path, records)


def make_llm(model: str, max_num_seqs: int, seed: int):
    """Stage 0 and 1's engine: float32 as stage 2's target; no prefix cache, since a cached
    position's features are never computed."""
    from pagedspec import LLM

    return LLM(model=model, dtype="float32", max_num_seqs=max_num_seqs, seed=seed,
               enable_prefix_caching=False)  # fmt: skip


def generate_answers(
    llm_factory,
    prompts: list[str],
    work_dir: str,
    max_tokens: int,
    chunk_size: int,
    on_chunk: Callable[[dict], object] | None = None,
    layers: tuple[int, ...] = (),
) -> None:
    """Answer every prompt, chunk by chunk, skipping finished chunks, and keep the features of
    ``layers`` (stage 2's) made on the way. ``llm_factory()`` builds the engine (only if some
    chunk is missing). ``on_chunk`` gets each written chunk's seconds and answer tokens (a run
    killed mid-stage has recorded every chunk it finished)."""
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
        records, feats = answer(llm, conversations, temps, max_tokens, layers)
        for j, r in zip(idx, records, strict=True):
            r["index"] = j
            r["prompt"] = prompts[j]
        _write_chunk(work_dir, "answers", i, records, feats, layers)
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


def generate_heldout_chat(
    llm_factory, path: str, work_dir: str, max_tokens: int, layers: tuple[int, ...] = ()
) -> int:
    """Greedy answers to the held-out chat prompts (``{"messages": [...]}`` per line), saved as
    one chunk under ``<work_dir>/heldout_chat/`` with their features; returns how many."""
    out = chunk_path(work_dir, "heldout_chat", 0)
    if os.path.isfile(out):
        return len(read_jsonl(out))
    conversations = [r["messages"] for r in read_jsonl(path)]
    llm = llm_factory()
    records, feats = answer(llm, conversations, [0.0] * len(conversations), max_tokens, layers)
    for j, r in enumerate(records):
        r["index"] = j
    _write_chunk(work_dir, "heldout_chat", 0, records, feats, layers)
    return len(records)

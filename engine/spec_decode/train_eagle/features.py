"""Stage 2: the target's features by teacher forcing. HF transformers runs the target in float32
over each whole conversation (prompt + answer) and keeps the final hidden state after the final
norm (what the target feeds its LM head), stored as bfloat16. One feature file per answer chunk
(``<work_dir>/features/<name>_chunk_XXXXX.safetensors``); finished files are skipped."""

from __future__ import annotations

import os
import time

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from engine.spec_decode.train_eagle.data import read_jsonl


def load_target(model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


def feature_path(work_dir: str, name: str, chunk_file: str) -> str:
    stem = chunk_file.removesuffix(".jsonl")
    return os.path.join(work_dir, "features", f"{name}_{stem}.safetensors")


@torch.inference_mode()
def sequence_features(model, sequences: list[list[int]], batch_tokens: int) -> list[torch.Tensor]:
    """Post-norm final hidden states [len, H] (bfloat16) of each sequence; sequences are
    batched by length (right-padded) under ``batch_tokens`` padded tokens per forward."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * len(sequences[order[end]]) <= batch_tokens:
            end += 1
        group = order[start:end]
        width = len(sequences[group[-1]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, i in enumerate(group):
            out[i] = hidden[row, : len(sequences[i])].to(torch.bfloat16).clone()
        start = end
    return out  # type: ignore[return-value]


def compute_features(model_loader, work_dir: str, name: str, batch_tokens: int = 4096) -> dict:
    """Features for every chunk of ``<work_dir>/<name>/``; ``model_loader()`` is called only if
    some chunk lacks its file. Returns timing stats of this call."""
    folder = os.path.join(work_dir, name)
    chunks = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl"))
    todo = [c for c in chunks if not os.path.isfile(feature_path(work_dir, name, c))]
    stats = {"chunks_done_before": len(chunks) - len(todo), "seconds": 0.0, "tokens": 0}
    if not todo:
        return stats
    model = model_loader()
    os.makedirs(os.path.join(work_dir, "features"), exist_ok=True)
    start = time.perf_counter()
    bar = tqdm(todo, desc=f"Stage 2: features ({name})", unit="chunk")
    for chunk in bar:
        records = read_jsonl(os.path.join(folder, chunk))
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in records]
        feats = sequence_features(model, seqs, batch_tokens)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        tensors = {
            "features": torch.cat(feats),
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.long),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "prompt_lens": torch.tensor([len(r["prompt_ids"]) for r in records]),
            "temperatures": torch.tensor([float(r["temperature"]) for r in records]),
        }
        path = feature_path(work_dir, name, chunk)
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
        stats["tokens"] += int(lengths.sum())
        bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - start):.0f}")
    stats["seconds"] = time.perf_counter() - start
    return stats


def load_features(work_dir: str, name: str) -> list[dict]:
    """One dict per conversation: tokens [L] long, features [L, H] bf16, prompt_len, temperature."""
    folder = os.path.join(work_dir, "features")
    files = sorted(f for f in os.listdir(folder) if f.startswith(f"{name}_chunk_"))
    out = []
    for f in files:
        t = load_file(os.path.join(folder, f))
        offsets = t["offsets"].tolist()
        for i in range(len(offsets) - 1):
            a, b = offsets[i], offsets[i + 1]
            out.append({
                "tokens": t["tokens"][a:b],
                "features": t["features"][a:b],
                "prompt_len": int(t["prompt_lens"][i]),
                "temperature": float(t["temperatures"][i]),
            })  # fmt: skip
    return out

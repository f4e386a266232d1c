"""Stage 2: the target's features by teacher forcing, for the chunks whose features stage 1 did
not capture while answering (a work dir of older runs, or other ``feature_layers``). The engine's
own float32 target (the packed CPU kernels and paged attention that compute the features the
head is fed when serving) runs over each whole conversation (prompt + answer), one packed
prefill of many conversations at a time, and keeps the final hidden state after the final norm
(what the target feeds its LM head), after the hidden states of the ``feature_layers`` a
fused-feature head reads (none for EAGLE-1), stored as bfloat16. One feature file per answer
chunk (``<work_dir>/features/<name>_chunk_XXXXX.safetensors``); finished files are skipped. HF
transformers computes the same features (``tests/engine/tools/test_train_eagle.py`` checks it),
~1.3x slower on the 2-core dev CPU (192 against 243 tokens/s on the same 48 conversations, one
thread)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from pagedspec.engine.tools.train_eagle.data import feature_path, read_jsonl, write_features


def load_target(model_path: str):
    """The HF target in float32 (embeddings, LM head and config for training)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


def target_runner(model_path: str, num_tokens: int):
    """The engine's float32 target and a ``ModelRunner`` over a KV cache of ``num_tokens``
    slots (the most one packed forward of ``sequence_features`` may hold)."""
    from pagedspec.engine.config import EngineConfig
    from pagedspec.engine.loader.model_loader import load_model, model_kv_shape
    from pagedspec.engine.worker.model_runner import ModelRunner
    from pagedspec.memory import allocate_kv_caches

    loaded = load_model(model_path, dtype="float32", device="cpu")
    cpu, block_size = torch.device("cpu"), EngineConfig.block_size
    num_blocks = -(-num_tokens // block_size)
    caches = allocate_kv_caches(
        *model_kv_shape(loaded.config), num_blocks, block_size, torch.float32, cpu
    )
    return ModelRunner(loaded.model, caches, "cpu", cpu)


def sequence_features(
    runner, sequences: list[list[int]], batch_tokens: int, layers: tuple[int, ...] = ()
) -> list[torch.Tensor]:
    """Features [len, (len(layers) + 1) * H] (bfloat16) of each sequence: the hidden states after
    ``layers``, then the post-norm final one. Sequences sorted by length go through ``runner``
    (``target_runner``) in packed prefills of at most ``batch_tokens`` tokens (and at most the
    runner's KV cache), each sequence its own span."""
    from pagedspec.engine.worker.spans import Span

    block_size, capacity = runner.block_size, runner.kv_caches[0][0].shape[0]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        spans, tokens, blocks = [], 0, 0
        for i in order[start:]:
            seq = sequences[i]
            need = -(-len(seq) // block_size)
            if spans and (tokens + len(seq) > batch_tokens or blocks + need > capacity):
                break
            if need > capacity:
                raise ValueError(
                    f"a sequence of {len(seq)} tokens exceeds the KV cache ({capacity} blocks)"
                )
            spans.append(Span(seq, 0, 1, range(blocks, blocks + need)))
            tokens, blocks = tokens + len(seq), blocks + need
        hidden = runner.forward(spans, return_hidden=True, hidden_layers=layers).hidden
        parts = hidden.split([len(span.token_ids) for span in spans])
        for i, part in zip(order[start : start + len(spans)], parts, strict=True):
            out[i] = part.to(torch.bfloat16)
        start += len(spans)
    return out  # type: ignore[return-value]


def compute_features(
    runner_factory,
    work_dir: str,
    name: str,
    batch_tokens: int = 4096,
    on_chunk: Callable[[dict], object] | None = None,
    layers: tuple[int, ...] = (),
) -> None:
    """Features (``sequence_features``) for every chunk of ``<work_dir>/<name>/``;
    ``runner_factory()`` (a ``target_runner``) is called only if some chunk lacks its file (or
    has one made for other ``layers``). ``on_chunk`` gets each written file's seconds and
    tokens."""
    folder = os.path.join(work_dir, name)
    chunks = sorted(f for f in os.listdir(folder) if f.endswith(".jsonl"))
    todo = [c for c in chunks if not _has_features(feature_path(work_dir, name, c), layers)]
    if not todo:
        return
    runner = runner_factory()
    start = last = time.perf_counter()
    done = 0
    bar = tqdm(todo, desc=f"Stage 2: features ({name})", unit="chunk")
    for chunk in bar:
        records = read_jsonl(os.path.join(folder, chunk))
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in records]
        feats = sequence_features(runner, seqs, batch_tokens, layers)
        write_features(feature_path(work_dir, name, chunk), records, feats, layers)
        tokens = sum(len(s) for s in seqs)
        done += tokens
        now = time.perf_counter()
        if on_chunk is not None:
            on_chunk({"seconds": now - last, "tokens": tokens})
        last = now
        bar.set_postfix(tok_s=f"{done / (now - start):.0f}")


def _has_features(path: str, layers: tuple[int, ...]) -> bool:
    """Whether ``path`` exists with the features of ``layers`` (a file without the
    ``feature_layers`` entry predates fused features: it holds the final hidden states only)."""
    if not os.path.isfile(path):
        return False
    with safe_open(path, "pt") as f:
        keys = f.keys()
        made = f.get_tensor("feature_layers").tolist() if "feature_layers" in keys else []
    return made == list(layers)


def load_features(work_dir: str, name: str) -> list[dict]:
    """One dict per conversation: tokens [L] long, features [L, (n + 1) * H] bf16 (the final
    hidden state last; the last row zeros where stage 1 captured them), prompt_len,
    temperature."""
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

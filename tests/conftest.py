"""Shared fixtures: tiny random HF models with a real byte-level BPE tokenizer, in tmp dirs, and
a freshly seeded random generator."""

from __future__ import annotations

# First: importing benchmarks moves the checkout's root behind site-packages (pagedspec.checkout
# says why), so transformers finds Hugging Face's ``kernels``, not the ``kernels/`` folder.
import benchmarks  # noqa: F401

# isort: split
import os
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Tests import it from here; the host-overhead benchmark builds its head with it too.
from benchmarks.random_heads import build_random_eagle_head as build_random_eagle_head
from pagedspec import EngineConfig, LLMEngine

ROOT = Path(__file__).resolve().parent.parent  # the checkout

TINY_VOCAB = 512
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Café, naïve, jalapeño, 東京, 😀 — multi-byte characters must survive decoding.",
    "def add(a, b):\n    return a + b\n",
    "one two three four five six seven eight nine ten",
]


def build_tokenizer(path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    return fast


def build_tiny_llama(path, seed: int = 0, layers: int = 2, **overrides) -> str:
    torch.manual_seed(seed)
    options = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg = LlamaConfig(**(options | overrides))
    model = LlamaForCausalLM(cfg)
    # Sharper logits than the default init, so greedy decoding has clear winners and the random
    # model's text is not pure noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    build_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> str:
    """A different, smaller random model with the same vocabulary (a draft model)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh random generator per test; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


def build_random_llama(
    path,
    seed: int = 0,
    std: float = 0.2,
    logit_std: float = 2.0,
    like: str | None = None,
    noise: float = 0.0,
    head_scale: float = 1.0,
    **overrides,
) -> str:
    """A tiny Llama with every weight re-drawn at a large scale and no tokenizer (prompts are
    token ids), saved as a HF directory.

    HF's default init (std 0.02) leaves attention logits near zero, so attention is close to
    uniform and a wrong softmax scale or rope base barely shows. Here q/k/v/o and MLP weights are
    N(0, std²) (std 0.2 at hidden 64: attention logits of several units), embeddings N(0, 1),
    norm scales 1 + N(0, 0.1²), and the LM head is scaled so logits have a spread of about
    ``logit_std``: peaked but far from one-hot.

    ``like``: start from that model's weights instead, add ``noise`` x each tensor's own std of
    Gaussian noise (a draft model that agrees with the target some of the time), multiply the LM
    head by ``head_scale`` (sharper or flatter), and copy its tokenizer files if it has any.
    """
    torch.manual_seed(seed)
    if like is not None:
        model = LlamaForCausalLM.from_pretrained(like, torch_dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std())
            model.lm_head.weight.mul_(head_scale)
        model.save_pretrained(path)
        for name in os.listdir(like):
            if name.startswith("tokenizer") or name == "special_tokens_map.json":
                shutil.copy(os.path.join(like, name), os.path.join(path, name))
        return str(path)
    options = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    cfg = LlamaConfig(**(options | overrides))
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":
                # inputs to the head are RMS-normalised (entries ~1): logits ~ std * sqrt(hidden)
                p.normal_(0.0, logit_std / cfg.hidden_size**0.5)
            else:
                p.normal_(0.0, std)
    model.save_pretrained(path)
    return str(path)


def engine_for(model: str, **kwargs) -> LLMEngine:
    """An engine on ``model`` with 64 KV blocks and ``kwargs``' other ``EngineConfig`` fields."""
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=64, **kwargs))

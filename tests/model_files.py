"""Model files the loader and quantisation tests share: tiny random HF Llama-family models and
the GGUF files llama.cpp's converter would write for them, and the default model's prompts
(checked token for token against HF)."""

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedspec.engine.loader.model_loader import load_model

DEFAULT_MODEL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]
Q = gguf.GGMLQuantizationType
TINY = dict(
    vocab_size=257,  # the 256 byte tokens + one merge, see write_gguf
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"


def random_hf_model(config, seed: int = 0) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
    return model


def write_gguf(hf_model, path: str, arch: str, qtype: Q = Q.F32) -> None:
    """What llama.cpp's converter would write for ``hf_model``: metadata, a byte-level BPE
    tokenizer, q/k rows permuted for the "llama" architecture, matrices quantized to qtype."""
    c = hf_model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    byte_chars = bytes_to_unicode()
    w.add_token_list([byte_chars[b] for b in range(256)] + ["ab"])
    w.add_token_types([1] * 257)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, c.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_cpu(path, **kwargs):
    return load_model(str(path), dtype="float32", device="cpu", **kwargs)

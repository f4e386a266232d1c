"""GGUF checkpoints: open and type-check a file, map its tensor names to HF names, and yield
its weights dequantized to float32 in HF layout (with the ``gguf`` package)."""

from collections.abc import Iterator

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig

_Q = gguf.GGMLQuantizationType
# Weight types the gguf package dequantizes that we accept; anything else is rejected up front.
GGUF_SUPPORTED_TYPES = (
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
)  # fmt: skip
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def read_gguf(path: str) -> gguf.GGUFReader:
    """A reader for ``path``; ValueError if a tensor's quantization type is not supported."""
    reader = gguf.GGUFReader(path)
    check_gguf_types(reader)
    return reader


def check_gguf_types(reader: gguf.GGUFReader) -> None:
    """ValueError naming the first tensor whose quantization type we cannot dequantize."""
    for t in reader.tensors:
        if t.tensor_type not in GGUF_SUPPORTED_TYPES:
            supported = [q.name for q in GGUF_SUPPORTED_TYPES]
            raise ValueError(
                f"GGUF tensor {t.name!r} has unsupported quantization type "
                f"{t.tensor_type.name}; supported: {supported}"
            )


def gguf_to_hf_name(name: str) -> str:
    """GGUF -> HF name (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (llama3 rope scaling factors) is not supported; "
            "load the HF checkpoint instead"
        )
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the supported models")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows (per head: interleaved halves
    back to rotate-half order)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(
    reader: gguf.GGUFReader, config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every GGUF tensor, dequantized and in HF layout."""
    arch = reader.get_field("general.architecture").contents()
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # llama.cpp permutes q/k rows only for its "llama" architecture (llama, mistral).
        if arch == "llama" and ".q_proj." in name:
            w = unpermute_qk(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = unpermute_qk(w, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy

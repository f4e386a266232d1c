"""Build a model and fill its weights from a HF directory, a GGUF file, or random numbers.

Sources: a HF model directory (config.json + *.safetensors, sharded or not, + tokenizer files),
a ``.gguf`` file (dequantized with the ``gguf`` package), or ``None`` for the default model
(converted once from its GGUF into a cache directory, see ``engine.default_model``).
"""

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.models import get_model_class
from engine.models.layers import Linear, RMSNorm
from engine.models.llama import head_dim_of

LOAD_FORMATS = ("auto", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

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

# What a checkpoint source yields: config, tokenizer, and its HF-named weights (None: dummy).
_Source = tuple[PretrainedConfig, PreTrainedTokenizerBase | None, Iterator | None]


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None only for a dummy model built from a config
    path: str


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' -> cuda when available, else cpu; ValueError for CUDA without a GPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in _DTYPES.values():
        raise ValueError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {dtype!r}")
    return resolved


def model_kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim): what the KV cache tensors are sized by."""
    return config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model: str | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    load_format: str = "auto",
    seed: int = 0,
) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and load its weights (or random ones: "dummy").

    ``model``: None (the default model), a HF model directory, a ``.gguf`` file, or, with
    load_format="dummy", a config.json or a directory holding only one.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if model is None:
        from engine.default_model import default_model_dir

        path = default_model_dir()
    else:
        path = os.path.abspath(os.path.expanduser(str(model)))
        if not os.path.exists(path):
            raise ValueError(f"model path does not exist: {model!r}")
    dummy = load_format == "dummy"
    if path.endswith(".gguf") and os.path.isfile(path):
        config, tokenizer, weights = _open_gguf(path, dummy)
    elif os.path.isfile(path) and path.endswith(".json") and dummy:
        config, tokenizer, weights = AutoConfig.from_pretrained(path), None, None
    elif os.path.isdir(path):
        config, tokenizer, weights = _open_hf_dir(path, dummy)
    else:
        raise ValueError(
            f"model must be a HF model directory or a .gguf file (or a config.json with "
            f"load_format='dummy'), got {model!r}"
        )
    cls = get_model_class(config)
    with _default_dtype(dtype), torch.device(device):
        net = cls(config)
    if weights is None:
        _init_dummy(net, seed)
    else:
        net.load_weights(weights)
    net.eval().requires_grad_(False)
    for module in net.modules():
        if isinstance(module, Linear):
            module.prepack()
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, path=path)


def _open_hf_dir(path: str, dummy: bool) -> _Source:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in model directory {path!r}")
    config = AutoConfig.from_pretrained(path)
    get_model_class(config)  # unsupported architectures fail before any weight is read
    has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return config, tokenizer, None if dummy else iter_safetensors(safetensors_files(path))


def safetensors_files(path: str) -> list[str]:
    """The checkpoint files of a HF directory, following model.safetensors.index.json if any."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"no *.safetensors checkpoint in model directory {path!r}")
    return [os.path.join(path, n) for n in names]


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of the given files, one at a time."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _open_gguf(path: str, dummy: bool) -> _Source:
    reader = gguf.GGUFReader(path)
    check_gguf_types(reader)
    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    get_model_class(config)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return config, tokenizer, None if dummy else iter_gguf(reader, config)


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


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) for matrices and biases, 1 for norm scales."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for p in model.parameters():
        if id(p) in norms:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)

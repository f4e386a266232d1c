"""Build a model and fill its weights from a HF directory, a GGUF file, or random numbers.

Sources: a HF model directory (config.json + *.safetensors, sharded or not, + tokenizer files),
a ``.gguf`` file (dequantized by ``engine.gguf_loader``), or ``None`` for the default model
(converted once from its GGUF into a cache directory, see ``engine.default_model``).
"""

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.default_model import default_model_dir
from engine.gguf_loader import iter_gguf, read_gguf
from engine.models import get_model_class
from engine.models.layers import Linear, RMSNorm
from engine.models.llama import head_dim_of

LOAD_FORMATS = ("auto", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

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
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
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
    with default_dtype(dtype), torch.device("meta"):
        net = cls(config)
    _materialize(net, device)
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
    """(HF name, CPU tensor) for every tensor of the given files, one at a time.

    Each tensor is read into its own buffer, which the caller drops once copied, rather than
    through safetensors' memory map: the mapped pages of every tensor read so far stay in the
    process's resident set until the file closes, which for the default model added its whole
    checkpoint (513 MB) to the peak RSS of loading. The largest tensors come first, while few
    parameters are resident yet (see ``_materialize``).
    """
    for file in files:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            by_size = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            by_size.sort(key=lambda item: item[1]["data_offsets"][0] - item[1]["data_offsets"][1])
            for name, info in by_size:
                begin, end = info["data_offsets"]
                f.seek(8 + header_len + begin)
                buffer = torch.empty(end - begin, dtype=torch.uint8)
                if f.readinto(buffer.numpy()) != end - begin:
                    raise ValueError(f"{file!r} ends inside tensor {name!r}")
                dtype = _SAFETENSORS_DTYPES[info["dtype"]]
                yield name, buffer.view(dtype).reshape(info["shape"])


def _open_gguf(path: str, dummy: bool) -> _Source:
    reader = read_gguf(path)
    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    get_model_class(config)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return config, tokenizer, None if dummy else iter_gguf(reader, config)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device uninitialised parameters on ``device`` (tied ones
    stay tied) and move its buffers there (computed on the CPU at construction, e.g. rope's).

    Loading fills every parameter, so none is initialised first: a page of a parameter becomes
    resident only when its weight is copied in, and loading's peak memory is the weights plus
    the tensor being read (initialising at construction made every page resident up front, and
    a tied LM head's own weight too until it was tied: 1.37 GB at peak for the default model).
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in new:
                empty = torch.empty_like(param, device=device)
                new[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            module.register_parameter(name, new[id(param)])
    model.to(device)


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

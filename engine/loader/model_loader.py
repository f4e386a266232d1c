"""Build a model and fill its weights from a HF directory, a GGUF file, or random numbers.

Sources: a HF model directory (config.json + *.safetensors, sharded or not, + tokenizer files),
a ``.gguf`` file (dequantized by ``pagedspec.engine.loader.gguf_loader``), or ``None`` for the
default model (converted once from its GGUF into a cache directory, see
``pagedspec.engine.loader.default_model``).
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.tokenization_auto import (
    TOKENIZER_MAPPING_NAMES,
    get_tokenizer_config,
    tokenizer_class_from_name,
)

from pagedspec.engine.config import QUANTIZATIONS
from pagedspec.engine.distributed.shard import NO_TP, TPShard, check_tp_shapes, kv_heads_of
from pagedspec.engine.loader.default_model import default_model_dir
from pagedspec.engine.loader.gguf_loader import iter_gguf, read_gguf
from pagedspec.engine.loader.safetensors_loader import iter_safetensors, safetensors_files
from pagedspec.engine.models import get_model_class
from pagedspec.engine.models.hf_config import read_model_config
from pagedspec.engine.models.huge_pages import ALIGN, WeightArena, aligned
from pagedspec.engine.models.layers import RMSNorm
from pagedspec.engine.models.linear import Linear, packs_in_place
from pagedspec.engine.models.llama import STACKED, head_dim_of
from pagedspec.kernels import cpu_extension

LOAD_FORMATS = ("auto", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


def model_kv_shape(config: PretrainedConfig, shard: TPShard = NO_TP) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim): what the KV cache tensors are sized by (this
    rank's KV heads only under tensor parallelism)."""
    kv_heads = kv_heads_of(shard, config.num_key_value_heads)[1]
    return config.num_hidden_layers, kv_heads, head_dim_of(config)


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
    shard: TPShard = NO_TP,
    quantization: str | None = None,
) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and load its weights (or random ones: "dummy").

    ``model``: None (the default model), a HF model directory, a ``.gguf`` file, or, with
    load_format="dummy", a config.json or a directory holding only one. With a ``shard`` of
    size > 1 only this rank's slice of every weight is kept (read lazily from safetensors;
    GGUF tensors are dequantized whole, then sliced; dummy weights equal the single-device
    ones' slices). ``quantization`` quantises every Linear's weight once it is loaded (CPU, float32
    only): "int8" to GGUF Q8_0, "q4_1" to Q4_1 but the LM head to Q8_0 (``linear_formats``; a
    tied embedding reads the head's).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if quantization is not None:
        check_quantization(quantization, dtype, device)
    path = _resolve_path(model)
    dummy = load_format == "dummy"
    if path.endswith(".gguf") and os.path.isfile(path):
        config, tokenizer, weights = _open_gguf(path, dummy)
    elif os.path.isfile(path) and path.endswith(".json") and dummy:
        config, tokenizer, weights = read_model_config(path), None, None
    elif os.path.isdir(path):
        config, tokenizer, weights = _open_hf_dir(path, dummy, lazy=shard.size > 1)
    else:
        raise ValueError(
            f"model must be a HF model directory or a .gguf file (or a config.json with "
            f"load_format='dummy'), got {model!r}"
        )
    cls = get_model_class(config)
    if shard.size > 1:
        check_tp_shapes(config, shard.size)
    with default_dtype(dtype), torch.device("meta"):
        net = cls(config, shard)
    arena, in_arena = _pack_memory(net, device, dtype, quantization)
    _materialize(net, device, arena, in_arena)
    net.eval().requires_grad_(False)
    linears = {id(m.weight): m for m in net.modules() if isinstance(m, Linear)}
    formats = linear_formats(net, quantization) if quantization else {}

    def quantize(param: nn.Parameter) -> None:  # as soon as loaded: no float32 model whole
        if id(param) in linears:
            linears[id(param)].quantize(formats[id(param)], arena.empty)

    on_loaded = quantize if quantization else None
    if weights is None and shard.size > 1:
        net.load_weights(_dummy_weights(cls, config, dtype, device, seed), on_loaded)
    elif weights is None:
        _init_dummy(net, seed)
    else:
        net.load_weights(weights, on_loaded)
    for key, module in linears.items():  # the rest (dummy weights); a no-op for those done
        module.quantize(formats[key], arena.empty) if quantization else module.prepack()
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, path=path)


def linear_formats(net: nn.Module, quantization: str) -> dict[int, str]:
    """id(Linear weight) -> its GGUF block format under ``quantization``: "int8" is Q8_0
    everywhere; "q4_1" is Q4_1 but Q8_0 for the LM head (``net.lm_head``), as llama.cpp's
    Q4_1 files keep the output weights (the default model's tied token_embd is Q8_0)."""
    base = "q8_0" if quantization == "int8" else "q4_1"
    formats = {id(m.weight): base for m in net.modules() if isinstance(m, Linear)}
    head = getattr(net, "lm_head", None)
    if isinstance(head, Linear):
        formats[id(head.weight)] = "q8_0"
    return formats


def check_quantization(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """ValueError unless ``quantization`` can run here: "int8" and "q4_1" need the CPU,
    float32 activations and the C++ kernels."""
    if quantization not in QUANTIZATIONS or quantization is None:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU in float32 (dtype 'auto' or "
            f"'float32'), got device {device.type!r} and dtype {dtype}"
        )
    if not cpu_extension.available():
        raise ValueError(
            f"quantization={quantization!r} needs the C++ CPU kernels, which did not build"
        )


def _resolve_path(model: str | None) -> str:
    if model is None:
        return default_model_dir()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if not os.path.exists(path):
        raise ValueError(f"model path does not exist: {model!r}")
    return path


def load_model_config(model: str | None) -> PretrainedConfig:
    """The config of ``model`` (as ``load_model`` takes it) without reading any weight."""
    path = _resolve_path(model)
    if path.endswith(".gguf") and os.path.isfile(path):
        return read_model_config(*os.path.split(path))
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in model directory {path!r}")
    return read_model_config(path)


def _open_hf_dir(path: str, dummy: bool, lazy: bool = False) -> _Source:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in model directory {path!r}")
    config = read_model_config(path)  # unsupported architectures fail before any weight is read
    has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)
    tokenizer = _load_tokenizer(path, config) if has_tokenizer else None
    return config, tokenizer, None if dummy else iter_safetensors(safetensors_files(path), lazy)


def _load_tokenizer(path: str, config: PretrainedConfig) -> PreTrainedTokenizerBase:
    """``AutoTokenizer`` for a HF directory, handed our config where tokenizer_config.json names
    the class: otherwise AutoTokenizer picks the class from the type of its own config, which
    it loads through the model config modules ``read_model_config`` avoids."""
    tokenizer_config = get_tokenizer_config(path)
    if tokenizer_config.get("tokenizer_class") and "auto_map" not in tokenizer_config:
        return AutoTokenizer.from_pretrained(path, config=config)
    return AutoTokenizer.from_pretrained(path)


def _open_gguf(path: str, dummy: bool) -> _Source:
    reader = read_gguf(path)
    folder, name = os.path.split(path)
    config = read_model_config(folder, gguf_file=name)
    tokenizer = _load_gguf_tokenizer(folder, name, config)
    return config, tokenizer, None if dummy else iter_gguf(reader, config)


def _load_gguf_tokenizer(
    folder: str, name: str, config: PretrainedConfig
) -> PreTrainedTokenizerBase:
    """What ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` returns, without the model
    config it first builds from the file (``AutoConfig.for_model``: the imports
    ``read_model_config`` avoids). Where no tokenizer_config.json lies beside the file (a GGUF's
    metadata names no tokenizer class), AutoTokenizer takes the one registered for the
    model_type, TokenizersBackend where none is; anything else is left to AutoTokenizer, as is
    Mistral's own backend (it depends on files beside the GGUF)."""
    class_name = TOKENIZER_MAPPING_NAMES.get(config.model_type) or "TokenizersBackend"
    if get_tokenizer_config(folder) or class_name == "MistralCommonBackend":
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return tokenizer_class_from_name(class_name).from_pretrained(folder, gguf_file=name)


def _dummy_weights(
    cls: type[nn.Module],
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights ``_init_dummy`` gives the single-device model, as HF-named tensors (fused
    parameters split back into their parts), so a tensor-parallel rank can slice them."""
    with default_dtype(dtype), torch.device("meta"):
        full = cls(config)
    norms = {id(m.weight) for m in full.modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in full.named_parameters():
        if id(p) in norms:
            value = torch.ones(p.shape, dtype=p.dtype, device=device)
        else:
            value = torch.empty(p.shape, dtype=p.dtype, device=device)
            value.normal_(0.0, 0.02, generator=gen)
        parts = [(part, index) for fused, part, index in STACKED if f".{fused}." in name]
        if not parts:
            yield name, value
            continue
        fused = name.split(".")[-2]
        pieces = value.split(full._shard_sizes(name))
        for part, index in parts:
            yield name.replace(f".{fused}.", f".{part}."), pieces[index]


def _pack_memory(
    net: nn.Module, device: torch.device, dtype: torch.dtype, quantization: str | None
) -> tuple[WeightArena, set[int]]:
    """The arena on 2 MB pages for the Linear weights' packs
    (``pagedspec.engine.models.huge_pages``) of ``net`` (on the meta device), and the ids of the
    weights whose float data goes there: those packed in place (``packs_in_place``; a weight whose
    pack were new memory would strand its float pages in the arena). Quantised packs go there as
    they are made. Empty where nothing is packed (not the CPU in float32 or bf16, or no C++
    kernels)."""
    weights = {id(m.weight): m.weight for m in net.modules() if isinstance(m, Linear)}
    packed = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if not packed or not cpu_extension.available():
        return WeightArena(0), set()
    if quantization:  # Q8_0's 1 + 2/32 bytes a weight (Q4_1: 0.5 + 4/32), whole panels and blocks
        bound = sum(
            -(-w.shape[0] // 16) * 16 * -(-w.shape[1] // 32) * 34 + 2 * ALIGN
            for w in weights.values()
        )
        return WeightArena(bound), set()
    in_place = {k: w for k, w in weights.items() if packs_in_place(w.shape)}
    capacity = sum(aligned(w.numel() * w.element_size()) for w in in_place.values())
    return WeightArena(capacity), set(in_place)


def _materialize(
    model: nn.Module, device: torch.device, arena: WeightArena, in_arena: set[int]
) -> None:
    """Give a model built on the meta device uninitialised parameters on ``device`` (tied ones
    stay tied) and move its buffers there (computed on the CPU at construction, e.g. rope's);
    the data of the (meta) parameters whose ids are ``in_arena`` comes from ``arena``.

    Loading fills every parameter, so none is initialised first: a page of a parameter becomes
    resident only when its weight is copied in, and loading's peak memory is the weights plus
    the tensor being read (initialising at construction made every page resident up front, and
    a tied LM head's own weight too until it was tied: 1.37 GB at peak for the default model).
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in new:
                empty = (
                    arena.empty(tuple(param.shape), param.dtype)
                    if id(param) in in_arena
                    # not empty_like: on a meta tensor it runs torch._refs, which imports sympy
                    else torch.empty(param.shape, dtype=param.dtype, device=device)
                )
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

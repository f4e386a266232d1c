"""Reading a HF checkpoint's safetensors files one tensor at a time, keeping the loading
process's resident memory to what the model itself needs (``pagedspec.engine.loader.model_loader``
fills the model from them, as it does from ``pagedspec.engine.loader.gguf_loader``)."""

import ctypes
import ctypes.util
import functools
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


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


def iter_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of the given files, one at a time; ``lazy``
    yields safetensors slices instead (a tensor-parallel rank indexes one to read only its
    part; valid until the next item).

    Each tensor is read into its own buffer, which the caller drops once copied, rather than
    through safetensors' memory map: the mapped pages of every tensor read so far stay in the
    process's resident set until the file closes, which for the default model added its whole
    checkpoint (513 MB) to the peak RSS of loading. The largest tensors come first, while few
    parameters are resident yet (see ``_materialize``).
    """
    if lazy:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_slice(name)
        return
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
                del buffer
                trim_heap()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    A tensor's read buffer is freed once copied, but glibc keeps freed chunks below its mmap
    threshold, which rises (to 32 MB) after the first large buffer is unmapped: without a trim
    per tensor those chunks added 22 MB to the default model's peak RSS of loading."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)

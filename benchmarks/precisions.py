"""The one table that maps a weight precision to pagedspec's options and llama.cpp's GGUF type.

``--precision`` of the throughput and accuracy benchmarks names a row. pagedspec's side is
``EngineConfig`` options (``dtype``, ``quantization``, ``kv_cache_dtype``); llama.cpp's is the
GGUF file type its own quantizer writes from the default model's weights
(``benchmarks.llamacpp``), with its default F16 KV cache. pagedspec keeps a 16-bit cache too:
float16 under float32 compute, the model's bf16 under bf16. A row whose engine
option this checkout does not have raises ``ValueError`` naming it, instead of running
something else under its name.
"""

from dataclasses import dataclass, fields

from pagedspec import EngineConfig


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: str  # EngineConfig.dtype
    quantization: str | None  # EngineConfig.quantization; None: the weights in ``dtype``
    gguf_type: str  # llama.cpp's file type at the same precision (benchmarks.llamacpp.FTYPES)
    note: str
    kv_cache_dtype: str = "float16"  # EngineConfig.kv_cache_dtype: llama.cpp's KV is F16


PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp32", "float32", None, "F32", "fp32 weights both sides"),
        # llama.cpp's CPU backend runs F16 matmuls natively and BF16 ones where the CPU has
        # AVX512-BF16; issue 17 measures bf16 against F16.
        Precision("bf16", "bfloat16", None, "F16", "pagedspec bf16 vs llama.cpp F16", "auto"),
        Precision("int8", "float32", "int8", "Q8_0", "weight-only int8 vs llama.cpp Q8_0"),
        # The default model ships as Q4_1 (its tied embedding / LM head Q8_0): both sides run
        # the file's numbers, pagedspec requantising its float32 cache to the same bits.
        Precision("q4_1", "float32", "q4_1", "Q4_1", "Q4_1 as shipped both sides"),
    )
}


def get_precision(name: str) -> Precision:
    """The row called ``name``; ValueError listing the rows otherwise."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def engine_options(precision: Precision) -> dict:
    """pagedspec's ``EngineConfig`` options for ``precision``; ValueError naming the options this
    checkout's engine does not have (e.g. ``quantization`` before its branch is merged)."""
    options = {"dtype": precision.dtype, "quantization": precision.quantization,
               "kv_cache_dtype": precision.kv_cache_dtype}  # fmt: skip
    options = {k: v for k, v in options.items() if k == "dtype" or v not in (None, "auto")}
    missing = {k: v for k, v in options.items() if k not in {f.name for f in fields(EngineConfig)}}
    if missing:
        wanted = ", ".join(f"{k}={v!r}" for k, v in missing.items())
        raise ValueError(
            f"precision {precision.name!r} needs EngineConfig({wanted}), which this checkout's "
            f"engine does not have yet"
        )
    return options

"""The one table that maps a weight precision to pagedspec's options and llama.cpp's GGUF type.

``--precision`` of the throughput and accuracy benchmarks names a row. pagedspec's side is
``EngineConfig`` options (``dtype``, ``quantization``); llama.cpp's is the GGUF file type its own
quantizer writes from the default model's weights (``benchmarks.llamacpp``). A row whose engine
option this checkout does not have raises ``ValueError`` naming it, instead of running
something else under its name.
"""

from dataclasses import dataclass, fields

from engine import EngineConfig


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: str  # EngineConfig.dtype
    quantization: str | None  # EngineConfig.quantization; None: the weights in ``dtype``
    gguf_type: str  # llama.cpp's file type at the same precision (benchmarks.llamacpp.FTYPES)
    note: str


PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp32", "float32", None, "F32", "fp32 weights both sides"),
        # llama.cpp's CPU backend runs F16 matmuls natively and BF16 ones where the CPU has
        # AVX512-BF16; issue 17 measures bf16 against F16.
        Precision("bf16", "bfloat16", None, "F16", "pagedspec bf16 vs llama.cpp F16"),
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
    """pagedspec's ``EngineConfig`` options for ``precision``; ValueError when this checkout's
    engine has no such option (e.g. ``quantization`` before its branch is merged)."""
    options = {"dtype": precision.dtype}
    if precision.quantization is not None:
        if "quantization" not in {f.name for f in fields(EngineConfig)}:
            raise ValueError(
                f"precision {precision.name!r} needs EngineConfig(quantization="
                f"{precision.quantization!r}), which this checkout's engine does not have yet"
            )
        options["quantization"] = precision.quantization
    return options

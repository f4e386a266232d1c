"""The model's linear layers over one step: pagedspec's ``Linear`` against ``F.linear`` and oneDNN,
with float32 weights and (``bf16_*`` columns) bfloat16 weights.

One pass multiplies ``rows`` tokens through every projection of every layer plus the LM head (the
weights stream from memory, as in a step): ``F.linear`` (what HF calls), oneDNN's prepacked
linear (``torch.ops.mkldnn._linear_pointwise`` on a weight reordered for that row count by
``_reorder_linear_weight``, as torch.compile's CPU freezing path runs it) and ``Linear`` (the
packed C++ GEMM), alternated --repeats times; medians, GB/s, GFLOP/s.

Int8 weights (``quantization="int8"``, measured with the float32 model): ``Linear`` quantised to
GGUF Q8_0 (the C++ kernel of cpu_linear_q8.cpp: float32 activations, quantised to int16 per
block inside it; 1 + 2/32 bytes a weight) against the library kernels for int8 weights:
torch's ``_weight_int8pack_mm`` (per-channel int8, float32 and bfloat16 activations) and
oneDNN's int8 linear (``onednn.qlinear_pointwise``: it takes int8 activations, quantised per
call here). Q4_1 weights (``quantization="q4_1"``): ``Linear`` quantised to GGUF Q4_1
(cpu_linear_q4.cpp, the same activations), the ``q4_1`` columns.
"""

import torch
import torch.nn.functional as F

from benchmarks import workload
from benchmarks.timing import percentile, time_calls
from benchmarks.workload import parse_int_list, resolve_model

# The layer under test is engine internals by nature: this benchmark measures it alone.
from pagedspec.engine.loader.model_loader import default_dtype
from pagedspec.engine.models import get_model_class
from pagedspec.engine.models.linear import Linear

# The library int8 kernels are measured up to this many rows: torch's _weight_int8pack_mm with
# float32 activations takes ~10 s a pass at 128 rows, which would make the run last an hour.
LIBRARY_INT8_MAX_ROWS = 64
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def build_parser():
    parser = workload.parser(__doc__, model=False)
    parser.add_argument("--model", default=None, help="HF directory whose config to use")
    parser.add_argument("--rows", default="1,2,3,4,5,8,9,16,32,64,128,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="weight dtypes, each measured alone (float32 first if given; bfloat16 adds the "
        "bf16_* columns)",
    )
    return parser


def measure(spec, dtype: torch.dtype, rows_list: list[int], repeats: int) -> tuple[dict, list]:
    """One model in ``dtype``: {"weight_bytes", "params"} and, per row count, the median ms of
    each implementation (``F.linear``, ``Linear``, oneDNN where available)."""
    torch.manual_seed(0)
    with torch.device("cpu"), default_dtype(dtype):
        model = get_model_class(spec.config)(spec.config).eval().requires_grad_(False)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    plain = {m: m.weight.detach().clone() for m in layers}  # prepack leaves no plain weight
    for m in layers:
        m.prepack()  # as pagedspec.engine.loader.model_loader.load_model does
    sizes = {"weight_bytes": sum(w.numel() * w.element_size() for w in plain.values()),
             "params": sum(w.numel() for w in plain.values())}  # fmt: skip
    with_int8 = dtype == torch.float32
    int8 = {m: int8_layer(m, plain[m]) for m in layers} if with_int8 else {}
    q4_1 = {m: int8_layer(m, plain[m], "q4_1") for m in layers} if with_int8 else {}
    channel = {m: per_channel_int8(plain[m]) for m in layers} if with_int8 else {}
    prepack_int8 = torch.ops.onednn.qlinear_prepack if _ONEDNN and with_int8 else None
    onednn_int8 = {m: prepack_int8(channel[m][0], None) for m in layers} if prepack_int8 else {}
    per_rows = []
    for rows in rows_list:
        inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {m.in_features for m in layers}}
        onednn = onednn_weights(plain, rows)

        def one_pass(impl: str, inputs=inputs, onednn=onednn) -> None:
            for m in layers:
                x = inputs[m.in_features]
                if impl == "f_linear":
                    F.linear(x, plain[m], m.bias)
                elif impl == "onednn":
                    torch.ops.mkldnn._linear_pointwise(x, onednn[m], m.bias, "none", [], "")
                elif impl == "int8":
                    int8[m](x)
                elif impl == "q4_1":
                    q4_1[m](x)
                elif impl == "int8pack_mm":
                    torch.ops.aten._weight_int8pack_mm(x, *channel[m])
                elif impl == "int8pack_mm_bf16":
                    torch.ops.aten._weight_int8pack_mm(x.bfloat16(), channel[m][0],
                                                       channel[m][1].bfloat16())  # fmt: skip
                elif impl == "onednn_int8":
                    onednn_int8_linear(x, onednn_int8[m], channel[m][1], m.bias)
                else:
                    m(x)

        impls = ["f_linear", "linear", *(["onednn"] if onednn else [])]
        if with_int8:
            impls += ["int8", "q4_1"]
            if rows <= LIBRARY_INT8_MAX_ROWS:
                impls += ["int8pack_mm", "int8pack_mm_bf16",
                          *(["onednn_int8"] if onednn_int8 else [])]  # fmt: skip
        times: dict[str, list[float]] = {impl: [] for impl in impls}
        with torch.inference_mode():  # as in serving; with autograd on, Linear skips its pack
            for impl in impls:  # warm-up
                one_pass(impl)
            for _ in range(repeats):  # alternate, so all see the same machine state
                for impl in impls:
                    times[impl] += time_calls(lambda impl=impl: one_pass(impl), 1, warmup=0)
        ms = {impl: percentile(t, 50) * 1e3 for impl, t in times.items()}
        per_rows.append(ms)
        name = str(dtype).removeprefix("torch.")
        print(f"{name}, {rows} rows: " + ", ".join(f"{i} {t:.1f} ms" for i, t in ms.items()))
        del onednn
    return sizes, per_rows


def columns(ms: dict, sizes: dict, rows: int, prefix: str = "") -> dict:
    """A result row's columns for one dtype (bf16: the same names prefixed with ``bf16_``;
    float32 also has the int8 and q4_1 ones)."""
    onednn_ms = ms.get("onednn")
    out = {f"{prefix}{k}": v for k, v in {
        "f_linear_ms": ms["f_linear"], "linear_ms": ms["linear"], "onednn_ms": onednn_ms,
        "speedup": ms["f_linear"] / ms["linear"],
        "vs_onednn": onednn_ms / ms["linear"] if onednn_ms else None,
        "linear_gbs": sizes["weight_bytes"] / ms["linear"] / 1e6,
        "linear_gflops": 2 * sizes["params"] * rows / ms["linear"] / 1e6}.items()}  # fmt: skip
    if "int8" in ms:
        out |= {"int8_ms": ms["int8"], "int8_vs_linear": ms["linear"] / ms["int8"],
                "int8_gbs": sizes["params"] * (1 + 2 / 32) / ms["int8"] / 1e6,
                "q4_1_ms": ms["q4_1"], "q4_1_vs_linear": ms["linear"] / ms["q4_1"],
                "q4_1_gbs": sizes["params"] * (0.5 + 4 / 32) / ms["q4_1"] / 1e6,
                "int8pack_mm_ms": ms.get("int8pack_mm"),
                "int8pack_mm_bf16_ms": ms.get("int8pack_mm_bf16"),
                "onednn_int8_ms": ms.get("onednn_int8")}  # fmt: skip
    return out


def run(args) -> dict:
    rows_list = parse_int_list(args.rows, "rows")
    dtypes = [d for d in ("float32", "bfloat16") if d in args.dtypes.split(",")]
    if not dtypes:
        raise ValueError(f"--dtypes must name float32 and/or bfloat16, got {args.dtypes!r}")
    spec = resolve_model(args.model, "auto", None)
    results = [{"rows": rows} for rows in rows_list]
    payload = {"benchmark": "linear", "machine": workload.machine_info(torch.device("cpu"),
               "benchmarks.linear"), "model": spec.name, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "results": results}  # fmt: skip
    for dtype in dtypes:
        prefix = "" if dtype == "float32" else "bf16_"
        sizes, per_rows = measure(spec, getattr(torch, dtype), rows_list, args.repeats)
        payload[f"{prefix}weight_bytes"] = sizes["weight_bytes"]
        for result, ms in zip(results, per_rows, strict=True):
            result.update(columns(ms, sizes, result["rows"], prefix))
    workload.save(payload, args.output_dir, "linear")
    return payload


def int8_layer(m: Linear, weight: torch.Tensor, fmt: str = "q8_0") -> Linear:
    """A copy of ``m`` quantised to GGUF block format ``fmt`` as ``quantization="int8"`` (Q8_0)
    or ``"q4_1"`` loads it."""
    q = Linear(m.in_features, m.out_features, bias=m.bias is not None).requires_grad_(False)
    q.weight.data = weight.clone()
    if m.bias is not None:
        q.bias.data = m.bias.detach().clone()
    q.quantize(fmt)
    return q


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]): symmetric per-output-channel, what the library
    int8 kernels take."""
    scale = weight.abs().amax(1).clamp_min(1e-12) / 127
    return (weight / scale[:, None]).round().to(torch.int8), scale


def onednn_weights(plain: dict, rows: int) -> dict:
    """Each weight reordered by oneDNN for ``rows`` rows; {} where oneDNN has no such linear
    on this CPU (bf16 needs AVX512BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has none)."""
    if not _ONEDNN:
        return {}
    try:
        return {m: torch.ops.mkldnn._reorder_linear_weight(w, rows) for m, w in plain.items()}
    except RuntimeError as e:
        print(f"oneDNN prepacked linear skipped: {e}")
        return {}


def onednn_int8_linear(x, packed, w_scale, bias) -> torch.Tensor:
    """oneDNN's int8 linear on float32 x: x quantised per tensor (uint8, zero point 128) first."""
    x_scale = float(x.abs().max()) / 127 or 1.0
    qx = (x / x_scale).round().add(128).clamp(0, 255).to(torch.uint8)
    zero = torch.zeros(len(w_scale), dtype=torch.int64)
    return torch.ops.onednn.qlinear_pointwise(
        qx, x_scale, 128, packed, w_scale, zero, bias, 1.0, 0, torch.float32, "none", [], ""
    )


if __name__ == "__main__":
    run(build_parser().parse_args())

"""The model's linear layers over one step: pagedspec's ``Linear`` against ``F.linear`` and oneDNN,
with float32 weights and (``bf16_*`` columns) bfloat16 weights.

One pass multiplies ``rows`` tokens through every projection of every layer plus the LM head (the
weights stream from memory, as in a step): ``F.linear`` (what HF calls), oneDNN's prepacked
linear (``torch.ops.mkldnn._linear_pointwise`` on a weight reordered for that row count by
``_reorder_linear_weight``, as torch.compile's CPU freezing path runs it) and ``Linear`` (the
packed C++ GEMM), alternated --repeats times; medians, GB/s, GFLOP/s.
"""

import torch
import torch.nn.functional as F

from benchmarks import workload
from benchmarks.timing import percentile, time_calls
from benchmarks.workload import parse_int_list, resolve_model

# The layer under test is engine internals by nature: this benchmark measures it alone.
from engine.model_loader import default_dtype
from engine.models import get_model_class
from engine.models.layers import Linear

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def build_parser():
    parser = workload.parser(__doc__, model=False)
    parser.add_argument("--model", default=None, help="HF directory whose config to use")
    parser.add_argument("--rows", default="1,2,4,5,8,9,16,32,64,128,256,512")
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
        m.prepack()  # as engine.model_loader.load_model does
    sizes = {"weight_bytes": sum(w.numel() * w.element_size() for w in plain.values()),
             "params": sum(w.numel() for w in plain.values())}  # fmt: skip
    per_rows = []
    for rows in rows_list:
        inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {m.in_features for m in layers}}
        reorder = torch.ops.mkldnn._reorder_linear_weight if _ONEDNN else None
        onednn = {m: reorder(plain[m], rows) for m in layers} if reorder else {}

        def one_pass(impl: str, inputs=inputs, onednn=onednn) -> None:
            for m in layers:
                x = inputs[m.in_features]
                if impl == "f_linear":
                    F.linear(x, plain[m], m.bias)
                elif impl == "onednn":
                    torch.ops.mkldnn._linear_pointwise(x, onednn[m], m.bias, "none", [], "")
                else:
                    m(x)

        impls = ["f_linear", "linear", *(["onednn"] if onednn else [])]
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
    """A result row's columns for one dtype (bf16: the same names prefixed with ``bf16_``)."""
    onednn_ms = ms.get("onednn")
    return {f"{prefix}{k}": v for k, v in {
        "f_linear_ms": ms["f_linear"], "linear_ms": ms["linear"], "onednn_ms": onednn_ms,
        "speedup": ms["f_linear"] / ms["linear"],
        "vs_onednn": onednn_ms / ms["linear"] if onednn_ms else None,
        "linear_gbs": sizes["weight_bytes"] / ms["linear"] / 1e6,
        "linear_gflops": 2 * sizes["params"] * rows / ms["linear"] / 1e6}.items()}  # fmt: skip


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


if __name__ == "__main__":
    run(build_parser().parse_args())

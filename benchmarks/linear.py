"""The model's linear layers over one step: pagedspec's ``Linear`` against ``F.linear`` and oneDNN.

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
from engine.models import get_model_class
from engine.models.layers import Linear

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def build_parser():
    parser = workload.parser(__doc__, model=False)
    parser.add_argument("--model", default=None, help="HF directory whose config to use")
    parser.add_argument("--rows", default="1,2,4,5,8,9,16,32,64,128,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def run(args) -> dict:
    rows_list = parse_int_list(args.rows, "rows")
    spec = resolve_model(args.model, "auto", None)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = get_model_class(spec.config)(spec.config).eval().requires_grad_(False)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    plain = {m: m.weight.detach().clone() for m in layers}  # prepack leaves no plain weight
    for m in layers:
        m.prepack()  # as engine.model_loader.load_model does
    weight_bytes = sum(w.numel() * w.element_size() for w in plain.values())
    params = sum(w.numel() for w in plain.values())
    results = []
    for rows in rows_list:
        inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
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
            for _ in range(args.repeats):  # alternate, so all see the same machine state
                for impl in impls:
                    times[impl] += time_calls(lambda impl=impl: one_pass(impl), 1, warmup=0)
        ms = {impl: percentile(t, 50) * 1e3 for impl, t in times.items()}
        onednn_ms = ms.get("onednn")
        results.append({"rows": rows, "f_linear_ms": ms["f_linear"], "linear_ms": ms["linear"],
            "onednn_ms": onednn_ms, "speedup": ms["f_linear"] / ms["linear"],
            "vs_onednn": onednn_ms / ms["linear"] if onednn_ms else None,
            "linear_gbs": weight_bytes / ms["linear"] / 1e6,
            "linear_gflops": 2 * params * rows / ms["linear"] / 1e6})  # fmt: skip
        print(f"{rows} rows: " + ", ".join(f"{impl} {t:.1f} ms" for impl, t in ms.items()))
        del onednn
    machine = workload.machine_info(torch.device("cpu"), "benchmarks.linear")
    payload = {"benchmark": "linear", "machine": machine, "model": spec.name,
               "threads": torch.get_num_threads(), "weight_bytes": weight_bytes,
               "repeats": args.repeats, "results": results}  # fmt: skip
    workload.save(payload, args.output_dir, "linear")
    return payload


if __name__ == "__main__":
    run(build_parser().parse_args())

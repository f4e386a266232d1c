"""The model's linear layers over one step: pagedspec's ``Linear`` against plain ``F.linear``.

One pass multiplies ``rows`` tokens through every projection of every layer plus the LM head (the
weights stream from memory, as in a step): ``F.linear`` (what HF calls) vs ``Linear`` (a split GEMV
for 1-2 rows, the packed C++ GEMM for more), alternated --repeats times; medians, GB/s, GFLOP/s.
"""

import torch
import torch.nn.functional as F

from benchmarks import workload
from benchmarks.timing import percentile, time_calls
from benchmarks.workload import parse_int_list, resolve_model

# The layer under test is engine internals by nature: this benchmark measures it alone.
from engine.models import get_model_class
from engine.models.layers import Linear


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
        model = get_model_class(spec.config)(spec.config).eval()
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.prepack()  # as engine.model_loader.load_model does
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    params = sum(m.weight.numel() for m in layers)
    results = []
    for rows in rows_list:
        inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}

        def one_pass(plain: bool, inputs=inputs) -> None:
            for m in layers:
                x = inputs[m.in_features]
                F.linear(x, m.weight, m.bias) if plain else m(x)

        times: dict[bool, list[float]] = {True: [], False: []}
        with torch.inference_mode():  # as in serving; with autograd on, Linear skips its pack
            one_pass(True), one_pass(False)  # warm-up
            for _ in range(args.repeats):  # alternate, so both see the same machine state
                for plain in times:
                    times[plain] += time_calls(lambda plain=plain: one_pass(plain), 1, warmup=0)
        plain_s, ours_s = percentile(times[True], 50), percentile(times[False], 50)
        results.append({"rows": rows, "f_linear_ms": plain_s * 1e3, "linear_ms": ours_s * 1e3,
            "speedup": plain_s / ours_s, "linear_gbs": weight_bytes / ours_s / 1e9,
            "linear_gflops": 2 * params * rows / ours_s / 1e9})  # fmt: skip
        print(f"{rows} rows: F.linear {plain_s * 1e3:.1f} ms, Linear {ours_s * 1e3:.1f} ms")
    machine = workload.machine_info(torch.device("cpu"), "benchmarks.linear")
    payload = {"benchmark": "linear", "machine": machine, "model": spec.name,
               "threads": torch.get_num_threads(), "weight_bytes": weight_bytes,
               "repeats": args.repeats, "results": results}  # fmt: skip
    workload.save(payload, args.output_dir, "linear")
    return payload


if __name__ == "__main__":
    run(build_parser().parse_args())

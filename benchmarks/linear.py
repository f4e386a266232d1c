"""The model's linear layers over one step: pagedspec's ``Linear`` against plain ``F.linear``.

One pass multiplies ``rows`` tokens through every projection of every layer plus the LM head,
each with its own weight (as in a real step, the weights stream from memory rather than sit in
cache). ``F.linear`` is what HF transformers calls; ``Linear`` (engine/models/layers.py) splits
the weight's rows across the CPU threads for 1-2 rows and runs the C++ kernel of
kernels/csrc/cpu_linear.cpp on a packed weight for more. The two are timed alternately,
``--repeats`` times each, and the median is reported with the weight bandwidth and the FLOP rate
it implies. Random weights with the shapes of the default model (SmolLM2-135M), of --model or
of --model-config.

    python -m benchmarks.linear [--rows 1,2,4,8,16,32,64,128,256] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import roofline
from benchmarks.throughput import parse_int_list, resolve_model
from engine.models import get_model_class
from engine.models.layers import Linear


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,5,8,9,16,32,64,128,256,512")
    parser.add_argument("--model", default=None, help="HF directory whose config to use")
    parser.add_argument("--model-config", default=None, help="a benchmarks/model_configs name")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmarks/results"))
    return parser


def run(args: argparse.Namespace) -> dict:
    rows_list = parse_int_list(args.rows, "rows")
    if args.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {args.repeats}")
    load_format = "dummy" if args.model_config else "auto"
    spec = resolve_model(args.model, load_format, args.model_config)

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = get_model_class(spec.config)(spec.config).eval()
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.prepack()  # as engine.model_loader.load_model does
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    params = sum(m.weight.numel() for m in layers)
    threads = torch.get_num_threads()
    print(
        f"{spec.name}: {len(layers)} linear layers, {weight_bytes / 1e6:.0f} MB of weights, "
        f"{threads} threads"
    )

    results = []
    print(
        f"{'rows':>5} {'F.linear ms':>12} {'Linear ms':>10} {'speedup':>8} {'GB/s':>6} "
        f"{'GFLOP/s':>8}"
    )
    with torch.inference_mode():
        for rows in rows_list:
            inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}

            def plain(inputs=inputs) -> None:
                for m in layers:
                    F.linear(inputs[m.in_features], m.weight, m.bias)

            def ours(inputs=inputs) -> None:
                for m in layers:
                    m(inputs[m.in_features])

            plain(), ours()  # warm-up
            times: dict[str, list[float]] = {"F.linear": [], "Linear": []}
            for _ in range(args.repeats):  # alternate, so both see the same machine state
                times["F.linear"].append(seconds(plain))
                times["Linear"].append(seconds(ours))
            plain_s, ours_s = (statistics.median(times[k]) for k in ("F.linear", "Linear"))
            row = {
                "rows": rows,
                "f_linear_ms": plain_s * 1e3,
                "linear_ms": ours_s * 1e3,
                "speedup": plain_s / ours_s,
                "linear_gbs": weight_bytes / ours_s / 1e9,
                "linear_gflops": 2 * params * rows / ours_s / 1e9,
            }
            results.append(row)
            print(
                f"{rows:>5} {row['f_linear_ms']:>12.1f} {row['linear_ms']:>10.1f} "
                f"{row['speedup']:>7.2f}x {row['linear_gbs']:>6.1f} {row['linear_gflops']:>8.0f}"
            )

    payload = {
        "benchmark": "linear",
        "machine": roofline.machine_info(torch.device("cpu"), "benchmarks.linear"),
        "model": spec.name,
        "threads": threads,
        "weight_bytes": weight_bytes,
        "repeats": args.repeats,
        "results": results,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "linear.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return payload


def main() -> None:
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()

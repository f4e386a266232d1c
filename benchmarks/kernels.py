"""Paged attention on the CPU: the C++ kernel (backend "cpu", the CPU serving path) against
gather + SDPA ("torch") on the default model's shape (9 query / 3 KV heads, head dim 64, block 16,
fp32), batch 64, contexts uniform in 100..1000, per span (``gpu_check.sh`` checks CUDA kernels).
"""

from functools import partial

import torch

import kernels
from benchmarks import workload
from benchmarks.timing import percentile, time_calls
from benchmarks.workload import parse_int_list
from kernels.testing import PagedProblem, make_paged_problem


def kv_bytes(p: PagedProblem) -> int:
    """Bytes of K and V the attention must read: every cached position of every sequence once."""
    _, _, num_kv_heads, head_dim = p.k_cache.shape
    return int(p.seq_lens.sum()) * num_kv_heads * head_dim * 2 * p.k_cache.element_size()


def run(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    batch, layers = 64, 30
    contexts = torch.randint(100, 1001, (batch,), generator=gen).tolist()
    rows = []
    for span in args.spans:
        p = make_paged_problem(
            [span] * batch, [max(c, span) for c in contexts], num_heads=9, num_kv_heads=3,
            head_dim=64, block_size=16, generator=gen, poison_unused=False,
        )  # fmt: skip
        for backend in ("torch", "cpu"):
            out = torch.empty_like(p.query)
            call = partial(kernels.paged_attention, *p.args(), 0.125, out=out, backend=backend)
            times = time_calls(call, args.iters, warmup=3)
            seconds = percentile(times, 50)
            rows.append({"span": span, "batch": batch, "context": "uniform 100..1000",
                "backend": backend, "median_us": seconds * 1e6, "min_us": min(times) * 1e6,
                "gb_per_s": kv_bytes(p) / seconds / 1e9,
                "ms_per_step_30_layers": seconds * layers * 1e3})  # fmt: skip
        rows[-1]["speedup_vs_torch"] = rows[-2]["median_us"] / rows[-1]["median_us"]
    shape = {"heads": 9, "kv_heads": 3, "head_dim": 64, "block_size": 16, "dtype": "float32"}
    machine = workload.machine_info(torch.device("cpu"), "benchmarks.kernels")
    return {"benchmark": "kernels", "device": "cpu", "machine": machine,
            "threads": torch.get_num_threads(), "shape": shape, "rows": rows}  # fmt: skip


def build_parser():
    parser = workload.parser(__doc__, model=False, output_dir=".")
    parser.add_argument("--spans", type=lambda t: parse_int_list(t, "spans"), default=[1, 5])
    parser.add_argument("--iters", type=int, default=20)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    workload.save(run(args), args.output_dir, "kernels")


if __name__ == "__main__":
    main()

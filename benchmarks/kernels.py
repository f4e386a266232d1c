"""Paged-attention kernel benchmark: Triton vs xFormers vs the PyTorch reference (gather + SDPA).

CUDA (``gpu_check.sh``): spans 1 and 5, batch {1, 8, 64, 256} x context {512, 4096, 16384}, bf16,
32 query / 8 KV heads, head dim 128, block 16, shuffled block tables; each backend checked against
the reference, then the median of CUDA-event timings with the L2 flushed before each call. GB/s
counts the K/V bytes read; "of copy" divides by a 1 GiB device copy's bandwidth. Where split-KV
kicks in, a forced single-pass Triton row shows what it buys; cases that do not fit are skipped.

CPU: the C++ kernel (backend "cpu") against gather + SDPA ("torch") on the default model's shape
(9 query / 3 KV heads, head dim 64, block 16, fp32), batch 64, contexts uniform in 100..1000.
"""

import argparse
import itertools
import math
from collections.abc import Callable
from functools import partial

import torch

import kernels
from benchmarks import workload
from benchmarks.timing import percentile, time_calls
from benchmarks.workload import parse_int_list
from kernels import reference
from kernels.testing import PagedProblem, make_paged_problem

GiB = 1 << 30


def kv_bytes(p: PagedProblem) -> int:
    """Bytes of K and V the attention must read: every cached position of every sequence once."""
    _, _, num_kv_heads, head_dim = p.k_cache.shape
    return int(p.seq_lens.sum()) * num_kv_heads * head_dim * 2 * p.k_cache.element_size()


def time_cuda(fn: Callable[[], object], iters: int, warmup: int, flush: torch.Tensor) -> float:
    """Median seconds per call by CUDA events, each call timed alone after overwriting the L2."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return percentile(times, 50)


def run_cuda(args: argparse.Namespace) -> dict:
    """All CUDA cases, the JSON saved after each case (a killed run keeps what it measured)."""
    from kernels import triton_attention

    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda")  # copy bandwidth: read + write
    dst = torch.empty_like(src)
    copy_bw = 2 * GiB / time_cuda(lambda: dst.copy_(src), 10, 3, flush)
    backends = {name: lambda *a, b=name: kernels.paged_attention(*a, backend=b)
                for name in ("triton", "torch", "xformers")}  # fmt: skip
    backends["triton-1pass"] = lambda *a: triton_attention.paged_attention(*a, num_splits=1)
    try:
        import xformers.ops  # noqa: F401

        xf = "ok"
    except Exception as exc:  # any failure (missing, wrong build) just drops its rows
        xf = f"{type(exc).__name__}: {exc}"
        del backends["xformers"]
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    scale = head_dim**-0.5
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s; xformers: {xf}")
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    result = {"benchmark": "kernels", "device": torch.cuda.get_device_name(),
              "machine": workload.machine_info(torch.device("cuda"), "benchmarks.kernels"),
              "copy_bandwidth_gb_per_s": copy_bw / 1e9, "xformers": xf,
              "shape": shape | {"dtype": "bfloat16"}, "rows": [], "skipped": []}  # fmt: skip
    for span, batch, context in itertools.product(args.spans, (1, 8, 64, 256), (512, 4096, 16384)):
        case = {"span": span, "batch": batch, "context": context}
        cache_bytes = 2 * (batch * math.ceil(context / block_size) + 2) * block_size * kv_heads
        cache_bytes *= head_dim * 2
        # bf16 cache, its fp32 copy for the accuracy check, the reference's gathered chunks
        # (<= 1 GiB per tensor) and slack.
        if 3 * cache_bytes + 6 * GiB > torch.cuda.mem_get_info()[0]:
            result["skipped"].append({**case, "why": f"needs {cache_bytes / GiB:.1f} GiB"})
            print(f"skipped {case}: {result['skipped'][-1]['why']}")
            continue
        p = make_paged_problem(
            [span] * batch, [context] * batch, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
            device="cuda", poison_unused=False,
        )  # fmt: skip
        exact = reference.paged_attention(*p.to(torch.float32).args(), scale)
        splits = triton_attention.plan_launch(
            batch * span, batch, heads // kv_heads, kv_heads,
            p.block_tables.shape[1] * block_size, p.query.device,
        ).num_splits  # fmt: skip
        for name, fn in backends.items():
            if name == "triton-1pass" and splits == 1:
                continue  # identical to "triton"
            row = {**case, "backend": name, "kv_bytes": kv_bytes(p)}
            try:
                err = (fn(*p.args(), scale).float() - exact).abs().max()
                seconds = time_cuda(lambda fn=fn, p=p: fn(*p.args(), scale), args.iters, 3, flush)
            except Exception as exc:  # a backend that cannot run a case gets a note
                result["rows"].append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            result["rows"].append(row | {"splits": splits if name == "triton" else None,
                "median_us": seconds * 1e6, "gb_per_s": row["kv_bytes"] / seconds / 1e9,
                "of_copy_bw": row["kv_bytes"] / seconds / copy_bw,
                "rel_err_vs_fp32": float(err / exact.abs().max())})  # fmt: skip
            print(f"{case} {name}: {seconds * 1e6:.0f} us", flush=True)
        del p, exact
        torch.cuda.empty_cache()
        workload.save(result, args.output_dir, "kernels")
    return result


def run_cpu(args: argparse.Namespace) -> dict:
    print("CUDA is not available: timing the CPU backends (C++ 'cpu', gather + SDPA 'torch').")
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


def build_parser() -> argparse.ArgumentParser:
    parser = workload.parser(__doc__, model=False, output_dir=".")
    parser.add_argument("--spans", type=lambda t: parse_int_list(t, "spans"), default=[1, 5])
    parser.add_argument("--iters", type=int, default=20)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    result = run_cuda(args) if torch.cuda.is_available() else run_cpu(args)
    workload.finish(result, args.output_dir, "kernels")


if __name__ == "__main__":
    main()

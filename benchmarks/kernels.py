"""Paged-attention kernel benchmark.

CUDA (the default there; ``gpu_check.sh``): Triton vs xFormers vs the PyTorch reference (gather +
SDPA), spans 1 and 5, batch {1, 16, 64, 256} x context {512, 4096, 16384} up to --max-kv-tokens,
bf16, 32 query / 8 KV heads, head dim 128, block 16, shuffled block tables; each backend checked
against an fp32 reference, then the median of CUDA-event timings with the L2 flushed before each
call. GB/s counts the K/V bytes read; "of copy" divides by a 1 GiB device copy's bandwidth. Where
split-KV kicks in, a forced single-pass Triton row shows what it buys. The JSON is saved after
each case. ``--tiny`` runs the same cases at toy sizes on the CPU (Triton's interpreter, fp32):
the GPU check's dry run.

CPU: the C++ kernel (backend "cpu") against gather + SDPA ("torch") on the default model's shape
(9 query / 3 KV heads, head dim 64, block 16, fp32), batch 64, contexts uniform in 100..1000.
"""

import argparse
import itertools
import time
from collections.abc import Callable
from functools import partial

import torch

from benchmarks import workload
from benchmarks.timing import percentile, time_calls
from benchmarks.workload import parse_int_list
from pagedspec import kernels
from pagedspec.kernels import reference
from pagedspec.kernels.testing import PagedProblem, make_paged_problem

GiB = 1 << 30


def kv_bytes(p: PagedProblem) -> int:
    """Bytes of K and V the attention must read: every cached position of every sequence once."""
    _, _, num_kv_heads, head_dim = p.k_cache.shape
    return int(p.seq_lens.sum()) * num_kv_heads * head_dim * 2 * p.k_cache.element_size()


def time_gpu(fn: Callable[[], object], iters: int, flush: torch.Tensor | None) -> float:
    """Median seconds per call after 3 warm-ups: CUDA events with the L2 overwritten before each
    call on a GPU (flush), the wall clock elsewhere."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if flush is None:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return percentile(times, 50)


def run_gpu(args: argparse.Namespace) -> dict:
    """All GPU cases (or their --tiny CPU versions), the JSON saved after each case."""
    from pagedspec.kernels import triton_attention

    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if cuda else None
    src = torch.empty(GiB if cuda else 1 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_gpu(lambda: dst.copy_(src), 10, flush)
    backends = {name: partial(kernels.paged_attention, backend=name)
                for name in ("triton", "torch", "xformers")}  # fmt: skip
    backends["triton-1pass"] = partial(triton_attention.paged_attention, num_splits=1)
    try:
        import xformers.ops  # noqa: F401

        xf = "ok" if cuda else "CPU: not run"
    except Exception as exc:  # any failure (missing, wrong build) just drops its rows
        xf = f"{type(exc).__name__}: {exc}"
    if xf != "ok":
        del backends["xformers"]
    heads, kv_heads, head_dim = (32, 8, 128) if cuda else (4, 2, 16)
    block_size, dtype = 16, torch.bfloat16 if cuda else torch.float32
    batches, contexts = ((1, 16, 64, 256), (512, 4096, 16384)) if cuda else ((1, 4), (32, 80))
    scale = head_dim**-0.5
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, --tiny)"
    print(f"{name}: copy {copy_bw / 1e9:.0f} GB/s; xformers: {xf}")
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    result = {"benchmark": "kernels", "device": name,
              "machine": workload.machine_info(device, "benchmarks.kernels"),
              "copy_bandwidth_gb_per_s": copy_bw / 1e9, "xformers": xf,
              "shape": shape | {"dtype": str(dtype).split(".")[1]}, "rows": [],
              "skipped": []}  # fmt: skip
    for span, batch, context in itertools.product(args.spans, batches, contexts):
        case = {"span": span, "batch": batch, "context": context}
        if batch * context > args.max_kv_tokens:
            result["skipped"].append({**case, "why": f"over --max-kv-tokens {args.max_kv_tokens}"})
            continue
        p = make_paged_problem(
            [span] * batch, [context] * batch, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, block_size=block_size, dtype=dtype, device=device,
            poison_unused=False,
        )  # fmt: skip
        exact = reference.paged_attention(*p.to(torch.float32).args(), scale)
        splits = triton_attention.plan_launch(
            batch * span, batch, heads // kv_heads, kv_heads,
            p.block_tables.shape[1] * block_size, p.query.device,
        ).num_splits  # fmt: skip
        for backend, fn in backends.items():
            if backend == "triton-1pass" and splits == 1:
                continue  # identical to "triton"
            row = {**case, "backend": backend, "kv_bytes": kv_bytes(p)}
            try:
                err = (fn(*p.args(), scale).float() - exact).abs().max()
                seconds = time_gpu(lambda fn=fn, p=p: fn(*p.args(), scale), args.iters, flush)
            except Exception as exc:  # a backend that cannot run a case gets a note
                result["rows"].append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            result["rows"].append(row | {"splits": splits if backend == "triton" else None,
                "median_us": seconds * 1e6, "gb_per_s": row["kv_bytes"] / seconds / 1e9,
                "of_copy_bw": row["kv_bytes"] / seconds / copy_bw,
                "rel_err_vs_fp32": float(err / exact.abs().max())})  # fmt: skip
            print(f"{case} {backend}: {seconds * 1e6:.0f} us", flush=True)
        del p, exact
        workload.release_memory(device)
        workload.save(result, args.output_dir, args.tag)
    return result


def run_cpu(args: argparse.Namespace) -> dict:
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
    parser.add_argument("--tiny", action="store_true", help="the GPU cases at toy sizes on CPU")
    parser.add_argument("--max-kv-tokens", type=int, default=1 << 20,
                        help="GPU cases: skip batch x context above this")  # fmt: skip
    parser.add_argument("--tag", default="kernels", help="output file name stem")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tiny or torch.cuda.is_available():
        run_gpu(args)
    else:
        workload.save(run_cpu(args), args.output_dir, args.tag)


if __name__ == "__main__":
    main()

"""Paged-attention kernel benchmark: Triton vs xFormers vs the PyTorch reference (gather + SDPA).

CUDA: decode (span 1) and verification (span 5) attention for batch {1, 8, 64, 256} x context
{512, 4096, 16384} (every sequence at that context), bf16, 32 query / 8 KV heads, head dim 128,
block size 16, shuffled block tables. Each backend is checked against the reference once, warmed
up, then timed with CUDA events, the L2 cache flushed before every call; the median is reported.
GB/s counts the K/V bytes the spans must read; "of copy" divides it by the device copy bandwidth
measured at the start (a 1 GiB device-to-device copy, read + write bytes). Where the automatic
split-KV path kicks in, a forced single-pass Triton row shows what it buys. Combinations that do
not fit in free memory are skipped.

CPU (no CUDA): the C++ kernel (backend "cpu", the CPU serving path) against the torch backend
(gather + SDPA), on the shape the engine serves there (SmolLM2-135M: 9 query / 3 KV heads, head
dim 64, block 16, fp32, batch 64, contexts uniform in 100..1000), per span length.

    python -m benchmarks.kernels --output-dir results/
"""

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kernels
from benchmarks import roofline
from kernels import reference
from kernels.testing import PagedProblem, make_paged_problem

GiB = 1 << 30


def kv_bytes(p: PagedProblem) -> int:
    """Bytes of K and V the attention must read: every cached position of every sequence once."""
    _, _, num_kv_heads, head_dim = p.k_cache.shape
    return int(p.seq_lens.sum()) * num_kv_heads * head_dim * 2 * p.k_cache.element_size()


def time_cuda(fn: Callable[[], object], iters: int, warmup: int, flush: torch.Tensor) -> float:
    """Median seconds per call, each call timed alone after overwriting the L2 cache."""
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
    return statistics.median(times)


def copy_bandwidth(flush: torch.Tensor) -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB tensor copy."""
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * GiB / time_cuda(lambda: dst.copy_(src), iters=10, warmup=3, flush=flush)


def cuda_backends(with_xformers: bool) -> dict[str, Callable[..., torch.Tensor]]:
    from kernels import triton_attention

    runs = {
        "triton": lambda *a: kernels.paged_attention(*a, backend="triton"),
        "triton-1pass": lambda *a: triton_attention.paged_attention(*a, num_splits=1),
        "torch": lambda *a: kernels.paged_attention(*a, backend="torch"),
    }
    if with_xformers:
        runs["xformers"] = lambda *a: kernels.paged_attention(*a, backend="xformers")
    return runs


def xformers_status() -> str | None:
    """None when xFormers' paged attention can be imported, else why not."""
    try:
        import xformers.ops  # noqa: F401
    except Exception as exc:  # any failure (missing, wrong build) just drops its rows
        return f"{type(exc).__name__}: {exc}"
    return None


def run_cuda(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """All CUDA cases; `save` gets the result so far after each case (a killed run keeps it)."""
    from kernels import triton_attention

    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_bw = copy_bandwidth(flush)
    xf = xformers_status()
    backends = cuda_backends(xf is None)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    scale = head_dim**-0.5
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    if xf is not None:
        print(f"xformers rows skipped: {xf}")
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    shape |= {"block_size": block_size, "dtype": "bfloat16"}
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_gb_per_s": copy_bw / 1e9,
        "xformers": xf or "ok",
        "shape": shape,
        "rows": [],
        "skipped": [],
    }
    rows, skipped = result["rows"], result["skipped"]
    for span in args.spans:
        for batch in args.batches:
            for context in args.contexts:
                case = {"span": span, "batch": batch, "context": context}
                blocks = batch * math.ceil(context / block_size) + 2
                cache_bytes = 2 * blocks * block_size * kv_heads * head_dim * 2
                # bf16 cache, its fp32 copy for the accuracy check, the reference's gathered
                # chunks (<= 1 GiB per tensor) and slack.
                if 3 * cache_bytes + 6 * GiB > torch.cuda.mem_get_info()[0]:
                    skipped.append({**case, "why": f"needs {cache_bytes / GiB:.1f} GiB"})
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
                        seconds = time_cuda(
                            lambda fn=fn, p=p: fn(*p.args(), scale), args.iters, 3, flush
                        )
                    except Exception as exc:  # a backend that cannot run a case gets a note
                        rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        continue
                    gbps = row["kv_bytes"] / seconds
                    rows.append(
                        {
                            **row,
                            "splits": splits if name == "triton" else None,
                            "median_us": seconds * 1e6,
                            "gb_per_s": gbps / 1e9,
                            "of_copy_bw": gbps / copy_bw,
                            "rel_err_vs_fp32": float(err / exact.abs().max()),
                        }
                    )
                del p, exact
                torch.cuda.empty_cache()
                done = [r for r in rows if r["span"] == span and r["batch"] == batch]
                times = ", ".join(
                    f"{r['backend']} {r['median_us']:.0f} us" if "median_us" in r else r["backend"]
                    for r in done
                    if r["context"] == context
                )
                print(f"span {span} batch {batch} context {context}: {times}", flush=True)
                save(result)
    return result


def _time_cpu(call: Callable[[], object], iters: int) -> tuple[float, float]:
    """(median, min) seconds of ``iters`` calls after 3 warm-up calls."""
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


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
            seconds, fastest = _time_cpu(
                lambda p=p, out=out, b=backend: kernels.paged_attention(
                    *p.args(), 0.125, out=out, backend=b
                ),
                args.iters,
            )
            rows.append(
                {
                    "span": span,
                    "batch": batch,
                    "context": "uniform 100..1000",
                    "backend": backend,
                    "median_us": seconds * 1e6,
                    "min_us": fastest * 1e6,
                    "gb_per_s": kv_bytes(p) / seconds / 1e9,
                    "ms_per_step_30_layers": seconds * layers * 1e3,
                }
            )
        rows[-1]["speedup_vs_torch"] = rows[-2]["median_us"] / rows[-1]["median_us"]
    shape = {"heads": 9, "kv_heads": 3, "head_dim": 64, "block_size": 16, "dtype": "float32"}
    return {
        "benchmark": "kernels",
        "device": "cpu",
        "machine": roofline.machine_info(torch.device("cpu"), "benchmarks.kernels"),
        "threads": torch.get_num_threads(),
        "shape": shape,
        "rows": rows,
    }


def print_table(result: dict) -> None:
    cols = ["span", "batch", "context", "backend", "splits", "median_us", "gb_per_s", "of_copy_bw",
            "speedup_vs_torch"]  # fmt: skip
    print(" ".join(f"{c:>12}" for c in cols))
    for row in result["rows"]:
        if "error" in row:
            print(" ".join(f"{row[c]!s:>12}" for c in cols[:4]), " error:", row["error"][:80])
            continue
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:>12.3f}" if isinstance(v, float) else f"{v!s:>12}")
        print(" ".join(cells))
    for row in result.get("skipped", []):
        where = f"span {row['span']} batch {row['batch']} context {row['context']}"
        print(f"skipped {where}: {row['why']}")


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("."))
    parser.add_argument("--batches", type=parse_ints, default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=parse_ints, default=[512, 4096, 16384])
    parser.add_argument("--spans", type=parse_ints, default=[1, 5])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / "kernels.json"

    def save(result: dict) -> None:
        path.write_text(json.dumps(result, indent=2))

    result = run_cuda(args, save) if torch.cuda.is_available() else run_cpu(args)
    save(result)
    print_table(result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

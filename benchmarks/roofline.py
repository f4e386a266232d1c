"""Device ceilings, measured on the spot: memory bandwidth and matmul rate, and from them the
decode roofline of a model.

Decode step of a batch of B sequences: every weight matrix is read once (weight_bytes) and each
token costs 2 FLOP per matmul parameter, so

    ceiling tokens/s = B / max(weight_bytes / bandwidth, 2 * num_params * B / flops)

``num_params`` counts the parameters a token multiplies through: every layer's matrices plus the
LM head (the vocabulary projection: with tied embeddings, the embedding matrix). The embedding
lookup itself reads B rows, not the table, so an untied embedding table is left out of both
terms. Attention over the KV cache is left out too (small next to the weights at the context
lengths benchmarked here), so the ceiling is an upper bound.

    python -m benchmarks.roofline [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from engine.model_loader import resolve_device, resolve_dtype


@dataclass(frozen=True)
class DeviceRates:
    bandwidth_gbs: float  # copy: bytes read + bytes written per second, 1e9
    matmul_gflops: float  # square GEMM in ``dtype``, 1e9 FLOP per second
    device: str
    dtype: str
    copy_bytes: int
    gemm_size: int


@dataclass(frozen=True)
class ModelCost:
    num_params: int  # parameters a decoded token multiplies through (layers + LM head)
    weight_bytes: int  # bytes of those parameters: what one decode step must read
    dtype: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one untimed call (the least-disturbed run: the
    ceiling is what the device can do, not what it did under load)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (counts the read and the write)."""
    if nbytes < 1 << 20:
        raise ValueError(f"nbytes must be >= 1 MiB for a meaningful copy, got {nbytes}")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds / 1e9


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n GEMM in ``dtype``."""
    if n < 64:
        raise ValueError(f"n must be >= 64 for a meaningful GEMM, got {n}")
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds / 1e9


def default_sizes(device: torch.device) -> tuple[int, int]:
    """(copy bytes, GEMM size) big enough to leave caches and launch overheads behind."""
    if device.type == "cuda":
        return 2 << 30, 8192
    return 256 << 20, 2048


def measure(
    device: torch.device, dtype: torch.dtype, copy_bytes: int | None = None, gemm: int | None = None
) -> DeviceRates:
    default_bytes, default_gemm = default_sizes(device)
    copy_bytes = copy_bytes or default_bytes
    gemm = gemm or default_gemm
    return DeviceRates(
        bandwidth_gbs=measure_bandwidth(device, copy_bytes),
        matmul_gflops=measure_matmul(device, dtype, gemm),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        copy_bytes=copy_bytes,
        gemm_size=gemm,
    )


def model_cost(model: nn.Module) -> ModelCost:
    """Matmul parameters and their bytes for one decode step of ``model`` (see the module doc)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and embed.weight is head.weight
    params, nbytes = 0, 0
    dtype = None
    for p in model.parameters():  # a tied weight appears once
        if embed is not None and p is embed.weight and not tied:
            continue
        params += p.numel()
        nbytes += p.numel() * p.element_size()
        dtype = dtype or p.dtype
    return ModelCost(params, nbytes, str(dtype).removeprefix("torch."))


def decode_ceiling(batch_size: int, cost: ModelCost, rates: DeviceRates) -> float:
    """Upper bound on decode tokens/s at ``batch_size``: the slower of reading the weights once
    and doing the batch's matmul FLOPs."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    read_s = cost.weight_bytes / (rates.bandwidth_gbs * 1e9)
    compute_s = 2 * cost.num_params * batch_size / (rates.matmul_gflops * 1e9)
    return batch_size / max(read_s, compute_s)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info(device: torch.device, module: str) -> dict:
    """What the numbers were measured on, and the command that measured them."""
    import transformers

    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", module, *sys.argv[1:]]),
    }
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    rates = measure(device, resolve_dtype(args.dtype, device))
    for key, value in asdict(rates).items():
        print(f"{key:>14}: {value}")


if __name__ == "__main__":
    main()

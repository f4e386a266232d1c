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
"""

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from benchmarks.timing import time_calls


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


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s (read + write bytes) of a device-to-device copy of ``nbytes``, the fastest of 5: the
    ceiling is what the device can do, not what it did under load."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / min(time_calls(lambda: dst.copy_(src), 5, device=device)) / 1e9


def measure(device: torch.device, dtype: torch.dtype) -> DeviceRates:
    """Copy bandwidth and GEMM rate at sizes that leave caches and launch overheads behind."""
    copy_bytes, n = (2 << 30, 8192) if device.type == "cuda" else (256 << 20, 2048)
    bandwidth = copy_bandwidth(device, copy_bytes)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    gflops = 2 * n**3 / min(time_calls(lambda: a @ b, 5, device=device)) / 1e9
    return DeviceRates(bandwidth, gflops, str(device), _name(dtype), copy_bytes, n)


def model_cost(config, dtype: torch.dtype) -> ModelCost:
    """Matmul parameters of ``config``'s model and their bytes in ``dtype`` for one decode step
    (see the module doc), counted on a weightless (meta) HF model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embed.weight is head.weight
    params = sum(p.numel() for p in model.parameters() if tied or p is not embed.weight)
    return ModelCost(params, params * dtype.itemsize, _name(dtype))


def decode_ceiling(batch_size: int, cost: ModelCost, rates: DeviceRates) -> float:
    """Upper bound on decode tokens/s at ``batch_size``: the slower of reading the weights once
    and doing the batch's matmul FLOPs."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    read_s = cost.weight_bytes / (rates.bandwidth_gbs * 1e9)
    compute_s = 2 * cost.num_params * batch_size / (rates.matmul_gflops * 1e9)
    return batch_size / max(read_s, compute_s)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

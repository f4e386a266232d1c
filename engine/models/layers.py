"""Building blocks shared by the Llama-family models: Linear, RMSNorm and rotary embeddings."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Rope types whose frequencies do not depend on the sequence length; "dynamic" and "longrope" do,
# which has no single meaning in a packed batch of sequences of different lengths.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# Row counts for which a CPU Linear splits its weight (see Linear); measured on the dev CPU.
_GEMV_MAX_ROWS = 6  # up to here: weight blocks times x^T (a batched GEMV)
_SPLIT_MAX_ROWS = 128  # up to here: x times transposed weight blocks; beyond: F.linear


class Linear(nn.Linear):
    """nn.Linear whose CPU products with few rows (decode, verification spans) use every core.

    MKL runs an fp32 product with a handful of rows on one core however many it has: on the
    2-core dev CPU it streams weights from DRAM at ~10 GB/s, where a plain read reaches ~28 GB/s.
    Viewing the weight's rows as P = gcd(out_features, threads) blocks and calling ``bmm`` gives
    each block its own thread. Measured over SmolLM2-135M's weights (python -m
    benchmarks.linear): 1-5 rows 1.6-3x faster, 8-128 rows 1.1-1.3x, from 256 rows on no gain.
    The result is the same product up to float summation order.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        parts = math.gcd(self.out_features, torch.get_num_threads())
        if x.device.type != "cpu" or rows > _SPLIT_MAX_ROWS or parts == 1:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        blocks = self.weight.view(parts, self.out_features // parts, self.in_features)
        if rows <= _GEMV_MAX_ROWS:  # [P, out / P, rows]
            out = torch.bmm(blocks, flat.t().expand(parts, -1, -1)).permute(2, 0, 1)
        else:  # [P, rows, out / P]
            out = torch.bmm(flat.expand(parts, -1, -1), blocks.transpose(1, 2)).transpose(0, 1)
        out = out.contiguous().view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly as HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_parameters(config: PretrainedConfig) -> dict:
    """The rope dict across transformers versions (5.x: rope_parameters; 4.x: rope_scaling)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary packed positions, computed on the fly (no max-length table).

    ``inv_freq`` stays float32 whatever the model dtype: build the model under a default dtype
    rather than casting it with ``.to(dtype)``.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        params = _rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
            inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
            scaling = 1.0
        elif rope_type in SUPPORTED_ROPE_TYPES:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=None)
        else:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions int64 [T] -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [T, H, D] with cos/sin [T, D] (HF's non-interleaved layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

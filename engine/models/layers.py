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


# Up to this many rows a CPU Linear runs as a row-split batched GEMV (see Linear).
_GEMV_MAX_ROWS = 2
# oneDNN packs a weight for an expected batch size; 64 measured as fast as any other hint for
# 3..2048 rows on the dev CPU.
_PACK_BATCH_HINT = 64
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


class Linear(nn.Linear):
    """nn.Linear with two CPU fast paths, chosen by the number of rows (tokens) in the product.

    - 1-2 rows (decode at batch 1-2): MKL runs such a product on one core however many there
      are; on the 2-core dev CPU it streams weights from DRAM at ~10 GB/s, where a plain read
      reaches ~28 GB/s. Viewing the weight's rows as P = gcd(out_features, threads) blocks and
      calling ``bmm`` gives each block its own thread: 2-3x faster.
    - 3+ rows (verification spans, batched decode, prefill): oneDNN with the weight packed into
      its blocked layout once (``prepack``): 1.2-1.7x MKL's sgemm from 3 to 2048 rows on
      SmolLM2-135M's shapes. Float32 only; it keeps a second copy of the weight.

    Both compute the same product up to float summation order (``python -m benchmarks.linear``
    measures them against ``F.linear``). Without ``prepack`` (or on CUDA) 3+ rows use F.linear.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed: torch.Tensor | None = None  # oneDNN copy of ``weight``, from prepack()
        self._packed_key: tuple[int, int] | None = None  # (data_ptr, version) it was made from

    def prepack(self) -> None:
        """Pack the current weight for oneDNN (CPU float32 weights on a oneDNN build; a no-op
        otherwise). Call after loading weights: a weight changed later is no longer served from
        the packed copy (forward checks its storage and version)."""
        weight = self.weight.detach()
        self.packed = self._packed_key = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and _HAS_ONEDNN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
            self._packed_key = (weight.data_ptr(), weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        parts = math.gcd(self.out_features, torch.get_num_threads())
        if rows <= _GEMV_MAX_ROWS and parts > 1:
            flat = x.reshape(rows, self.in_features)
            blocks = self.weight.view(parts, self.out_features // parts, self.in_features)
            out = torch.bmm(blocks, flat.t().expand(parts, -1, -1))  # [P, out / P, rows]
            out = out.permute(2, 0, 1).contiguous().view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        if self.packed is not None and self._packed_key == (
            self.weight.data_ptr(),
            self.weight._version,
        ):
            flat = x.reshape(rows, self.in_features)
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


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

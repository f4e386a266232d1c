"""Building blocks shared by the Llama-family models: RMSNorm, rotary embeddings and the SwiGLU
activation (Linear and Embedding: ``pagedspec.engine.models.linear``).

RMSNorm, rope and SwiGLU run as single fused C++ ops (kernels/csrc/cpu_layer_ops.cpp) on float32
or bfloat16 CPU inference tensors when the extension is available, and as the PyTorch formulas
otherwise (CUDA, other dtypes, autograd); both compute the same values up to float rounding.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedspec.engine.models.linear import Linear, fused_cpu
from pagedspec.engine.models.quant import quantized_weight
from pagedspec.kernels import cpu_extension

# Rope types whose frequencies do not depend on the sequence length; "dynamic" and "longrope" do,
# which has no single meaning in a packed batch of sequences of different lengths.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _layer_op_cpu(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the fused layer ops take these tensors: all float32 or all bf16 (``_fused_cpu``)."""
    return x.dtype in (torch.float32, torch.bfloat16) and fused_cpu(x, *others, dtype=x.dtype)


# Activation dtypes whose residual add and RMSNorm run as one in-place C++ op (add_rms_norm_).
_ADD_NORM_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly as HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with ``residual``: (norm(x + residual), x + residual), the decoder layer's
        residual add fused with the norm after it. The fused C++ op (float32 or bf16, the
        separate add's and norm's bits) writes both results in place, into x and residual
        (which must own their memory: fresh layer outputs)."""
        if residual is None:
            if _layer_op_cpu(x, self.weight):
                return cpu_extension.load().rms_norm(x, self.weight, self.eps)
            return self._norm(x)
        if (
            x.dtype in _ADD_NORM_DTYPES
            and fused_cpu(x, residual, self.weight, dtype=x.dtype)
            and x.shape == residual.shape
            and x.is_contiguous()
            and residual.is_contiguous()
        ):
            cpu_extension.load().add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
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
    rather than casting it with ``.to(dtype)``. Built on the meta device (as
    ``pagedspec.engine.loader.model_loader`` does), it is computed on the CPU, to be moved with the
    module.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        params = _rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        device = torch.get_default_device()
        with torch.device("cpu" if device.type == "meta" else device):
            if rope_type == "default":
                exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
                inv_freq, scaling = 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device=None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions int64 [T] -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [T, H, D] with cos/sin [T, D] (HF's non-interleaved layout)."""
    if _layer_op_cpu(x, cos, sin):
        return cpu_extension.load().rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate_up_proj: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up_proj(x) ([gate | up] fused projection): one C++ call that never
    writes the 2I-wide product where ``swiglu_fuses`` (and, for a float pack, x is of its dtype
    and needs no gradient); else the projection, then ``silu_and_mul``."""
    if swiglu_fuses(gate_up_proj):
        rows = x.numel() // gate_up_proj.in_features
        inter = gate_up_proj.out_features // 2
        flat = x.reshape(rows, gate_up_proj.in_features)
        ext = cpu_extension.load()
        quant = quantized_weight(gate_up_proj.weight)
        if quant is not None:
            return quant.silu_mul(flat, inter).view(*x.shape[:-1], inter)
        packed = gate_up_proj.packed
        if gate_up_proj._pack_is_current() and fused_cpu(x, dtype=packed.dtype):
            fp32 = packed.dtype == torch.float32
            kernel = ext.linear_silu_mul if fp32 else ext.linear_silu_mul_bf16
            return kernel(flat, packed, inter).view(*x.shape[:-1], inter)
    return silu_and_mul(gate_up_proj(x))


def swiglu_fuses(gate_up_proj: Linear) -> bool:
    """Whether the weight has a one-call SwiGLU kernel: quantised or packed, no bias, and I a
    multiple of the pack's panel width (quantised and float32: the SIMD width; bf16: 16). The
    decoder stack (``pagedspec.engine.models.layer_stack``) asks this too, so both paths agree."""
    if gate_up_proj.bias is not None:
        return False
    inter = gate_up_proj.out_features // 2
    quant = quantized_weight(gate_up_proj.weight)
    if quant is not None:
        return inter % quant.panel_width == 0
    packed = gate_up_proj.packed
    if packed is None:
        return False
    return inter % (packed.shape[-1] if packed.dtype == torch.float32 else 16) == 0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up for gate_up [..., 2I] = [gate | up] -> [..., I]."""
    if _layer_op_cpu(gate_up):
        return cpu_extension.load().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

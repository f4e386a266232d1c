"""Building blocks shared by the Llama-family models: Linear, RMSNorm, rotary embeddings and the
SwiGLU activation.

RMSNorm, rope and SwiGLU run as single fused C++ ops (kernels/csrc/cpu_layer_ops.cpp) on float32
CPU inference tensors when the extension is available, and as the PyTorch formulas otherwise
(CUDA, other dtypes, autograd); both compute the same values up to float rounding.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels import cpu_extension

# Rope types whose frequencies do not depend on the sequence length; "dynamic" and "longrope" do,
# which has no single meaning in a packed batch of sequences of different lengths.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# Up to this many rows a CPU Linear runs as a row-split batched GEMV (see Linear).
_GEMV_MAX_ROWS = 2


class Linear(nn.Linear):
    """nn.Linear with two CPU fast paths, chosen by the number of rows (tokens) in the product.

    - 1-2 rows (decode at batch 1-2): MKL runs such a product on one core however many there
      are; on the 2-core dev CPU it streams weights from DRAM at ~10 GB/s, where a plain read
      reaches ~28 GB/s. Viewing the weight's rows as P blocks (P: the largest divisor of
      out_features up to the thread count) and calling ``bmm`` gives each block its own thread:
      2-4x faster. With P = 1 (one thread, or no divisor) these rows take the next path.
    - 3+ rows (verification spans, batched decode, prefill): the C++ kernel of
      kernels/csrc/cpu_linear.cpp with the weight packed into its panel layout once
      (``prepack``): on SmolLM2-135M's shapes 1.15-1.3x oneDNN's packed GEMM from 16 to 64 rows,
      level with it at 2048, 2x MKL's sgemm. A row's result does not depend on how many rows
      share the call. Float32 inference only; it keeps a second copy of the weight.

    Both compute the same product up to float summation order (``python -m benchmarks.linear``
    measures them against ``F.linear``). Without a valid pack (or on CUDA) F.linear runs.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.packed: torch.Tensor | None = None  # packed copy of ``weight``, from prepack()
        # What the pack was made from: the weight Parameter, its storage and its version.
        self._packed_from: tuple[torch.Tensor, int, int | None] | None = None
        self._row_blocks: tuple[int, int] = (0, 1)  # (thread count, P) last computed

    def prepack(self) -> None:
        """Pack the current weight for the C++ kernel (CPU float32 weights where the extension
        builds; a no-op otherwise). Call after loading weights. Replacing the weight, moving or
        casting the module, or an in-place change that bumps the weight's version retires the
        pack; a write through ``weight.data`` or under inference mode does not: call prepack()
        again."""
        weight = self.weight
        self.packed = self._packed_from = None
        if _fused_cpu(weight.detach()):
            self.packed = cpu_extension.load().pack_linear_weight(weight.detach())
            self._packed_from = (weight, weight.data_ptr(), _version(weight))

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), .half(), ...
        self.packed = self._packed_from = None
        return super()._apply(fn, recurse)

    def _pack_is_current(self) -> bool:
        if self._packed_from is None:
            return False
        weight, (source, ptr, version) = self.weight, self._packed_from
        return (
            weight is source  # compared by identity: == on tensors is elementwise
            and weight.data_ptr() == ptr
            and _version(weight) == version
            and not (weight.requires_grad and torch.is_grad_enabled())  # the kernel: no autograd
        )

    def _blocks(self) -> int:
        threads = torch.get_num_threads()
        if self._row_blocks[0] != threads:
            parts = max(p for p in range(1, threads + 1) if self.out_features % p == 0)
            self._row_blocks = (threads, parts)
        return self._row_blocks[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        parts = self._blocks() if rows <= _GEMV_MAX_ROWS else 1
        if parts > 1:
            flat = x.reshape(rows, self.in_features)
            blocks = self.weight.view(parts, self.out_features // parts, self.in_features)
            out = torch.bmm(blocks, flat.t().expand(parts, -1, -1))  # [P, out / P, rows]
            out = out.permute(2, 0, 1).contiguous().view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        extra = () if self.bias is None else (self.bias,)
        if self._pack_is_current() and _fused_cpu(x, *extra):  # no autograd through the kernel
            flat = x.reshape(rows, self.in_features)
            out = cpu_extension.load().linear(flat, self.packed, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def _fused_cpu(*tensors: torch.Tensor) -> bool:
    """Whether the fused C++ ops take these tensors: float32 on the CPU, no autograd."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and cpu_extension.available()
    )


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter; None for inference tensors, which do not keep one."""
    return None if t.is_inference() else t._version


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly as HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_cpu(x, self.weight):
            return cpu_extension.load().rms_norm(x, self.weight, self.eps)
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
    if _fused_cpu(x, cos, sin):
        return cpu_extension.load().rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate_up_proj: Linear, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up_proj(x) ([gate | up] fused projection): one C++ call that never
    writes the 2I-wide product when the projection takes its packed path without a bias and I
    is a multiple of the SIMD width; else the projection, then ``silu_and_mul``."""
    rows = x.numel() // gate_up_proj.in_features
    inter = gate_up_proj.out_features // 2
    packed = gate_up_proj.packed
    if (
        rows > _GEMV_MAX_ROWS
        and gate_up_proj.bias is None
        and gate_up_proj._pack_is_current()  # (the weight needs no gradient)
        and inter % packed.shape[-1] == 0
        and _fused_cpu(x)
    ):
        flat = x.reshape(rows, gate_up_proj.in_features)
        out = cpu_extension.load().linear_silu_mul(flat, packed, inter)
        return out.view(*x.shape[:-1], inter)
    return silu_and_mul(gate_up_proj(x))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up for gate_up [..., 2I] = [gate | up] -> [..., I]."""
    if _fused_cpu(gate_up):
        return cpu_extension.load().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

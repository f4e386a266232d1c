"""Weight-only quantisation for the CPU: GGUF's Q8_0 numbers (here; run by
kernels/csrc/cpu_linear_q8.cpp) and Q4_1's (``pagedspec.engine.models.quant_q4``;
cpu_linear_q4.cpp), and a weight's packs for those kernels (``quantize_weight``,
``QuantizedWeight``).

Q8_0 quantises each weight row in blocks of 32 along K: d = max|w| / 127 and q = round(w / d)
(half away from zero), d kept as float16, w ≈ d * q. ``quantize_q8_0`` computes exactly what
gguf-py's and ggml's quantiser compute (tests compare the bits), so a Q8_0 GGUF tensor and our
quantisation of the same float weights agree, and quantising a Q8_0 tensor's dequantised values
gives its shipped q and d back. A quantised weight keeps one copy: the kernel's panel pack of q
(Q8_0: 1 byte a weight; Q4_1: half a byte) and its scales (float16: Q8_0's d, 1/16 byte a
weight; Q4_1's d and m, 1/8 byte); the Parameter's data becomes a 4-byte placeholder as with the
float32 pack (``pagedspec.engine.models.linear.pack_weight``). The kernels take float32 activations
and quantise them per block to int16 on the fly (cpu_linear_q8.cpp's file comment says why; an
error below 1/65534 of a block's largest value).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedspec.engine.models.quant_q4 import q4_rows, q4_unpacked, quantize_q4_1
from pagedspec.kernels import cpu_extension

Q8_BLOCK = 32
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> new tensor
# Rows quantised at a time (a multiple of every SIMD width): bounds the temporaries.
_ROWS_PER_PASS = 256


def torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q int8 [N, K], d float32 [N, ceil(K / 32)]), gguf's Q8_0 bit for bit
    (d is rounded through float16 as the file stores it). A last partial block (K not a
    multiple of 32, which GGUF cannot hold) is quantised as if padded with zeros."""
    rows, cols = weight.shape
    blocks = -(-cols // Q8_BLOCK)
    qs = torch.empty(rows, cols, dtype=torch.int8)
    ds = torch.empty(rows, blocks, dtype=torch.float32)
    for start in range(0, rows, _ROWS_PER_PASS):
        w = weight[start : start + _ROWS_PER_PASS].float()
        w = torch.nn.functional.pad(w, (0, blocks * Q8_BLOCK - cols)).view(-1, blocks, Q8_BLOCK)
        d = w.abs().amax(-1) / 127
        inv = torch.where(d == 0, 0.0, 1.0 / d)
        scaled = w * inv[..., None]
        # gguf's np_roundf: round half away from zero, exactly, in float32
        a = scaled.abs()
        whole = a.floor()
        q = torch.sign(scaled) * (whole + torch.floor(2 * (a - whole)))
        qs[start : start + len(w)] = q.view(len(w), -1)[:, :cols].to(torch.int8)
        ds[start : start + len(w)] = d.half().float()
    return qs, ds


def dequantize_q8_0(qs: torch.Tensor, ds: torch.Tensor) -> torch.Tensor:
    """(q int8 [N, K], d [N, ceil(K / 32)]) -> float32 [N, K] = d * q, as gguf-py computes it."""
    scale = ds.float().repeat_interleave(Q8_BLOCK, dim=1)[:, : qs.shape[1]]
    return qs.float() * scale


def q8_rows(q8: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows ``ids`` [T] of the dequantised [N, cols] weight, float32 [T, cols] (a tied
    embedding's lookup): row n's weights sit at [n // V, :, n % V, :] of the q pack (k in
    pairs), its scales at [n // V, :, n % V] of the d pack."""
    packed_q, packed_d = q8
    width = packed_q.shape[-2]
    panel, col = ids // width, ids % width
    qs = packed_q[panel, :, col].flatten(1)[:, :cols]
    return dequantize_q8_0(qs, packed_d[panel, :, col])


def q8_unpacked(q8: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The dequantised plain [N, K] float32 weight of ``shape`` (a new tensor)."""
    packed_q, packed_d = q8
    rows, cols = shape
    qs = packed_q.permute(0, 2, 1, 3).reshape(-1, 2 * packed_q.shape[1])[:rows, :cols]
    ds = packed_d.transpose(1, 2).reshape(-1, packed_d.shape[1])[:rows]
    return dequantize_q8_0(qs, ds)


@dataclass(frozen=True)
class _Format:
    """A GGUF block format's quantiser, packer and kernels (names in
    pagedspec.kernels.cpu_extension)."""

    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    pack: str
    linear: str
    silu_mul: str
    rows: Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor, int], torch.Tensor]
    unpacked: Callable[[tuple[torch.Tensor, torch.Tensor], tuple[int, int]], torch.Tensor]


FORMATS = {
    "q8_0": _Format(
        quantize_q8_0, "pack_q8_weight", "linear_q8", "linear_silu_mul_q8", q8_rows, q8_unpacked
    ),
    "q4_1": _Format(
        quantize_q4_1, "pack_q4_weight", "linear_q4", "linear_silu_mul_q4", q4_rows, q4_unpacked
    ),
}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight's kernel packs in GGUF block format ``format`` (FORMATS): the packed q [N / V,
    ..., V, 2] and scales, standing in for the Parameter's data while ``placeholder`` (the
    address of its placeholder data) is that data."""

    format: str
    q: torch.Tensor
    scales: torch.Tensor
    placeholder: int

    @property
    def panel_width(self) -> int:
        """V, the output columns of one panel."""
        return self.q.shape[-2]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """x [M, K] float32 @ weight^T + bias (the kernel checks x)."""
        kernel = getattr(cpu_extension.load(), FORMATS[self.format].linear)
        return kernel(x, self.q, self.scales, bias, out_features)

    def silu_mul(self, x: torch.Tensor, intermediate: int) -> torch.Tensor:
        """silu(gate) * up of x @ weight^T for a gate_up weight [2 * intermediate, K]."""
        kernel = getattr(cpu_extension.load(), FORMATS[self.format].silu_mul)
        return kernel(x, self.q, self.scales, intermediate)

    def rows(self, ids: torch.Tensor, cols: int) -> torch.Tensor:
        """Rows ``ids`` [T] of the dequantised weight, float32 [T, cols]."""
        return FORMATS[self.format].rows((self.q, self.scales), ids, cols)

    def unpacked(self, shape: tuple[int, int]) -> torch.Tensor:
        """The dequantised plain float32 weight of ``shape`` (a new tensor)."""
        return FORMATS[self.format].unpacked((self.q, self.scales), shape)


def quantize_weight(weight: nn.Parameter, fmt: str = "q8_0", empty: Empty = torch_empty) -> None:
    """Replace a CPU weight [N, K]'s data by its packed quantisation in ``fmt`` (FORMATS), in
    place.

    Rows are quantised and packed _ROWS_PER_PASS at a time straight into the pack, so the
    only memory beside the float weight is the pack itself and one pass's temporaries. As
    ``pack_weight``: the Parameter stays, its data becomes a NaN placeholder, and the pack
    (``weight.quantized``, a QuantizedWeight) counts only while the placeholder is the
    Parameter's data. ``empty(shape, dtype)`` allocates the packs (the loader's WeightArena).
    """
    spec = FORMATS[fmt]
    pack = getattr(cpu_extension.load(), spec.pack)
    rows = weight.shape[0]
    packs: tuple[torch.Tensor, torch.Tensor] | None = None
    for start in range(0, rows, _ROWS_PER_PASS):
        part_q, part_s = pack(*spec.quantize(weight.detach()[start : start + _ROWS_PER_PASS]))
        width = part_q.shape[-2]  # the SIMD width V (panel columns) is the kernel's choice
        if packs is None:
            panels = -(-rows // width)
            packs = (
                empty((panels, *part_q.shape[1:]), part_q.dtype),
                empty((panels, *part_s.shape[1:]), part_s.dtype),
            )
        first = start // width
        packs[0][first : first + len(part_q)] = part_q
        packs[1][first : first + len(part_s)] = part_s
    weight.data = torch.full((1, 1), float("nan")).expand(weight.shape)
    weight.quantized = QuantizedWeight(fmt, *packs, weight.data_ptr())


def quantized_weight(weight: torch.Tensor) -> QuantizedWeight | None:
    """The packs standing in for ``weight``'s data; None if it is not quantised."""
    packs = getattr(weight, "quantized", None)
    if packs is None or weight.data_ptr() != packs.placeholder:
        return None
    return packs

"""Weight-only int8 for the CPU: GGUF's Q8_0 numbers, run by kernels/csrc/cpu_linear_q8.cpp.

Q8_0 quantises each weight row in blocks of 32 along K: d = max|w| / 127 and q = round(w / d)
(half away from zero), d kept as float16, w ≈ d * q. ``quantize_q8_0`` computes exactly what
gguf-py's and ggml's quantiser compute (tests compare the bits), so a Q8_0 GGUF tensor and our
quantisation of the same float weights agree, and quantising a Q8_0 tensor's dequantised values
gives its shipped q and d back. A quantised weight keeps one copy: the kernel's panel pack of q
(1 byte a weight) and d (float16, 1/16 byte a weight); the Parameter's data becomes a 4-byte
placeholder as with the float32 pack (``engine.models.layers.pack_weight``). The kernel takes
float32 activations and quantises them per block to int16 on the fly (its file comment says
why; an error below 1/65534 of a block's largest value).
"""

import torch
from torch import nn

from kernels import cpu_extension

Q8_BLOCK = 32
# Rows quantised at a time (a multiple of every SIMD width): bounds the temporaries.
_ROWS_PER_PASS = 256


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


def quantize_weight(
    weight: nn.Parameter, q8: tuple[torch.Tensor, torch.Tensor] | None = None
) -> None:
    """Replace a CPU weight [N, K]'s data by its packed Q8_0 (``q8``: its (q, d) when already
    quantised; else quantised from the weight), in place.

    Rows are quantised and packed _ROWS_PER_PASS at a time straight into the pack, so the
    only memory beside the float weight is the pack itself (a quarter of it) and one pass's
    temporaries. As ``pack_weight``: the Parameter stays, its data becomes a NaN placeholder,
    and the pack (``weight.q8``: packed q, packed d and the placeholder's address) counts only
    while the placeholder is the Parameter's data.
    """
    pack = cpu_extension.load().pack_q8_weight
    rows = weight.shape[0]
    packs: tuple[torch.Tensor, torch.Tensor] | None = None
    for start in range(0, rows, _ROWS_PER_PASS):
        stop = min(rows, start + _ROWS_PER_PASS)
        if q8 is None:
            part = quantize_q8_0(weight.detach()[start:stop])
        else:
            part = q8[0][start:stop], q8[1][start:stop].float()
        part_q, part_d = pack(*part)
        if packs is None:  # the SIMD width V (panel columns) is the kernel's choice
            panels = -(-rows // panel_width(part_q))
            packs = (
                torch.empty(panels, *part_q.shape[1:], dtype=torch.int8),
                torch.empty(panels, *part_d.shape[1:], dtype=torch.float16),
            )
        first = start // panel_width(part_q)
        packs[0][first : first + len(part_q)] = part_q
        packs[1][first : first + len(part_d)] = part_d
    weight.data = torch.full((1, 1), float("nan")).expand(weight.shape)
    weight.q8 = (*packs, weight.data_ptr())


def q8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (packed q, packed d) standing in for ``weight``'s data; None if it is not int8."""
    packed_q, packed_d, placeholder = getattr(weight, "q8", (None, None, None))
    if packed_q is None or weight.data_ptr() != placeholder:
        return None
    return packed_q, packed_d


def panel_width(packed_q: torch.Tensor) -> int:
    """V, the output columns of one panel of a q pack [N / V, Kp / 2, V, 2]."""
    return packed_q.shape[-2]


def q8_rows(q8: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows ``ids`` [T] of the dequantised [N, cols] weight, float32 [T, cols] (a tied
    embedding's lookup): row n's weights sit at [n // V, :, n % V, :] of the q pack (k in
    pairs), its scales at [n // V, :, n % V] of the d pack."""
    packed_q, packed_d = q8
    width = panel_width(packed_q)
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

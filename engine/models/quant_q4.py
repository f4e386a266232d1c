"""GGUF Q4_1's numbers, run as shipped by kernels/csrc/cpu_linear_q4.cpp.

Q4_1 quantises each weight row in blocks of 32 along K: m = min(w), d = (max(w) - m) / 15,
q = trunc((w - m) / d + 0.5) in [0, 15], d and m kept as float16, w ≈ d * q + m.
``quantize_q4_1`` computes exactly what gguf-py's (and ggml's reference) quantiser computes
(tests compare the bits). Every block it makes holds a q = 0 (its minimum) and a q = 15 (its
maximum), so quantising a Q4_1 tensor's dequantised values gives the shipped q, d and m back:
a Q4_1 GGUF converted to float32 (the default model's cache) runs the file's own numbers (tests
check that on every Linear of the default model).
"""

import torch

Q4_BLOCK = 32
# Rows quantised at a time: bounds the temporaries.
_ROWS_PER_PASS = 256


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q uint8 [N, K] in [0, 15], d float32 [N, ceil(K / 32)], m float32
    [N, ceil(K / 32)]), gguf's Q4_1 bit for bit (d and m rounded through float16 as the file
    stores them; q computed with the float32 d as gguf does). A last partial block (K not a
    multiple of 32, which GGUF cannot hold) is quantised as if padded with zeros."""
    rows, cols = weight.shape
    blocks = -(-cols // Q4_BLOCK)
    qs = torch.empty(rows, cols, dtype=torch.uint8)
    ds = torch.empty(rows, blocks, dtype=torch.float32)
    ms = torch.empty(rows, blocks, dtype=torch.float32)
    for start in range(0, rows, _ROWS_PER_PASS):
        w = weight[start : start + _ROWS_PER_PASS].float()
        w = torch.nn.functional.pad(w, (0, blocks * Q4_BLOCK - cols)).view(-1, blocks, Q4_BLOCK)
        low, high = w.amin(-1), w.amax(-1)
        d = (high - low) / 15
        inv = torch.where(d == 0, 0.0, 1.0 / d)
        q = ((w - low[..., None]) * inv[..., None] + 0.5).trunc().clamp(0, 15)
        qs[start : start + len(w)] = q.view(len(w), -1)[:, :cols].to(torch.uint8)
        ds[start : start + len(w)] = d.half().float()
        ms[start : start + len(w)] = low.half().float()
    return qs, ds, ms


def dequantize_q4_1(qs: torch.Tensor, ds: torch.Tensor, ms: torch.Tensor) -> torch.Tensor:
    """(q [N, K], d, m [N, ceil(K / 32)]) -> float32 [N, K] = d * q + m, as gguf-py computes
    it (a product, then a sum: no fused multiply-add)."""
    cols = qs.shape[1]
    scale = ds.float().repeat_interleave(Q4_BLOCK, dim=1)[:, :cols]
    low = ms.float().repeat_interleave(Q4_BLOCK, dim=1)[:, :cols]
    return qs.float() * scale + low


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed q bytes [..., Kp / 4, 2] -> q [..., Kp]: byte (u, e) holds q[4u + e] in its low
    nibble and q[4u + 2 + e] in its high one (cpu_linear_q4.cpp's pack)."""
    both = torch.stack((packed & 0x0F, packed >> 4), dim=-2)  # [..., Kp / 4, 2 (nibble), 2]
    return both.flatten(-3)


def q4_rows(packs: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows ``ids`` [T] of the dequantised [N, cols] weight, float32 [T, cols] (a tied
    embedding's lookup): row n's bytes sit at [n // V, :, n % V, :] of the q pack, its d and m
    at [n // V, :, :, n % V] of the dm pack."""
    packed_q, packed_dm = packs
    width = packed_q.shape[-2]
    panel, col = ids // width, ids % width
    qs = nibbles(packed_q[panel, :, col])[:, :cols]
    dm = packed_dm[panel, :, :, col]  # [T, nb, 2]
    return dequantize_q4_1(qs, dm[..., 0], dm[..., 1])


def q4_unpacked(packs: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The dequantised plain [N, K] float32 weight of ``shape`` (a new tensor)."""
    packed_q, packed_dm = packs
    rows, cols = shape
    qs = nibbles(packed_q.transpose(1, 2)).flatten(0, 1)[:rows, :cols]
    dm = packed_dm.permute(0, 3, 1, 2).flatten(0, 1)[:rows]  # [N, nb, 2]
    return dequantize_q4_1(qs, dm[..., 0], dm[..., 1])

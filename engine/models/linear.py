"""Linear and Embedding over weights packed once at load time for the C++ CPU kernels (or
quantised to GGUF blocks), with the PyTorch paths where those do not apply; the packing,
copying and saving of such weights."""

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pagedspec.engine.models.quant import Empty, quantize_weight, quantized_weight, torch_empty
from pagedspec.kernels import cpu_extension

# Up to this many rows a CPU Linear with a plain weight runs as a row-split batched GEMV.
_GEMV_MAX_ROWS = 2


class _PackedWeight:
    """A module whose ``weight`` may be packed or quantised: moving it (``.to()``, ``.half()``,
    ...) gives the weight its plain data back first, a deep copy copies the pack, and a state
    dict holds the plain weight."""

    def _apply(self, fn, recurse: bool = True):
        unpack_weight(self.weight)
        return super()._apply(fn, recurse)

    def __deepcopy__(self, memo: dict):
        return _deepcopy_packed(self, memo)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _save_plain(self.weight, destination, prefix + "weight")


class Linear(_PackedWeight, nn.Linear):
    """nn.Linear whose CPU float32 or bf16 weight is packed once for a C++ GEMM, keeping no plain
    copy.

    - Packed (``prepack``; CPU, float32, no gradient, the extension builds): every product runs
      the C++ kernel of kernels/csrc/cpu_linear.cpp on the weight in its panel layout: on
      SmolLM2-135M's shapes 1.15-1.3x oneDNN's packed GEMM from 16 to 64 rows, level with it at
      2048, 2x MKL's sgemm, and at 1-2 rows as fast as the row-split GEMV below. A row's result
      does not depend on how many rows share the call. The pack is the only copy of the
      weight: see ``pack_weight`` for what ``weight`` then holds.
    - Plain float32 CPU weight (no extension, or a weight that needs gradients): 1-2 rows view
      the weight's rows as P blocks (P: the largest divisor of out_features up to the thread
      count) and call ``bmm``, giving each block its own thread (MKL runs such a product on one
      core: 2-4x slower on the 2-core dev CPU); otherwise F.linear.
    - GGUF Q8_0 or Q4_1 (``quantize``, ``quantization="int8"`` / ``"q4_1"``): the C++ kernel of
      kernels/csrc/cpu_linear_q8.cpp / cpu_linear_q4.cpp on the weight's pack
      (``pagedspec.engine.models.quant``), float32 activations quantised per block to int16 inside
      it; as with the float32 pack, no float copy is kept.
    - Packed bf16 (``prepack`` of a CPU bfloat16 weight): kernels/csrc/cpu_linear_bf16.cpp,
      float32 sums of the bf16 pack (AVX512-BF16 where the CPU has it) at every row count: on
      SmolLM2-135M's shapes 2.2-2.6x oneDNN's F.linear at 1-2 rows (1.6-1.7x the fp32 kernel:
      half the bytes at ~0.85x its bandwidth), 1.5-2x at 4-32 rows, level from 256 to 512,
      and level with oneDNN's prepacked bf16 GEMM from 4 rows on (which would need a second
      copy of the weight; contended 2-core runs).
    - Any other weight (fp16, CUDA; bf16 without the extension): F.linear. (For bf16 at 1-2
      rows oneDNN's F.linear is 1.5x the row-split ``bmm``, which ATen runs at a third of the
      bandwidth.)

    All compute the same product up to float summation order (``python -m benchmarks.linear``
    measures them against ``F.linear``).
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
        self._row_blocks: tuple[int, int] = (0, 1)  # (thread count, P) last computed

    def reset_parameters(self) -> None:
        # On the meta device (pagedspec.engine.loader.model_loader builds there) there is nothing to
        # initialise, and initialising there would import torch._dynamo (~100 MB resident).
        if not self.weight.is_meta:
            super().reset_parameters()

    @property
    def packed(self) -> torch.Tensor | None:
        """The packed weight the C++ kernel reads, None while the weight is plain."""
        return packed_weight(self.weight)

    def prepack(self) -> None:
        """Pack the weight for the C++ kernel and drop its plain data (CPU float32 or bf16
        weights that need no gradient, where the extension builds; a no-op otherwise). Call
        after loading weights; ``unpack`` undoes it, and so does moving or casting the module."""
        weight = self.weight
        if (
            packed_weight(weight) is None
            and not weight.requires_grad
            and weight.dtype in (torch.float32, torch.bfloat16)  # before the extension loads
            and fused_cpu(weight, dtype=weight.dtype)
        ):
            pack_weight(weight)

    def quantize(self, fmt: str = "q8_0", empty: Empty = torch_empty) -> None:
        """Quantise the weight to GGUF block format ``fmt`` ("q8_0" or "q4_1",
        ``pagedspec.engine.models.quant``) for the C++ kernel and drop its float data, as
        ``prepack`` does (float32 activations; CPU only), its packs allocated by ``empty``. A no-op
        for a weight already quantised."""
        if quantized_weight(self.weight) is None:
            quantize_weight(self.weight, fmt, empty)

    def unpack(self) -> None:
        """Give the weight its plain data back (a no-op for a plain weight; a quantised weight
        comes back dequantised)."""
        unpack_weight(self.weight)

    def _pack_is_current(self) -> bool:
        """Whether the C++ kernel may run: a pack, and no gradient wanted for the weight."""
        return self.packed is not None and not (
            self.weight.requires_grad and torch.is_grad_enabled()
        )

    def _blocks(self) -> int:
        threads = torch.get_num_threads()
        if self._row_blocks[0] != threads:
            parts = max(p for p in range(1, threads + 1) if self.out_features % p == 0)
            self._row_blocks = (threads, parts)
        return self._row_blocks[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias  # (each module attribute read costs ~0.5 us)
        quant = quantized_weight(weight)
        if quant is not None:  # Q8_0 / Q4_1: the kernel only (it checks x is float32 on the CPU)
            out = quant.linear(x.reshape(-1, self.in_features), bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        packed = packed_weight(weight)
        if packed is not None:
            no_grad = not (weight.requires_grad and torch.is_grad_enabled())
            extra = () if bias is None else (bias,)
            if no_grad and fused_cpu(x, *extra, dtype=packed.dtype):  # the kernel: no autograd
                ext = cpu_extension.load()
                kernel = ext.linear if packed.dtype is torch.float32 else ext.linear_bf16
                if x.dim() == 2:  # a decode step's rows: no reshapes around the call
                    return kernel(x, packed, bias, self.out_features)
                flat = x.reshape(-1, self.in_features)
                out = kernel(flat, packed, bias, self.out_features)
                return out.view(*x.shape[:-1], self.out_features)
            # autograd through x or the bias, or another dtype: the plain product, unpacked
            return F.linear(x, unpacked(packed, weight.shape), bias)
        if x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        parts = self._blocks() if rows <= _GEMV_MAX_ROWS else 1
        if parts > 1:
            flat = x.reshape(rows, self.in_features)
            blocks = self.weight.view(parts, self.out_features // parts, self.in_features)
            out = torch.bmm(blocks, flat.t().expand(parts, -1, -1))  # [P, out / P, rows]
            out = out.permute(2, 0, 1).contiguous().view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class Embedding(_PackedWeight, nn.Embedding):
    """nn.Embedding that also looks rows up in a packed weight: a tied LM head's ``prepack``
    packs the shared Parameter, and the table then has no plain copy (for SmolLM2-135M that
    saves 113 MB, a fifth of its weights). Row n's k-th value sits at [n // V, k, n % V] of the
    pack, so a token's row is ``embedding_dim`` strided reads, one cache line each (36 KB at
    SmolLM2's width; a decode step of 32 tokens reads 1 MB of the 513 MB a step streams)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # as Linear.reset_parameters
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        packed, quant = packed_weight(self.weight), quantized_weight(self.weight)
        if packed is None and quant is None:
            return super().forward(input_ids)
        ids = input_ids.reshape(-1)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.num_embeddings:
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        if quant is not None:  # a tied quantised LM head: its rows, dequantised
            return quant.rows(ids, self.embedding_dim).view(*input_ids.shape, self.embedding_dim)
        if packed.dim() == 3:  # float32 [N / V, K, V]
            width = packed.shape[-1]
            rows = packed[ids // width, :, ids % width]
        else:  # bf16 [N / 16, K / 2, 16, 2]: row n is [n // 16, :, n % 16, :], k in pairs
            width = packed.shape[-2]
            rows = packed[ids // width, :, ids % width].flatten(1)[:, : self.embedding_dim]
        return rows.reshape(*input_ids.shape, self.embedding_dim)


def pack_weight(weight: nn.Parameter) -> None:
    """Replace a float32 or bf16 CPU weight [N, K]'s data by its pack for the C++ GEMM, in
    place (bf16: ``pack_linear_weight_bf16_``, in place when N is a multiple of 16 and K even).

    The pack takes over the weight's memory where its rows fill whole panels (out_features a
    multiple of the SIMD width), so packing needs no second copy of it even for a moment; any
    other view of that memory then sees the packed layout. The Parameter object stays (ties,
    ``named_parameters``, shape/dtype/device queries keep working) but its data becomes a
    placeholder: one NaN broadcast to [N, K], 4 bytes.
    Reading it gives NaN, writing into it raises. The pack is kept on the Parameter (``pack``:
    the pack and the placeholder's address) and counts only while the placeholder is the
    Parameter's data (``weight.data = ...`` or a new Parameter retires it).
    """
    ext = cpu_extension.load()
    packer = (
        ext.pack_linear_weight_bf16_ if weight.dtype == torch.bfloat16 else ext.pack_linear_weight_
    )
    pack = packer(weight.detach())
    weight.data = placeholder(weight)
    weight.pack = (pack, weight.data_ptr())


def packs_in_place(shape: torch.Size) -> bool:
    """Whether ``pack_weight`` packs a float32 or bf16 weight of ``shape`` [N, K] in its own
    memory at every SIMD width: N a multiple of 16 (float32 panels are 8 or 16 wide, bf16's 16)
    and K even (bf16 pairs). Other weights' packs are new memory."""
    return shape[0] % 16 == 0 and shape[1] % 2 == 0


def placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A packed weight's data: one NaN of its dtype broadcast to its shape (4 bytes)."""
    return torch.full((1, 1), float("nan"), dtype=weight.dtype).expand(weight.shape)


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The pack standing in for ``weight``'s data, or None while the weight is plain."""
    pack, address = getattr(weight, "pack", (None, None))
    return pack if pack is not None and weight.data_ptr() == address else None


def unpack_weight(weight: torch.Tensor) -> None:
    """Undo ``pack_weight``: the plain data back in the Parameter, the pack dropped."""
    pack, quant = packed_weight(weight), quantized_weight(weight)
    if pack is not None:
        weight.data = unpacked(pack, weight.shape)
    elif quant is not None:
        weight.data = quant.unpacked(weight.shape)
    weight.__dict__.pop("pack", None)
    weight.__dict__.pop("quantized", None)


def unpacked(pack: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """The plain [N, K] weight of a pack (a new tensor): float32 [ceil(N / V), K, V], or bf16
    [ceil(N / 16), ceil(K / 2), 16, 2]."""
    rows, cols = shape
    if pack.dim() == 3:
        return pack.transpose(1, 2).reshape(-1, cols)[:rows]
    return pack.permute(0, 2, 1, 3).reshape(-1, 2 * pack.shape[1])[:rows, :cols].contiguous()


def _deepcopy_packed(module: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy`` of a Linear or Embedding whose weight may be packed or quantised: the
    copy's weight gets a placeholder and a copy of the pack of its own. (A pack counts only
    while its placeholder, by address, is the Parameter's data; ``Parameter.__deepcopy__``
    clones the data to a new address and drops the pack, so a packed model's copy computed
    from NaN placeholders.) A tied weight is fixed once, by whichever module copies it first."""
    weight = module.weight
    fixed = id(weight) in memo  # copied (and so fixed) already, through a tied module
    new = module.__class__.__new__(module.__class__)
    memo[id(module)] = new
    new.__dict__.update(copy.deepcopy(module.__dict__, memo))
    pack, quant = packed_weight(weight), quantized_weight(weight)
    if fixed or (pack is None and quant is None):
        return new
    copied = new.weight
    copied.data = placeholder(weight)
    # clones, not deepcopies: a pack is a view of the loader's one arena for all of them
    # (pagedspec.engine.models.huge_pages), whose whole storage a deepcopy would copy
    if pack is not None:
        copied.pack = (pack.clone(), copied.data_ptr())
    else:
        copied.quantized = dataclasses.replace(
            quant, q=quant.q.clone(), scales=quant.scales.clone(), placeholder=copied.data_ptr()
        )
    return new


def _save_plain(weight: torch.Tensor, destination: dict, key: str) -> None:
    """state_dict() holds the plain weight, not the placeholder."""
    pack, quant = packed_weight(weight), quantized_weight(weight)
    if pack is not None and key in destination:
        destination[key] = unpacked(pack, weight.shape)
    elif quant is not None and key in destination:
        destination[key] = quant.unpacked(weight.shape)


def fused_cpu(*tensors: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the fused C++ ops take these tensors: ``dtype`` on the CPU, no autograd. (Called
    several times per layer and step: ``is_cpu`` and ``is`` cost a third of ``device.type ==``.)"""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype is not dtype:
            return False
    return cpu_extension.available()


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter; None for inference tensors, which do not keep one."""
    return None if t.is_inference() else t._version

"""The CPU fast path of ``LlamaModel.forward``: every decoder layer in one C++ call
(kernels/csrc/cpu_layer_stack.cpp), the graph run in C++ as llama.cpp runs it.

At a batch-1 decode of SmolLM2-135M the Python around the kernels (30 layers of module calls,
attribute reads, views and Linear's dispatch) cost ~4 ms of a ~12 ms step. The stack calls the
same kernels on the same arguments in the same order, so its results are the Python loop's
bits. It runs only where the Python loop would run exactly those kernels:

- CPU activations of float32 or bf16, no autograd (grad mode off), the extension builds;
- every layer a ``LlamaDecoderLayer`` (qwen3's q/k norm included) on one device (no tensor
  parallelism: the model then has no stack);
- every Linear of the layers packed for the activations' dtype (float32 or bf16) or quantised
  (int8, q4_1); the norms and biases of the activations' dtype;
- the step's attention backend resolves to "cpu".

Built on first use, it holds the weights' Parameters themselves: the C++ side checks on every
call that each pack is still its weight's data (``unpack``, ``.to()`` or ``weight.data = ...``
retire a pack), and a stale stack is rebuilt. A refusal is remembered until the first and
last layer's weights change (as packing or quantising all of them does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedspec.engine.models.attention import AttentionMetadata, plan_step
from pagedspec.engine.models.layers import RMSNorm, swiglu_fuses
from pagedspec.engine.models.linear import Linear, packed_weight
from pagedspec.engine.models.quant import quantized_weight
from pagedspec.kernels import cpu_attention, cpu_extension

# StackLinear kinds (cpu_kernels.h): the kernel Linear.forward picks for the weight.
_FLOAT32, _BFLOAT16 = 0, 1
_QUANTIZED = {"q8_0": 2, "q4_1": 3}  # QuantizedWeight.format -> kind


class LayerStack:
    """One model's C++ decoder stack: built, checked and rebuilt here."""

    def __init__(self) -> None:
        self._stack: object | None = None  # the extension's DecoderStack
        self._dtype: torch.dtype | None = None  # the activations' dtype it was built for
        self._refused: tuple[int, int] | None = None  # the weights' signature when refused

    def __getstate__(self) -> dict:  # a pickled or copied model builds its own stack
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def run(
        self,
        layers: Sequence[nn.Module],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        capture: tuple[int, ...] = (),
    ) -> list[torch.Tensor] | None:
        """The layers' (h, residual) as the Python loop returns them, h written in place as
        the loop does, then the hidden state after each layer in ``capture`` (ascending); None
        where the stack does not apply (nothing has run then)."""
        if torch.is_grad_enabled() or not h.is_cpu or h.dim() != 2:
            return None
        stack = self._current(layers, h.dtype)
        if stack is None:
            return None
        if not meta.planned:
            attn = layers[0].self_attn
            query = h.new_empty((h.shape[0], attn.num_heads, attn.head_dim))
            plan_step(meta, query, kv_caches[0][0])
        plan, write = meta.plan, meta.write_plan
        if not isinstance(plan, cpu_attention.AttentionPlan) or not isinstance(
            write, cpu_attention.WritePlan
        ):
            return None
        args = (write.slot_mapping, plan.block_tables, plan.cu_query_lens, plan.seq_lens)
        out = stack.forward(h, cos, sin, kv_caches, *args, list(capture), plan.tree_mask)
        # [] only if a pack went stale since _current (nothing ran): the Python loop, this once
        return out or None

    def _current(self, layers: Sequence[nn.Module], dtype: torch.dtype) -> object | None:
        """The stack for ``dtype`` activations with every pack current: the one built before,
        else a new one; None while the layers are refused."""
        if self._stack is not None and self._dtype is dtype and self._stack.current():
            return self._stack
        signature = _signature(layers)
        if self._stack is None and self._dtype is dtype and signature == self._refused:
            return None
        self._stack, self._dtype = build_stack(layers, dtype), dtype
        self._refused = signature if self._stack is None else None
        return self._stack


def _signature(layers: Sequence[nn.Module]) -> tuple[int, int]:
    return (
        layers[0].self_attn.qkv_proj.weight.data_ptr(),
        layers[-1].mlp.down_proj.weight.data_ptr(),
    )


def build_stack(layers: Sequence[nn.Module], dtype: torch.dtype) -> object | None:
    """The extension's DecoderStack over ``layers`` for activations of ``dtype``, or None
    where it would not compute what the Python layers compute (see the module docstring)."""
    if not layers or dtype not in (torch.float32, torch.bfloat16):
        return None
    if not cpu_extension.available():
        return None
    ext = cpu_extension.load()
    stacked = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        head_norms = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
        if not all(_norm_ok(n, dtype) for n in (*norms, *head_norms) if n is not None):
            return None
        linears = [
            _stack_linear(ext, lin, dtype)
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if any(lin is None for lin in linears):
            return None
        stacked.append(
            ext.StackLayer(
                norms[0].weight,
                norms[0].eps,
                norms[1].weight,
                norms[1].eps,
                *_weight_eps(head_norms[0]),
                *_weight_eps(head_norms[1]),
                *linears,
                fused_mlp=swiglu_fuses(mlp.gate_up_proj),
            )
        )
    attn = layers[0].self_attn
    return ext.DecoderStack(
        stacked, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale
    )


def _weight_eps(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float]:
    return (None, 0.0) if norm is None else (norm.weight, norm.eps)


def _norm_ok(norm: RMSNorm, dtype: torch.dtype) -> bool:
    return type(norm) is RMSNorm and norm.weight.is_cpu and norm.weight.dtype is dtype


def _stack_linear(ext, linear: Linear, dtype: torch.dtype) -> object | None:
    """The StackLinear running ``linear`` as Linear.forward does for ``dtype`` inputs."""
    weight, bias = linear.weight, linear.bias
    if type(linear) is not Linear or (bias is not None and bias.dtype is not dtype):
        return None
    quant = quantized_weight(weight)
    if quant is not None:  # (Linear.forward runs its kernel on any x; the kernel checks it)
        kind = _QUANTIZED[quant.format]
        return ext.StackLinear(
            kind, weight, weight.data_ptr(), quant.q, quant.scales, bias, linear.out_features
        )
    packed = packed_weight(weight)
    if packed is None or packed.dtype is not dtype:
        return None
    kind = _FLOAT32 if dtype is torch.float32 else _BFLOAT16
    return ext.StackLinear(kind, weight, weight.data_ptr(), packed, None, bias, linear.out_features)

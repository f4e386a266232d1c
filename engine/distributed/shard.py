"""Which part of each weight one tensor-parallel rank holds.

Attention heads, MLP columns and vocabulary rows are split into ``size`` equal contiguous
parts; rank r holds part r. KV heads are split the same way when ``size`` divides them; when
``size`` is a multiple of them (more ranks than KV heads, e.g. MQA), each KV head is replicated
on ``size / num_kv_heads`` consecutive ranks, as vLLM does, so every rank holds exactly one KV
head: the one its query heads read. Any other combination is refused (a rank's query heads
would straddle KV heads unevenly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class TPShard:
    """This process's place in the tensor-parallel group: rank ``rank`` of ``size``; the
    layers' collectives run on ``group`` (a torch.distributed process group)."""

    rank: int = 0
    size: int = 1
    group: object | None = field(default=None, compare=False, repr=False)

    def part(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's share of ``total`` items (``size`` divides it)."""
        length = total // self.size
        return self.rank * length, length

    def padded_vocab(self, vocab_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``size`` (padding rows are zero)."""
        return -(-vocab_size // self.size) * self.size


NO_TP = TPShard()


def check_tp_shapes(config: PretrainedConfig, size: int) -> None:
    """ValueError unless the model's heads and MLP width can be split over ``size`` ranks."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide num_attention_heads ({heads})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide num_key_value_heads ({kv_heads}) or be "
            f"a multiple of it (KV heads are then replicated)"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide intermediate_size "
            f"({config.intermediate_size})"
        )


def kv_heads_of(shard: TPShard, num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) held by this rank: a split, or one replicated head."""
    if num_kv_heads % shard.size == 0:
        return shard.part(num_kv_heads)
    return shard.rank // (shard.size // num_kv_heads), 1


# HF weight name part -> (dimension split, what is split): "q" query heads, "kv" KV heads,
# "mlp" intermediate columns, "vocab" vocabulary rows. Names not listed are replicated.
_SPLITS = {
    "q_proj.": (0, "q"),
    "k_proj.": (0, "kv"),
    "v_proj.": (0, "kv"),
    "o_proj.weight": (1, "q"),
    "gate_proj.": (0, "mlp"),
    "up_proj.": (0, "mlp"),
    "down_proj.weight": (1, "mlp"),
    "embed_tokens.": (0, "vocab"),
    "lm_head.": (0, "vocab"),
}
# Row-parallel biases are added once: rank 0 keeps them, the others hold zeros.
_ROW_PARALLEL_BIASES = ("o_proj.bias", "down_proj.bias")


def shard_weight(
    name: str, weight, config: PretrainedConfig, shard: TPShard, head_dim: int
) -> torch.Tensor:
    """This rank's slice of the HF weight ``name``. ``weight`` is a tensor or a lazy safetensors
    slice (indexing it reads only the slice). Vocabulary slices past the vocabulary's end come
    back shorter than the parameter; the caller zero-fills the rest."""
    if any(name.endswith(b) for b in _ROW_PARALLEL_BIASES):
        full = weight[:]
        return full if shard.rank == 0 else torch.zeros_like(full)
    split = next(
        (s for key, s in _SPLITS.items() if f".{key}" in name or name.startswith(key)), None
    )
    if split is None:
        return weight[:]
    dim, kind = split
    if kind == "q":
        start, length = shard.part(config.num_attention_heads)
        start, length = start * head_dim, length * head_dim
    elif kind == "kv":
        start, length = kv_heads_of(shard, config.num_key_value_heads)
        start, length = start * head_dim, length * head_dim
    elif kind == "mlp":
        start, length = shard.part(config.intermediate_size)
    else:
        start, length = shard.part(shard.padded_vocab(config.vocab_size))
        length = max(0, min(length, config.vocab_size - start))
    index = (
        (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    )
    return weight[index]

"""The layers that talk across tensor-parallel ranks (the default process group).

Column-parallel projections (QKV, gate/up) need no layer of their own: each rank's ``Linear``
simply has fewer output rows. The three below end in a collective on the shard's group:

- ``RowParallelLinear`` (o_proj, down_proj): each rank multiplies its slice of the input
  columns; an all-reduce sums the partial products (the bias lives on rank 0 only).
- ``VocabParallelEmbedding``: each rank looks up the ids in its vocabulary slice, zeros the
  others; an all-reduce adds the one non-zero row per token (exact: the rest are zeros).
- ``gather_logits`` (LM head): each rank's logits over its vocabulary slice are gathered to
  rank 0 and concatenated; padding columns past the vocabulary are dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedspec.engine.distributed.comm import collective
from pagedspec.engine.distributed.shard import TPShard
from pagedspec.engine.models.linear import Embedding, Linear


class RowParallelLinear(Linear):
    """``Linear`` over this rank's input columns, all-reduced to the full product."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: TPShard) -> None:
        super().__init__(in_features, out_features, bias)
        self.group = shard.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        collective(dist.all_reduce, out, group=self.group)
        return out


class VocabParallelEmbedding(Embedding):
    """The embedding rows of this rank's vocabulary slice (padded vocabulary / size rows); like
    ``Embedding`` it reads a tied LM head's pack."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: TPShard) -> None:
        self.vocab_start, rows = shard.part(shard.padded_vocab(vocab_size))
        super().__init__(rows, hidden_size)
        self.group = shard.group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(local.masked_fill(~mine, 0))
        out.masked_fill_(~mine[:, None], 0.0)
        collective(dist.all_reduce, out, group=self.group)
        return out


def gather_logits(local: torch.Tensor, vocab_size: int, shard: TPShard) -> torch.Tensor | None:
    """[N, padded vocab / size] per rank -> [N, vocab] on rank 0, None on the others."""
    parts = [torch.empty_like(local) for _ in range(shard.size)] if shard.rank == 0 else None
    collective(dist.gather, local.contiguous(), parts, dst=0, group=shard.group)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size]

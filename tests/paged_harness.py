"""Test-only driver: runs a model over packed batches with a paged KV cache.

Each sequence owns a fixed set of blocks; the block ids are a seeded shuffle so that block
tables are not the identity and paging is actually exercised.
"""

import math

import torch

from pagedspec.engine.loader.model_loader import model_kv_shape
from pagedspec.engine.models import AttentionMetadata


class PagedHarness:
    def __init__(
        self,
        model: torch.nn.Module,
        num_seqs: int,
        max_len: int,
        block_size: int = 4,
        backend: str = "torch",
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend
        num_layers, num_kv_heads, head_dim = model_kv_shape(model.config)
        weight = model.lm_head.weight
        blocks_per_seq = math.ceil(max_len / block_size)
        num_blocks = num_seqs * blocks_per_seq
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            )
            for _ in range(num_layers)
        ]
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
        self.seq_lens = [0] * num_seqs
        self.device = weight.device

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Append each (sequence, tokens) chunk in one packed forward; returns each chunk's
        float32 logits [len(tokens), vocab]."""
        seqs = [seq for seq, _ in chunks]
        lens = [len(tokens) for _, tokens in chunks]
        starts = torch.tensor([self.seq_lens[seq] for seq in seqs])
        positions = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens, strict=True)]
        )
        owner = torch.repeat_interleave(torch.tensor(seqs), torch.tensor(lens))
        blocks = self.block_tables[owner, positions // self.block_size].long()
        slots = blocks * self.block_size + positions % self.block_size
        for seq, n in zip(seqs, lens, strict=True):
            self.seq_lens[seq] += n
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device),
            cu_query_lens=torch.tensor([0, *lens]).cumsum(0).to(torch.int32).to(self.device),
            seq_lens=torch.tensor([self.seq_lens[s] for s in seqs], dtype=torch.int32).to(
                self.device
            ),
            block_tables=self.block_tables[seqs].to(self.device),
            backend=self.backend,
        )
        input_ids = torch.tensor([t for _, tokens in chunks for t in tokens]).to(self.device)
        hidden = self.model(input_ids, positions.to(self.device), self.kv_caches, meta)
        return list(self.model.compute_logits(hidden).split(lens))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill every prompt in one step, then decode all of them together, greedily.
        Sequences 0..len(prompts)-1 must be fresh."""
        logits = self.step(list(enumerate(prompts)))
        outputs = [[int(row[-1].argmax())] for row in logits]
        for _ in range(max_new_tokens - 1):
            logits = self.step([(i, out[-1:]) for i, out in enumerate(outputs)])
            for out, row in zip(outputs, logits, strict=True):
                out.append(int(row[-1].argmax()))
        return outputs

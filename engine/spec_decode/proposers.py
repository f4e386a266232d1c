"""Draft proposers: n-gram prompt lookup and a small draft model.

Both are deterministic (greedy), so the rejection sampler treats q as one-hot: accepted with
p(x), recovered from p without x. That keeps them exactly lossless at any temperature.
"""

from __future__ import annotations

from typing import Protocol

from engine.model_runner import ModelRunner, Span
from engine.spec_decode.ngram import propose_ngram
from scheduler import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` draft tokens to follow ``seqs[i].token_ids``."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget per-sequence state (the sequence finished or was preempted)."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [
            propose_ngram(seq.token_ids, k, self.min_n, self.max_n)
            for seq, k in zip(seqs, ks, strict=True)
        ]

    def release(self, seq_id: int) -> None:
        pass  # stateless


class DraftModelProposer:
    """Greedy drafts from a second model whose KV lives in its own tensors, addressed by the
    target's block tables (same block ids, same slots).

    After a round the draft has written KV for the sequence plus d1..d(k-1). Its KV is valid
    for the prefix the target then committed: the sequence up to the round, plus the leading
    drafts the target accepted. The next round feeds only the tokens past that prefix (the
    recovered or bonus token, and d_k if every draft was accepted); nothing is recomputed.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._rounds: dict[int, tuple[int, list[int]]] = {}  # seq_id → (len before, drafts fed)

    def release(self, seq_id: int) -> None:
        """The sequence finished or lost its blocks (preemption): its draft KV is gone."""
        self._rounds.pop(seq_id, None)

    def _valid_prefix(self, seq: Sequence) -> int:
        base, fed = self._rounds.get(seq.seq_id, (0, []))
        valid = base
        for token in fed:
            if valid >= seq.num_computed_tokens or seq.token_ids[valid] != token:
                break
            valid += 1
        return min(valid, seq.num_computed_tokens)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        spans = []
        for seq in seqs:
            start = self._valid_prefix(seq)
            spans.append(Span(seq.seq_id, seq.token_ids[start:], start, 1))
        drafts: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for step in range(max(ks)):
            tokens = self.runner.forward(spans).argmax(dim=-1).tolist()
            for i, t in zip(active, tokens, strict=True):
                drafts[i].append(t)
            active = [i for i in active if len(drafts[i]) < ks[i]]
            if not active:
                break
            spans = [Span(seqs[i].seq_id, [drafts[i][-1]], len(seqs[i]) + step, 1) for i in active]
        for seq, d in zip(seqs, drafts, strict=True):
            self._rounds[seq.seq_id] = (len(seq), d[:-1])
        return drafts

"""Draft proposers: n-gram prompt lookup and a small draft model.

Both are deterministic (greedy), so verification treats q as one-hot: accepted with p(x),
recovered from p without x. That keeps them exactly lossless at any temperature.

A proposer's state moves only in ``commit``, called when the engine commits a step: a step that
fails before committing leaves it as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.model_runner import ModelRunner, Span
from engine.spec_decode.ngram import propose_ngram
from scheduler import ScheduledSequence


@dataclass(frozen=True)
class Proposal:
    drafts: list[list[int]]  # per scheduled sequence, at most its k tokens
    # per seq_id: (KV written for token_ids[:base], then for these drafts at base, base + 1, ...)
    written: dict[int, tuple[int, list[int]]]


class Proposer(Protocol):
    runs_every_span: bool  # True: propose() must see every step, drafting or not

    def propose(self, scheduled: list[ScheduledSequence], ks: list[int]) -> Proposal:
        """Up to ``ks[i]`` draft tokens to follow ``scheduled[i].seq.token_ids``."""
        ...

    def commit(
        self, seq_id: int, written: tuple[int, list[int]] | None, new_token_ids: list[int]
    ) -> int | None:
        """The step commits ``new_token_ids`` (they follow what the step computed): returns how
        many of the sequence's tokens the proposer's own KV then covers (None: it keeps none)."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def release(self, seq_id: int) -> None:
        """Forget per-sequence state (the sequence finished or was preempted)."""
        ...


class NgramProposer:
    """Stateless: drafts what followed an earlier occurrence of the sequence's suffix."""

    runs_every_span = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, scheduled: list[ScheduledSequence], ks: list[int]) -> Proposal:
        drafts = [
            propose_ngram(s.seq.token_ids, k, self.min_n, self.max_n) if k else []
            for s, k in zip(scheduled, ks, strict=True)
        ]
        return Proposal(drafts, {})

    def commit(
        self, seq_id: int, written: tuple[int, list[int]] | None, new_token_ids: list[int]
    ) -> int | None:
        return None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass

    def fork(self, parent_id: int, child_id: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


class DraftModelProposer:
    """Greedy drafts from a second model whose KV lives in its own tensors, addressed by the
    target's block tables (same block ids, same slots).

    Invariant: the draft's KV is valid for ``token_ids[:valid]`` of every sequence, where
    ``valid`` trails the target's computed tokens by at most one. The draft runs every span
    the target runs (a prefill chunk is chunked exactly like the target's; a sequence that does
    not draft this step still feeds its new tokens), so its KV never needs a catch-up prefill,
    and a prefix-cache hit's blocks hold the draft's KV too: the engine registers a block only
    once both models' KV in it is valid.
    """

    runs_every_span = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._valid: dict[int, int] = {}  # seq_id → tokens whose draft KV is valid

    def propose(self, scheduled: list[ScheduledSequence], ks: list[int]) -> Proposal:
        spans, written = [], {}
        for s, k in zip(scheduled, ks, strict=True):
            seq = s.seq
            # no state: a new or re-admitted sequence; its prefix-cache hits are draft-valid
            start = min(self._valid.get(seq.seq_id, s.start), s.start)
            end = s.start + s.num_new_tokens
            spans.append(Span(seq.token_ids[start:end], start, 1 if k else 0, s.block_table))
            written[seq.seq_id] = (end, [])
        drafts: list[list[int]] = [[] for _ in scheduled]
        active = [i for i, k in enumerate(ks) if k]
        step = 0
        while True:
            logits = self.runner.forward(spans)
            if not active:
                break
            for i, t in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(t)
            active = [i for i in active if len(drafts[i]) < ks[i]]
            if not active:
                break
            spans = []
            for i in active:
                s = scheduled[i]
                written[s.seq.seq_id][1].append(drafts[i][-1])
                spans.append(Span([drafts[i][-1]], len(s.seq) + step, 1, s.block_table))
            step += 1
        return Proposal(drafts, written)

    def commit(
        self, seq_id: int, written: tuple[int, list[int]] | None, new_token_ids: list[int]
    ) -> int | None:
        if written is None:
            return self._valid.get(seq_id, 0)
        base, fed = written
        valid = base  # new_token_ids sit at positions base, base + 1, ...
        for draft, token in zip(fed, new_token_ids, strict=False):
            if draft != token:
                break
            valid += 1
        self._valid[seq_id] = valid
        return valid

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    def fork(self, parent_id: int, child_id: int) -> None:
        self._valid[child_id] = self._valid.get(parent_id, 0)

    def release(self, seq_id: int) -> None:
        """The sequence finished or lost its blocks (preemption): its draft KV is gone."""
        self._valid.pop(seq_id, None)

"""Draft proposers: n-gram prompt lookup and a small draft model.

N-gram drafts are deterministic (q one-hot): accepted with p(x), recovered from p without x.
A draft model drafts greedily for greedy requests and otherwise samples each draft from q, its
own distribution after the request's penalties, temperature, top-k, top-p and min-p; the
verifier then accepts with min(1, p/q). Both keep the output law exactly the target's.

A proposer's state moves only in ``commit``, called when the engine commits a step: a step that
fails before committing leaves it as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.spec_decode.chain import chain_drafts, draw_drafts
from pagedspec.engine.spec_decode.draft_state import DraftState
from pagedspec.engine.spec_decode.ngram import NgramIndex
from pagedspec.engine.spec_decode.tree import DraftTree
from pagedspec.engine.worker.model_runner import ModelRunner
from pagedspec.engine.worker.spans import Span
from pagedspec.scheduler import ScheduledSequence


@dataclass(frozen=True)
class Proposal:
    drafts: list[list[int]]  # per scheduled sequence, at most its k tokens
    # per scheduled sequence: q, float32 [len(drafts), V], for sampled drafts; None where the
    # drafts are deterministic. Lives only inside the step that drafted it.
    draft_probs: list[torch.Tensor | None]
    # per seq_id: (KV written for token_ids[:base], then for these drafts at base, base + 1, ...)
    written: dict[int, tuple[int, list[int]]]
    # per scheduled index whose drafts are a tree (a chain, then leaves): its shape
    trees: dict[int, DraftTree] = field(default_factory=dict)
    # per constrained scheduled index: the bitmasks its drafts were drawn under (row t: after
    # drafts[:t]), which verification's rows 0 .. len(drafts) - 1 reuse
    # (pagedspec.engine.sample.grammar)
    grammar_bits: dict[int, np.ndarray] = field(default_factory=dict)


class TargetStep(NamedTuple):
    """What the target's forward produced for one sequence, for a proposer that reads it."""

    first_position: int  # the position of hidden's first row (the step's span start)
    # [span length, H]: the proposer's target_features of the target's hidden states; None
    # unless asked for (needs_target_hidden)
    hidden: torch.Tensor | None
    num_computed: int  # the target's computed tokens once the step commits


class Proposer(Protocol):
    runs_every_span: bool  # True: propose() must see every step, drafting or not
    needs_target_hidden: bool  # True: commit() needs the target's hidden states
    hidden_layers: tuple[int, ...]  # the target layers whose hidden states it needs too

    def propose(
        self,
        scheduled: list[ScheduledSequence],
        ks: list[int],
        params: list[SamplingParams | None],
    ) -> Proposal:
        """Up to ``ks[i]`` draft tokens to follow ``scheduled[i].seq.token_ids``; ``params[i]``
        is the request's sampling for a draft model or head (None where ``ks[i]`` is 0, and
        for a proposer that samples nothing)."""
        ...

    def commit(
        self,
        state: DraftState,
        written: tuple[int, list[int]] | None,
        new_token_ids: list[int],
        target: TargetStep,
    ) -> int | None:
        """The step commits ``new_token_ids`` (they follow what the step computed) for the
        sequence whose ``DraftState`` is ``state`` (the proposer's per-sequence state lives
        there, nowhere else): returns how many of the sequence's tokens the proposer's own KV
        then covers (None: it keeps none)."""
        ...

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's target hidden states [T, (len(hidden_layers) + 1) H] (``ModelRunner.forward``
        with ``hidden_layers``) -> what commit() gets of them, once per step for every row;
        called only where needs_target_hidden."""
        ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...


class NgramProposer:
    """Drafts what followed the latest earlier occurrence of the sequence's suffix (each
    sequence's ``NgramIndex`` lives on its ``DraftState``)."""

    runs_every_span = False
    needs_target_hidden = False
    hidden_layers = ()

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(
        self,
        scheduled: list[ScheduledSequence],
        ks: list[int],
        params: list[SamplingParams | None],
    ) -> Proposal:
        drafts = [
            self._index(s.seq.owner.draft).propose(s.seq.token_ids, k, self.min_n) if k else []
            for s, k in zip(scheduled, ks, strict=True)
        ]
        return Proposal(drafts, [None] * len(drafts), {})

    def _index(self, state: DraftState) -> NgramIndex:
        """The sequence's n-gram index (made on first use; indexing the committed tokens as they
        grow is a cache of them, not a state a failed step could leave wrong)."""
        if state.ngram is None:
            state.ngram = NgramIndex(self.max_n)
        return state.ngram

    def commit(
        self,
        state: DraftState,
        written: tuple[int, list[int]] | None,
        new_token_ids: list[int],
        target: TargetStep,
    ) -> int | None:
        return None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass


class DraftModelProposer:
    """Drafts from a second model whose KV lives in its own tensors, addressed by the
    target's block tables (same block ids, same slots).

    Invariant: the draft's KV is valid for ``token_ids[:valid]`` of every sequence, where
    ``valid`` trails the target's computed tokens by at most one. The draft runs every span
    the target runs (a prefill chunk is chunked exactly like the target's; a sequence that does
    not draft this step still feeds its new tokens), so its KV never needs a catch-up prefill,
    and a prefix-cache hit's blocks hold the draft's KV too: the engine registers a block only
    once both models' KV in it is valid.
    """

    runs_every_span = True
    needs_target_hidden = False
    hidden_layers = ()

    def __init__(self, runner: ModelRunner, seed: int, chain_stop: float = 0.0):
        self.runner = runner
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self.chain_stop = chain_stop

    def propose(
        self,
        scheduled: list[ScheduledSequence],
        ks: list[int],
        params: list[SamplingParams | None],
    ) -> Proposal:
        spans, written = [], {}
        for s, k in zip(scheduled, ks, strict=True):
            seq = s.seq
            # no state: a new or re-admitted sequence; its prefix-cache hits are draft-valid
            valid = seq.owner.draft.valid
            start = s.start if valid is None else min(valid, s.start)
            end = s.start + s.num_new_tokens
            spans.append(Span(seq.token_ids[start:end], start, 1 if k else 0, s.block_table))
            written[seq.seq_id] = (end, [])

        def forward(spans: list[Span], owners: list[int]) -> torch.Tensor:
            return self.runner.forward(spans).logits

        vocab = self.runner.model.config.vocab_size  # the target's, as a draft model must have

        def draw(logits, rows, grammar_bits):
            ids, q = draw_drafts(logits, rows, self.generator, None, grammar_bits, vocab)
            return ids.tolist(), q

        drafts, sampled, _, bits = chain_drafts(
            scheduled, ks, params, spans, forward, draw, written, self.chain_stop, vocab_size=vocab
        )
        return Proposal(drafts, sampled, written, grammar_bits=bits)

    def commit(
        self,
        state: DraftState,
        written: tuple[int, list[int]] | None,
        new_token_ids: list[int],
        target: TargetStep,
    ) -> int | None:
        if written is None:
            return state.valid or 0
        base, fed = written
        valid = base  # new_token_ids sit at positions base, base + 1, ...
        for draft, token in zip(fed, new_token_ids, strict=False):
            if draft != token:
                break
            valid += 1
        state.valid = valid
        return valid

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

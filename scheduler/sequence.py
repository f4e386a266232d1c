"""The scheduler's view of one sequence: its tokens and how many of them have KV in the cache."""

from __future__ import annotations

import enum
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One token stream (a request has n of them).

    Invariants:
    - ``token_ids`` = prompt + committed outputs; never holds draft tokens.
    - ``num_pending`` more tokens were sampled by steps whose results the host has not read
      (async scheduling; 0 otherwise): the sequence is ``len(token_ids) + num_pending`` long.
    - ``num_computed_tokens`` tokens (a prefix of that) have their K/V in the cache, or will
      once the steps launched so far are done. A running sequence always has at least one
      uncomputed token: the next step computes the tokens from ``num_computed_tokens`` on (a
      prefill chunk, or the last sampled token, pending or not).
    """

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_pending",
        "status",
        "seats",
        "priority",
        "reuses_cache",
        "owner",
    )

    def __init__(self, seq_id: int, token_ids: list[int]):
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.status = SequenceStatus.WAITING
        # Slots of max_num_seqs this sequence holds: n for a prompt that will fork into n
        # samples once its prefill is done, then 1 for each of them.
        self.seats = 1
        # Under the "priority" policy: lower goes first (ties: the older sequence, lower id).
        self.priority = 0
        # False: admitted without prefix-cache hits, every prompt position computed (a request
        # that reports prompt logprobs needs their logits)
        self.reuses_cache = True
        # The engine's record of this sequence (its request, sampling params and drafter state);
        # opaque here. It rides along with every ScheduledSequence: nothing below asks up.
        self.owner: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """One token is left to compute: this step samples (and may verify drafts)."""
        return self.num_uncomputed_tokens == 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )

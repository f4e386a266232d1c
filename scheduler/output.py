"""What a step's schedule hands on: per sequence, the tokens to compute and a snapshot of the
block table that addresses them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedspec.scheduler.sequence import Sequence


class ScheduledSequence:
    """One sequence's part of a step: compute ``token_ids[start : start + num_new_tokens]``.

    ``block_table`` is a snapshot taken after this step's slots were reserved: it covers
    ``start + num_new_tokens + num_lookahead_slots`` positions, so the model runner (and a draft
    model) can address every slot of the step without asking the block manager. ``end``: one
    past the last scheduled token's position; ``samples``: the step reaches the end of the
    sequence, so it samples there. Built once per sequence per step, so a plain class with
    slots (a frozen dataclass costs ~3x as much to make); nothing changes it once built.
    """

    __slots__ = (
        "seq", "num_new_tokens", "num_lookahead_slots", "block_table", "start", "end", "samples"
    )  # fmt: skip

    def __init__(
        self,
        seq: Sequence,
        num_new_tokens: int,
        num_lookahead_slots: int = 0,
        block_table: tuple[int, ...] = (),
    ) -> None:
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.num_lookahead_slots = num_lookahead_slots
        self.block_table = block_table
        self.start = start = seq.num_computed_tokens
        self.end = end = start + num_new_tokens
        self.samples = end == len(seq.token_ids) + seq.num_pending

    def __repr__(self) -> str:
        return (
            f"ScheduledSequence({self.seq!r}, new={self.num_new_tokens}, "
            f"lookahead={self.num_lookahead_slots})"
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (src, dst) blocks: copy-on-write of shared, partly filled last blocks, before the step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead_slots for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

"""Iteration-level scheduling: who runs this step and with how many tokens.

Pure bookkeeping over ``Sequence`` objects and the ``BlockManager``; no tensors, no model.
Each step: running decodes first (1 token + up to k lookahead slots for speculation), then
running prompts that are part-way through a chunked prefill, then admission of waiting
prompts in order, all under ``max_num_seqs`` and ``max_num_batched_tokens``. When a decode
cannot get a block, the last running sequence in that order is preempted by recompute.

The order: arrival ("fcfs"), or (priority, arrival) under the "priority" policy (vLLM's: a
lower value first); a preempted sequence rejoins the waiting queue at its place in it.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pagedspec.memory import BlockManager, NoFreeBlocksError
from pagedspec.scheduler.output import ScheduledSequence, SchedulerOutput
from pagedspec.scheduler.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # POLICIES

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.policy!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0
        self.num_prefix_cache_hit_tokens = 0
        self.num_prefix_cache_query_tokens = 0  # tokens looked up at admission

    # --- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=False)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (finished or aborted) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step ---------------------------------------------------------------------------
    def runs_every_decode(self) -> bool:
        """Whether the next ``schedule(0)`` gives every running sequence its tokens without
        preempting: the token budget has one for each, and the pool a block for every decode
        (a decode needs at most one)."""
        if len(self.running) > self.config.max_num_batched_tokens:
            return False
        return self.block_manager.num_free_blocks() >= len(self._decoding_and_prefilling()[0])

    def _decoding_and_prefilling(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences split: a decode has one token left to compute (maybe pending
        on the device), a prefill more."""
        decoding, prefilling = [], []
        for seq in self.running:
            left = len(seq.token_ids) + seq.num_pending - seq.num_computed_tokens
            (decoding if left == 1 else prefilling).append(seq)
        return decoding, prefilling

    def admissible(self) -> Iterator[Sequence]:
        """The waiting sequences the next step may admit as far as seats go (the queue's head,
        one seat at least each); memory may stop it sooner."""
        seats = self.config.max_num_seqs - sum(seq.seats for seq in self.running)
        return itertools.islice(self.waiting, max(seats, 0))

    def schedule(self, num_lookahead_slots: int | Callable[[Sequence], int] = 0) -> SchedulerOutput:
        """Pick this step's sequences. ``num_lookahead_slots``: the draft slots to reserve after
        a decode (k, or k per sequence); fewer when the token budget or max_model_len is short.
        """
        lookahead = num_lookahead_slots if callable(num_lookahead_slots) else None
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        table = self.block_manager.frozen_table
        running = RUNNING
        decoding, prefilling = self._decoding_and_prefilling()

        if self.config.policy == "priority":  # so a victim is never one already scheduled
            decoding.sort(key=self._key)
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is not running:  # preempted earlier in this loop
                continue
            k = num_lookahead_slots if lookahead is None else lookahead(seq)
            if k:
                k = max(min(k, budget - 1, max_len - len(seq.token_ids)), 0)
            if not self._reserve(seq, 1 + k, out):
                continue  # seq itself was preempted
            out.scheduled.append(ScheduledSequence(seq, 1, k, table(seq.seq_id)))
            budget -= 1 + k

        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is not running:  # preempted by a decode's reservation
                continue
            n = min(seq.num_uncomputed_tokens, budget)  # blocks were allocated at admission
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n

        # No admissions in a step that preempted: memory is short, and the preempted sequence
        # would only be re-admitted and preempted again.
        while self.waiting and not out.preempted and budget > 0:
            seq = self.waiting[0]
            seats = sum(s.seats for s in self.running)
            if seats + seq.seats > self.config.max_num_seqs:
                break
            if not self.block_manager.can_allocate(seq.token_ids, seq.reuses_cache):
                break  # nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.num_computed_tokens = self.block_manager.allocate(
                seq.seq_id, seq.token_ids, seq.reuses_cache
            )
            self.num_prefix_cache_hit_tokens += seq.num_computed_tokens
            self.num_prefix_cache_query_tokens += len(seq.token_ids)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
        return out

    def _scheduled(self, seq: Sequence, num_new_tokens: int, k: int = 0) -> ScheduledSequence:
        table = self.block_manager.frozen_table(seq.seq_id)
        return ScheduledSequence(seq, num_new_tokens, k, table)

    # --- after the step -----------------------------------------------------------------------
    def update(
        self, seq: Sequence, num_computed: int, new_token_ids: list[int], num_cacheable: int
    ) -> None:
        """The one place a sequence moves after a step.

        ``new_token_ids`` (sampled and accepted) join the sequence; ``num_computed`` of its tokens
        now have KV (never fewer than the steps launched since will have: async scheduling).
        After a sampling step the block table is rolled back to exactly those tokens: rejected
        drafts' and unused lookahead slots leave it (no KV memory is touched).
        Full blocks among the first ``num_cacheable`` committed tokens are registered for
        prefix caching (a caller lowers it below ``num_computed`` when another model's KV in
        those slots is not valid yet).
        """
        seq.token_ids.extend(new_token_ids)
        if num_computed < seq.num_computed_tokens:  # steps launched since cover more (async)
            num_computed = seq.num_computed_tokens
        seq.num_computed_tokens = num_computed
        rollback = num_computed if new_token_ids else None  # a prompt chunk keeps its slots
        self.block_manager.keep(
            seq.seq_id, rollback, seq.token_ids, min(num_computed, num_cacheable)
        )

    def fork(self, parent: Sequence, child_id: int) -> Sequence:
        """A copy of ``parent`` (its tokens, computed prefix and record-to-be) that shares its
        blocks, copy-on-write, and takes one of the seats ``parent`` held for its forks (n forks
        later it holds 1)."""
        child = Sequence(child_id, parent.token_ids)
        child.priority = parent.priority
        parent.seats -= 1
        child.num_computed_tokens = parent.num_computed_tokens
        self.block_manager.fork(parent.seq_id, child_id)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return child

    # --- internals ----------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make the block table cover ``num_tokens`` slots past the computed prefix.

        Preempts the youngest running sequences until it fits; returns False if ``seq`` itself
        had to go.
        """
        while True:
            try:
                cow = self.block_manager.reserve(seq.seq_id, seq.num_computed_tokens + num_tokens)
            except NoFreeBlocksError:  # nothing changed: make room and try again
                victim = self._last_running()
                self._preempt(victim, out)
                if victim is seq:
                    return False
                continue
            if cow is not None:
                out.blocks_to_copy.append(cow)
            return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the blocks, keep the tokens, go to the front of the queue."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _key(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority, seq.seq_id) if self.config.policy == "priority" else (0, seq.seq_id)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """FCFS: a new sequence at the back, a preempted one at the front; by priority: each
        at its place by (priority, arrival)."""
        if self.config.policy == "priority":
            at = bisect.bisect(self.waiting, self._key(seq), key=self._key)
            self.waiting.insert(at, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _last_running(self) -> Sequence:
        """Who is preempted first: the youngest (FCFS), else the lowest priority, youngest."""
        if self.config.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=self._key)

"""Stateful property test: random allocate / append / fork / truncate / commit / free / prefix reuse
against a model of what every KV slot holds.

The model writes, for each slot the engine would write, the full token prefix ending at that
position (the KV of a token depends on every token before it). A sequence is correct iff each of
its positions maps to a slot holding exactly its own prefix: that catches a missing or wrong
copy-on-write, a block freed or reused while still held, and a prefix hit serving the wrong KV.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedspec.memory import BlockManager, NoFreeBlocksError

TOKENS = st.integers(0, 2)  # a tiny vocabulary, so prompts share prefixes often


class _Seq:
    def __init__(self, tokens: list[int], committed: int) -> None:
        self.tokens = tokens  # what the sequence's slots logically hold, drafts included
        self.committed = committed


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.size = block_size
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose KV it holds
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0
        # Every committed token list, to draw shared prefixes from.
        self.prompts: list[list[int]] = []
        self.committed_prefixes: set[tuple[int, ...]] = set()  # full-block prefixes ever committed

    # --- helpers -----------------------------------------------------------------------------

    def snapshot(self) -> tuple:
        bm = self.bm
        return (
            bm.get_stats(),
            [bm.ref_count(b) for b in range(bm.num_blocks)],
            {s: (list(bm.block_table(s)), bm.num_tokens(s)) for s in self.seqs},
        )

    def write(self, seq_id: int, start: int) -> None:
        """The engine computes KV for positions [start, len) and writes it to their slots."""
        tokens = self.seqs[seq_id].tokens
        for pos, slot in enumerate(self.bm.slot_ids(seq_id, start, len(tokens)), start):
            self.kv[slot] = tuple(tokens[: pos + 1])

    def commit_tokens(self, seq_id: int, num_committed: int) -> None:
        seq = self.seqs[seq_id]
        seq.committed = num_committed
        committed = seq.tokens[:num_committed]
        self.bm.commit(seq_id, committed)
        for end in range(self.size, num_committed + 1, self.size):
            self.committed_prefixes.add(tuple(committed[:end]))
        self.prompts.append(committed)

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.seqs)), label="seq_id")

    def admit(self, prompt: list[int]) -> int | None:
        """allocate(prompt) checked against the model; the new seq id, or None if it did not fit."""
        bm, seq_id = self.bm, self.next_id
        expected = bm.match_prefix(prompt)
        assert expected % self.size == 0 and expected <= len(prompt) - 1
        if not bm.can_allocate(prompt):
            before = self.snapshot()
            with pytest.raises(NoFreeBlocksError):
                bm.allocate(seq_id, prompt)
            assert self.snapshot() == before and not bm.has_seq(seq_id)
            return None
        cached = bm.allocate(seq_id, prompt)
        assert cached == expected
        self.next_id += 1
        self.seqs[seq_id] = _Seq(prompt, 0)
        # A hit serves only full blocks of committed tokens whose KV is exactly this prefix's.
        for pos, slot in enumerate(bm.slot_ids(seq_id, 0, cached)):
            assert self.kv.get(slot) == tuple(prompt[: pos + 1])
        for end in range(self.size, cached + 1, self.size):
            assert tuple(prompt[:end]) in self.committed_prefixes
        self.write(seq_id, cached)
        return seq_id

    # --- rules -------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        suffix=st.lists(TOKENS, max_size=10),
        reuse=st.booleans(),
        prefill_done=st.booleans(),
    )
    def allocate(
        self, data: st.DataObject, suffix: list[int], reuse: bool, prefill_done: bool
    ) -> None:
        prompt = list(suffix)
        if reuse and self.prompts:
            base = data.draw(st.sampled_from(self.prompts), label="base")
            prompt = base[: data.draw(st.integers(0, len(base)), label="cut")] + prompt
        if not prompt:
            return
        seq_id = self.admit(prompt)
        if seq_id is not None and prefill_done:  # the engine commits a computed prompt
            self.commit_tokens(seq_id, len(prompt))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), extra=TOKENS)
    def probe_prefix_cache(self, data: st.DataObject, extra: int) -> None:
        """Admit a committed token list again and drop it: every hit must serve exactly its KV."""
        seq_id = self.admit(data.draw(st.sampled_from(self.prompts), label="base") + [extra])
        if seq_id is not None:
            self.bm.free(seq_id)
            del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, max_size=6))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        bm, seq_id = self.bm, self.pick(data)
        seq = self.seqs[seq_id]
        n = len(new_tokens)
        needed = bm.num_blocks_needed(seq_id, n)
        if not bm.can_append(seq_id, n):
            assert needed > bm.num_free_blocks()
            before = self.snapshot()
            with pytest.raises(NoFreeBlocksError):
                bm.append(seq_id, n)
            assert self.snapshot() == before
            return
        old_len, old_table = len(seq.tokens), list(bm.block_table(seq_id))
        free = bm.num_free_blocks()
        copy = bm.append(seq_id, n)
        assert free - bm.num_free_blocks() == needed
        table = bm.block_table(seq_id)
        assert table[: max(len(old_table) - 1, 0)] == old_table[:-1]
        if copy is None:
            assert table[: len(old_table)] == old_table
        else:
            src, dst = copy
            assert old_len % self.size != 0 and src == old_table[-1] != dst
            assert table[len(old_table) - 1] == dst and bm.ref_count(dst) == 1
            for offset in range(self.size):  # the engine copies the block's KV
                self.kv[dst * self.size + offset] = self.kv.get(src * self.size + offset)
        seq.tokens = seq.tokens + new_tokens
        self.write(seq_id, old_len)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        seq = self.seqs[seq_id]
        n = data.draw(st.integers(0, len(seq.tokens)), label="num_tokens")
        self.bm.truncate(seq_id, n)
        seq.tokens = seq.tokens[:n]
        seq.committed = min(seq.committed, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        seq = self.seqs[seq_id]
        self.commit_tokens(seq_id, data.draw(st.integers(seq.committed, len(seq.tokens))))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.seqs[self.pick(data)]
        parent_id = next(s for s, q in self.seqs.items() if q is parent)
        child_id = self.next_id
        self.next_id += 1
        self.bm.fork(parent_id, child_id)
        self.seqs[child_id] = _Seq(list(parent.tokens), parent.committed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        self.bm.free(seq_id)
        del self.seqs[seq_id]
        assert not self.bm.has_seq(seq_id)

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_tables(self) -> None:
        bm = self.bm
        counts = [0] * bm.num_blocks
        for seq_id in self.seqs:
            for block in bm.block_table(seq_id):
                counts[block] += 1
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == counts
        stats = bm.get_stats()
        assert stats.free == bm.num_free_blocks() == counts.count(0)
        assert stats.used == bm.num_blocks - stats.free and stats.total == bm.num_blocks
        assert 0 <= stats.cached <= bm.num_blocks

    @invariant()
    def every_sequence_sees_its_own_kv(self) -> None:
        bm = self.bm
        for seq_id, seq in self.seqs.items():
            n = len(seq.tokens)
            assert bm.num_tokens(seq_id) == n
            assert len(bm.block_table(seq_id)) == -(-n // self.size)
            assert bm.frozen_table(seq_id) == tuple(bm.block_table(seq_id))  # never stale
            for pos, slot in enumerate(bm.slot_ids(seq_id, 0, n)):
                assert self.kv.get(slot) == tuple(seq.tokens[: pos + 1])

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq_id in list(self.seqs):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks() == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase

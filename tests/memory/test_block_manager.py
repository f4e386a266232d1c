"""Unit tests for memory/: block tables, copy-on-write, rollback, prefix caching, sizing."""

from __future__ import annotations

import random

import pytest
import torch

import pagedspec.memory.block_pool
from pagedspec.memory import (
    BlockManager,
    BlockStats,
    NoFreeBlocksError,
    kv_block_bytes,
    num_kv_blocks,
)

B = 4  # block size used throughout: small, so boundaries are easy to hit


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"rng seed {seed}")  # shown on failure
    return random.Random(seed)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def snapshot(bm: BlockManager, seq_ids=()) -> tuple:
    """Everything observable about the manager, to check that failed calls change nothing."""
    return (
        bm.get_stats(),
        [bm.ref_count(b) for b in range(bm.num_blocks)],
        {s: (list(bm.block_table(s)), bm.num_tokens(s)) for s in seq_ids if bm.has_seq(s)},
    )


def check_refs(bm: BlockManager, seq_ids) -> None:
    """Ref count == number of table entries holding the block; free count == blocks at ref 0."""
    counts = [0] * bm.num_blocks
    for s in seq_ids:
        for b in bm.block_table(s):
            counts[b] += 1
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == counts
    assert bm.num_free_blocks() == counts.count(0)


# --- construction, queries, errors -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 2.5}, "num_blocks"),
    ],
)
def test_constructor_rejects_bad_sizes(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockManager(**kwargs)


def test_fresh_manager_is_all_free():
    bm = BlockManager(10, B)
    assert (bm.num_blocks, bm.block_size) == (10, B)
    assert bm.get_stats() == BlockStats(total=10, free=10, used=0, cached=0, usage=0.0)
    assert not bm.has_seq(0)


def test_unknown_seq_id_raises_key_error_everywhere():
    bm = BlockManager(4, B)
    bm.allocate(1, [1, 2, 3])
    before = snapshot(bm, [1])
    calls = [
        lambda: bm.block_table(7),
        lambda: bm.num_tokens(7),
        lambda: bm.num_blocks_needed(7, 1),
        lambda: bm.can_append(7, 1),
        lambda: bm.append(7, 1),
        lambda: bm.slot_ids(7, 0, 1),
        lambda: bm.truncate(7, 0),
        lambda: bm.fork(7, 8),
        lambda: bm.free(7),
        lambda: bm.commit(7, [1]),
    ]
    for call in calls:
        with pytest.raises(KeyError, match="unknown seq_id 7"):
            call()
    assert snapshot(bm, [1]) == before
    assert not bm.has_seq(8)


def test_ref_count_rejects_out_of_range_block():
    bm = BlockManager(4, B)
    for block in (-1, 4):
        with pytest.raises(ValueError, match="block_id"):
            bm.ref_count(block)


# --- allocate ---------------------------------------------------------------------------------


def test_allocate_covers_prompt_with_distinct_blocks(rng):
    bm = BlockManager(16, B)
    n = rng.randint(1, 30)
    assert bm.can_allocate(tokens(rng, n))
    assert bm.allocate(3, tokens(rng, n)) == 0
    table = bm.block_table(3)
    assert len(table) == -(-n // B) == len(set(table))
    assert bm.num_tokens(3) == n
    assert bm.num_free_blocks() == 16 - len(table)
    check_refs(bm, [3])


def test_allocate_rejects_duplicate_id_and_empty_prompt(rng):
    bm = BlockManager(8, B)
    bm.allocate(0, tokens(rng, 5))
    before = snapshot(bm, [0])
    with pytest.raises(ValueError, match="already exists"):
        bm.allocate(0, tokens(rng, 3))
    with pytest.raises(ValueError, match="token_ids"):
        bm.allocate(1, [])
    with pytest.raises(ValueError, match="token_ids"):
        bm.can_allocate([])
    assert snapshot(bm, [0]) == before
    assert not bm.has_seq(1)


def test_allocate_without_enough_blocks_changes_nothing(rng):
    bm = BlockManager(5, B)
    prompt = tokens(rng, 3 * B + 1)  # 4 blocks
    bm.allocate(0, prompt)
    bm.commit(0, prompt)
    before = snapshot(bm, [0])
    big = tokens(rng, 2 * B)  # 2 blocks > 1 free
    assert not bm.can_allocate(big)
    with pytest.raises(NoFreeBlocksError, match="needs 2 free blocks, 1 free"):
        bm.allocate(1, big)
    assert snapshot(bm, [0]) == before
    assert not bm.has_seq(1)


def test_hits_on_live_blocks_are_free_and_hits_on_free_cached_blocks_are_not(rng):
    bm = BlockManager(6, B)
    prompt = tokens(rng, 3 * B)
    bm.allocate(0, prompt)
    bm.commit(0, prompt)
    assert bm.num_free_blocks() == 3
    # Same 2 full blocks + 3 more blocks of new tokens: hits on held blocks cost nothing.
    longer = prompt[: 2 * B] + tokens(rng, 3 * B)
    assert bm.match_prefix(longer) == 2 * B
    assert bm.can_allocate(longer)
    # Once seq 0 is freed its blocks are free but cached: reusing them consumes free blocks.
    bm.free(0)
    assert bm.get_stats().free == 6
    needs_seven = prompt[: 2 * B] + tokens(rng, 5 * B)  # 2 hits + 5 fresh > 6 free
    assert bm.match_prefix(needs_seven) == 2 * B
    assert not bm.can_allocate(needs_seven)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, needs_seven)
    fits = prompt[: 2 * B] + tokens(rng, 4 * B)  # 2 hits + 4 fresh == 6 free
    assert bm.can_allocate(fits)
    assert bm.allocate(1, fits) == 2 * B
    assert bm.num_free_blocks() == 0
    check_refs(bm, [1])


# --- append / num_blocks_needed / slot_ids ----------------------------------------------------


def test_append_allocates_only_at_block_boundaries(rng):
    bm = BlockManager(32, B)
    bm.allocate(0, tokens(rng, rng.randint(1, 10)))
    for _ in range(20):
        n = rng.randint(0, 6)
        old_len, old_table = bm.num_tokens(0), list(bm.block_table(0))
        expected_new = -(-(old_len + n) // B) - len(old_table)
        assert bm.num_blocks_needed(0, n) == expected_new
        free = bm.num_free_blocks()
        assert bm.append(0, n) is None
        assert bm.num_tokens(0) == old_len + n
        assert bm.block_table(0)[: len(old_table)] == old_table
        assert len(bm.block_table(0)) == -(-(old_len + n) // B)
        assert bm.num_free_blocks() == free - expected_new
    check_refs(bm, [0])


def test_reserve_grows_to_cover_and_never_shrinks(rng):
    bm = BlockManager(8, B)
    bm.allocate(0, tokens(rng, B + 3))
    assert bm.reserve(0, B) is None and bm.num_tokens(0) == B + 3  # covered: unchanged
    assert bm.reserve(0, 3 * B) is None
    assert bm.num_tokens(0) == 3 * B and len(bm.block_table(0)) == 3
    before = snapshot(bm, [0])
    with pytest.raises(NoFreeBlocksError):
        bm.reserve(0, 9 * B)  # 6 more blocks, 5 free
    assert snapshot(bm, [0]) == before
    bm.truncate(0, B + 1)
    bm.fork(0, 1)  # the last block is shared and partly filled: copy-on-write, as append
    src = bm.block_table(1)[-1]
    assert bm.reserve(1, B + 2) == (src, bm.block_table(1)[-1]) != (src, src)
    check_refs(bm, [0, 1])


def test_keep_is_truncate_then_commit(rng):
    """What the scheduler calls after every step, against the two verbs it stands for."""
    for _ in range(50):
        ids = tokens(rng, rng.randint(1, 3 * B))
        grown = ids + tokens(rng, rng.randint(0, 2 * B))
        kept_len = rng.randint(len(ids), len(grown))
        cacheable = rng.randint(0, kept_len)
        rollback = rng.choice([None, kept_len])
        one, two = BlockManager(16, B), BlockManager(16, B)
        for bm in (one, two):
            bm.allocate(0, ids)
            bm.append(0, len(grown) - len(ids))
        one.keep(0, rollback, grown, cacheable)
        if rollback is not None:
            two.truncate(0, rollback)
        two.commit(0, grown, cacheable)
        assert snapshot(one, [0]) == snapshot(two, [0])
        assert one.match_prefix(grown) == two.match_prefix(grown)


def test_append_bad_count_and_exhaustion_change_nothing(rng):
    bm = BlockManager(3, B)
    bm.allocate(0, tokens(rng, 2 * B + 1))  # 3 blocks, 3 free slots in the last
    before = snapshot(bm, [0])
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.append(0, -1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.num_blocks_needed(0, -2)
    assert bm.can_append(0, B - 1)
    assert not bm.can_append(0, B)
    with pytest.raises(NoFreeBlocksError):
        bm.append(0, B)
    assert snapshot(bm, [0]) == before
    assert bm.append(0, B - 1) is None
    assert bm.num_free_blocks() == 0


def test_slot_ids_match_block_table(rng):
    bm = BlockManager(64, B)
    # Interleave two sequences so their tables are not contiguous ranges.
    for s in (0, 1):
        bm.allocate(s, tokens(rng, rng.randint(1, 9)))
    for _ in range(15):
        for s in (0, 1):
            bm.append(s, rng.randint(1, 5))
    for s in (0, 1):
        table, n = bm.block_table(s), bm.num_tokens(s)
        expected = [table[p // B] * B + p % B for p in range(n)]
        assert bm.slot_ids(s, 0, n) == expected
        for _ in range(20):
            start = rng.randint(0, n)
            end = rng.randint(start, n)
            assert bm.slot_ids(s, start, end) == expected[start:end]


def test_slot_ids_rejects_bad_ranges(rng):
    bm = BlockManager(4, B)
    bm.allocate(0, tokens(rng, 6))
    for start, end in [(-1, 2), (3, 2), (0, 7)]:
        with pytest.raises(ValueError, match="num_tokens"):
            bm.slot_ids(0, start, end)


# --- truncate / free ---------------------------------------------------------------------------


def test_truncate_releases_whole_blocks_past_the_end(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, 4 * B + 2))  # 5 blocks
    table = list(bm.block_table(0))
    bm.truncate(0, 2 * B + 1)  # keeps 3 blocks, the last partly used
    assert bm.block_table(0) == table[:3]
    assert bm.num_tokens(0) == 2 * B + 1
    assert [bm.ref_count(b) for b in table] == [1, 1, 1, 0, 0]
    bm.truncate(0, 2 * B + 1)  # same length: no-op
    assert bm.block_table(0) == table[:3]
    bm.truncate(0, 0)
    assert bm.block_table(0) == [] and bm.num_tokens(0) == 0
    assert bm.num_free_blocks() == 16
    bm.append(0, 3)  # an empty sequence can grow again
    assert len(bm.block_table(0)) == 1
    check_refs(bm, [0])


def test_truncate_rejects_bad_lengths(rng):
    bm = BlockManager(8, B)
    bm.allocate(0, tokens(rng, 7))
    before = snapshot(bm, [0])
    for n in (-1, 8):
        with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 7\]"):
            bm.truncate(0, n)
    assert snapshot(bm, [0]) == before


def test_truncate_never_frees_blocks_another_sequence_holds(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, 3 * B))
    bm.fork(0, 1)
    shared = list(bm.block_table(0))
    bm.truncate(1, 1)
    assert bm.block_table(1) == shared[:1]
    assert [bm.ref_count(b) for b in shared] == [2, 1, 1]
    assert bm.block_table(0) == shared  # the parent is untouched
    bm.free(0)
    assert [bm.ref_count(b) for b in shared] == [1, 0, 0]
    check_refs(bm, [1])


def test_free_releases_everything_and_rejects_double_free(rng):
    bm = BlockManager(32, B)
    live = []
    for s in range(5):
        prompt = tokens(rng, rng.randint(1, 12))
        bm.allocate(s, prompt)
        bm.commit(s, prompt)
        live.append(s)
    bm.fork(2, 5)
    bm.append(5, 3)
    live.append(5)
    for s in rng.sample(live, len(live)):
        bm.free(s)
        assert not bm.has_seq(s)
    assert bm.num_free_blocks() == 32
    assert all(bm.ref_count(b) == 0 for b in range(32))
    with pytest.raises(KeyError):
        bm.free(0)


# --- fork / copy-on-write ---------------------------------------------------------------------


def test_fork_shares_every_block(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, 2 * B + 3))
    bm.fork(0, 1)
    assert bm.block_table(1) == bm.block_table(0)
    assert bm.block_table(1) is not bm.block_table(0)
    assert bm.num_tokens(1) == bm.num_tokens(0)
    assert all(bm.ref_count(b) == 2 for b in bm.block_table(0))
    with pytest.raises(ValueError, match="child_id 1 already exists"):
        bm.fork(0, 1)
    check_refs(bm, [0, 1])


def test_append_into_shared_partial_block_copies_on_write(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, 2 * B + 1))
    bm.fork(0, 1)
    parent_table = list(bm.block_table(0))
    src = parent_table[-1]
    assert bm.num_blocks_needed(1, 1) == 1  # the copy
    copy = bm.append(1, 1)
    assert copy is not None and copy[0] == src and copy[1] not in parent_table
    dst = copy[1]
    assert bm.block_table(1) == parent_table[:-1] + [dst]
    assert bm.block_table(0) == parent_table
    assert (bm.ref_count(src), bm.ref_count(dst)) == (1, 1)
    assert bm.slot_ids(1, 2 * B, 2 * B + 2) == [dst * B, dst * B + 1]
    # Now each owns its last block: no more copies, for either side.
    assert bm.append(1, 1) is None
    assert bm.append(0, 1) is None
    check_refs(bm, [0, 1])


def test_parent_appending_after_fork_also_copies(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, B + 2))
    bm.fork(0, 1)
    src = bm.block_table(0)[-1]
    assert bm.append(0, 3) == (src, bm.block_table(0)[1])
    assert bm.block_table(1)[-1] == src
    assert len(bm.block_table(0)) == 3  # the copy, then one new block for the overflow
    check_refs(bm, [0, 1])


def test_append_after_shared_full_block_needs_no_copy(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, 2 * B))
    bm.fork(0, 1)
    shared = list(bm.block_table(0))
    assert bm.num_blocks_needed(1, 1) == 1  # one new block, no copy
    assert bm.append(1, 1) is None
    assert bm.block_table(1)[:2] == shared
    assert all(bm.ref_count(b) == 2 for b in shared)
    check_refs(bm, [0, 1])


def test_copy_on_write_when_truncated_into_a_shared_block(rng):
    bm = BlockManager(16, B)
    bm.allocate(0, tokens(rng, 2 * B))
    bm.fork(0, 1)
    shared = list(bm.block_table(0))
    bm.truncate(1, B + 1)  # inside the second block, which seq 0 still fills
    copy = bm.append(1, 1)
    assert copy is not None and copy[0] == shared[1]
    assert bm.block_table(0) == shared
    check_refs(bm, [0, 1])


def test_copy_on_write_short_of_blocks_changes_nothing(rng):
    bm = BlockManager(2, B)
    bm.allocate(0, tokens(rng, B + 1))
    bm.fork(0, 1)
    before = snapshot(bm, [0, 1])
    assert bm.num_blocks_needed(1, 1) == 1 and not bm.can_append(1, 1)
    with pytest.raises(NoFreeBlocksError):
        bm.append(1, 1)
    assert snapshot(bm, [0, 1]) == before


# --- prefix caching ---------------------------------------------------------------------------


def test_shared_prompt_hits_full_committed_blocks(rng):
    bm = BlockManager(32, B)
    prompt = tokens(rng, 3 * B + 2)
    assert bm.match_prefix(prompt) == 0
    bm.allocate(0, prompt)
    assert bm.match_prefix(prompt) == 0  # nothing committed yet
    bm.commit(0, prompt)
    assert bm.get_stats().cached == 3
    other = prompt[: 2 * B] + tokens(rng, 5)
    other[2 * B] = prompt[2 * B] + 1  # diverges inside the third block
    assert bm.match_prefix(other) == 2 * B
    assert bm.allocate(1, other) == 2 * B
    assert bm.block_table(1)[:2] == bm.block_table(0)[:2]
    assert bm.block_table(1)[2] != bm.block_table(0)[2]
    assert [bm.ref_count(b) for b in bm.block_table(0)] == [2, 2, 1, 1]
    check_refs(bm, [0, 1])


def test_prefix_hit_is_capped_to_leave_one_token(rng):
    bm = BlockManager(32, B)
    prompt = tokens(rng, 3 * B)
    bm.allocate(0, prompt)
    bm.commit(0, prompt)
    assert bm.match_prefix(prompt) == 2 * B  # 3 full blocks cached, one token must be computed
    assert bm.allocate(1, prompt) == 2 * B
    assert bm.match_prefix(prompt[:1]) == 0
    assert bm.match_prefix(prompt[: B + 1]) == B
    assert bm.match_prefix(prompt[:B]) == 0
    assert bm.match_prefix([]) == 0


def test_prefix_caching_disabled_never_hits(rng):
    bm = BlockManager(16, B, enable_prefix_caching=False)
    prompt = tokens(rng, 3 * B + 1)
    bm.allocate(0, prompt)
    bm.commit(0, prompt)
    assert bm.get_stats().cached == 0
    assert bm.match_prefix(prompt) == 0
    assert bm.allocate(1, prompt) == 0


def test_commit_rejects_more_tokens_than_reserved(rng):
    bm = BlockManager(8, B)
    prompt = tokens(rng, 5)
    bm.allocate(0, prompt)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        bm.commit(0, prompt + [1])


def test_freed_blocks_stay_cached_until_evicted_lru(rng):
    bm = BlockManager(6, B)
    first, second = tokens(rng, 2 * B + 1), tokens(rng, 2 * B + 1)
    for s, prompt in ((0, first), (1, second)):
        bm.allocate(s, prompt)
        bm.commit(s, prompt)
    first_full, second_full = bm.block_table(0)[:2], bm.block_table(1)[:2]
    partials = {bm.block_table(0)[2], bm.block_table(1)[2]}  # never registered
    bm.free(0)  # freed first: least recently used
    bm.free(1)
    assert bm.match_prefix(first) == bm.match_prefix(second) == 2 * B
    assert bm.get_stats() == BlockStats(total=6, free=6, used=0, cached=4, usage=0.0)
    # Never-cached blocks go first, then cached ones in LRU order. Freeing tail first made
    # `first`'s tail block the oldest, so its head block (a shared prefix) outlives it.
    bm.allocate(2, tokens(rng, 3 * B))
    assert set(bm.block_table(2)) == partials | {first_full[1]}
    assert bm.match_prefix(first) == B
    bm.allocate(3, tokens(rng, 1))
    assert bm.block_table(3) == [first_full[0]]
    assert bm.match_prefix(first) == 0
    assert bm.match_prefix(second) == 2 * B
    assert set(second_full).isdisjoint(bm.block_table(2) + bm.block_table(3))
    assert bm.get_stats().cached == 2


def test_allocation_never_evicts_its_own_prefix_hits(rng):
    bm = BlockManager(3, B)
    a, c = tokens(rng, 2 * B), tokens(rng, B)
    for s, prompt in ((0, a), (1, c)):
        bm.allocate(s, prompt)
        bm.commit(s, prompt)
    a_blocks, c_block = list(bm.block_table(0)), bm.block_table(1)[0]
    bm.free(0)
    bm.free(1)  # LRU order: a's tail, a's head, c
    # 2 hits on free cached blocks + 1 fresh block: the fresh one must evict c, not a hit.
    assert bm.allocate(2, a + tokens(rng, 1)) == 2 * B
    assert bm.block_table(2) == a_blocks + [c_block]
    assert bm.match_prefix(c + [1]) == 0
    check_refs(bm, [2])


def test_draft_tokens_are_never_registered(rng):
    bm = BlockManager(16, B)
    prompt = tokens(rng, B + 2)
    bm.allocate(0, prompt)
    bm.commit(0, prompt)
    bm.append(0, 4)  # 2 drafts fill block 1, 2 more spill into block 2
    drafts = tokens(rng, 4)
    accepted = prompt + drafts[:1]  # block 1 holds 3 committed tokens + 1 unverified draft
    bm.commit(0, accepted)
    assert bm.get_stats().cached == 1
    assert bm.match_prefix(prompt + drafts + [7]) == B
    bm.truncate(0, len(accepted))
    bm.append(0, 1)
    final = accepted + tokens(rng, 1)
    bm.commit(0, final)  # now block 1 is full of committed tokens
    assert bm.match_prefix(final + [7]) == 2 * B
    assert bm.get_stats().cached == 2


def test_rewriting_a_truncated_registered_block_unregisters_it(rng):
    bm = BlockManager(16, B)
    old = tokens(rng, 2 * B + 1)
    bm.allocate(0, old)
    bm.commit(0, old)
    assert bm.match_prefix(old) == 2 * B
    bm.truncate(0, B + 1)  # back into block 1, which only seq 0 holds
    assert bm.match_prefix(old) == 2 * B  # its KV is untouched until a write
    bm.append(0, B)  # slots B+1.. of block 1 are about to be overwritten
    assert bm.match_prefix(old) == B
    new = old[: B + 1] + [t + 1 for t in old[B + 1 : 2 * B + 1]]
    bm.commit(0, new)
    assert bm.match_prefix(new) == 2 * B
    assert bm.match_prefix(old) == B
    assert bm.get_stats().cached == 2


def test_hash_collisions_never_return_wrong_blocks(rng, monkeypatch):
    monkeypatch.setattr(
        pagedspec.memory.block_pool, "hash_block_tokens", lambda parent, tokens: b"same"
    )
    bm = BlockManager(32, B)
    a = tokens(rng, 3 * B + 1)
    bm.allocate(0, a)
    bm.commit(0, a)  # only block 0 can own the single hash value
    assert bm.get_stats().cached == 1
    b = [t + 1 for t in a]  # every block differs
    assert bm.match_prefix(b) == 0
    assert bm.allocate(1, b) == 0
    bm.commit(1, b)
    # Same second block after a different first block: the chain must not match.
    c = b[:B] + a[B:]
    assert bm.match_prefix(c) == 0
    # A genuine hit on the one registered block still works, and stops there.
    assert bm.match_prefix(a) == B
    assert bm.allocate(2, a) == B
    assert bm.block_table(2)[0] == bm.block_table(0)[0]
    # Repeated content at every block: a collision must not chain block 0 onto itself.
    bm2 = BlockManager(8, B)
    same = tokens(rng, B)
    bm2.allocate(0, same * 3)
    bm2.commit(0, same * 3)
    assert bm2.match_prefix(same * 3 + [1]) == B


# --- sizing ----------------------------------------------------------------------------------


def test_kv_block_bytes_counts_k_and_v_over_all_layers():
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, block 16, bf16.
    assert kv_block_bytes(30, 3, 64, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert kv_block_bytes(2, 1, 8, 4, torch.float32) == 2 * 2 * 4 * 1 * 8 * 4
    expected = torch.empty(2, 2, 16, 3, 64, dtype=torch.float16)  # K/V, layer, block
    assert kv_block_bytes(2, 3, 64, 16, torch.float16) == expected.nbytes


def test_num_kv_blocks_from_count_or_budget():
    per_block = kv_block_bytes(4, 2, 16, 8, torch.float32)
    assert num_kv_blocks(4, 2, 16, 8, torch.float32, num_blocks=37) == 37
    assert num_kv_blocks(4, 2, 16, 8, torch.float32, memory_bytes=10 * per_block) == 10
    assert num_kv_blocks(4, 2, 16, 8, torch.float32, memory_bytes=11 * per_block - 1) == 10
    assert num_kv_blocks(4, 2, 16, 8, torch.float16, memory_bytes=10 * per_block) == 20


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one"),
        ({"num_blocks": 4, "memory_bytes": 1 << 20}, "exactly one"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"memory_bytes": 100}, "memory_bytes"),
    ],
)
def test_num_kv_blocks_rejects_bad_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        num_kv_blocks(4, 2, 16, 8, torch.float32, **kwargs)


def test_sizing_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_block_bytes(4, 0, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        num_kv_blocks(4, 2, 16, -1, torch.float32, num_blocks=3)

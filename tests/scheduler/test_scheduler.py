"""Scheduler logic on fake sequences and a real BlockManager: no model, no tensors."""

import random

import pytest

from pagedspec.memory import BlockManager
from pagedspec.scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus


def make(num_blocks=64, block_size=16, caching=False, **cfg):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**cfg), bm), bm


def seq(seq_id, n, base=None):
    rng = random.Random(seq_id if base is None else base)
    return Sequence(seq_id, [rng.randrange(1000) for _ in range(n)])


def run_step(sched, lookahead=0, token=7):
    """What the engine does after the forward: commit computed tokens, append a sample."""
    out = sched.schedule(lookahead)
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.seq.token_ids.append(token)
            sched.block_manager.truncate(s.seq.seq_id, s.seq.num_computed_tokens)
    return out


def test_fcfs_admission_respects_max_num_seqs():
    sched, _ = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(i, 5))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sched, _ = make(max_num_batched_tokens=32)
    long = seq(0, 80)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 80:
        out = run_step(sched)
        chunks.append(out.scheduled[0].num_new_tokens)
        assert out.num_batched_tokens <= 32
    assert chunks == [32, 32, 16]
    assert len(long) == 81  # sampled exactly once, at the end of the prompt


def test_decodes_go_first_then_prefill_chunks_in_the_same_step():
    sched, _ = make(max_num_batched_tokens=20)
    a = seq(0, 4)
    sched.add(a)
    run_step(sched)  # a is now decoding
    b = seq(1, 50)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 19)]


def test_lookahead_slots_are_reserved_and_counted():
    sched, bm = make(max_num_batched_tokens=64)
    a = seq(0, 15)
    sched.add(a)
    run_step(sched)
    out = sched.schedule(num_lookahead_slots=4)
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.num_lookahead_slots) == (1, 4)
    assert out.num_batched_tokens == 5
    assert bm.num_tokens(0) == a.num_computed_tokens + 5  # table covers token + 4 drafts
    assert len(bm.block_table(0)) == 2


def test_lookahead_shrinks_to_the_token_budget_and_max_model_len():
    sched, _ = make(max_num_batched_tokens=3, max_model_len=100)
    sched.add(seq(0, 2))
    run_step(sched)
    (s,) = sched.schedule(num_lookahead_slots=8).scheduled
    assert s.num_lookahead_slots == 2
    sched2, _ = make(max_model_len=8)
    sched2.add(seq(1, 6))
    run_step(sched2)  # len 7
    (s,) = sched2.schedule(num_lookahead_slots=8).scheduled
    assert s.num_lookahead_slots == 1


def test_preemption_takes_the_youngest_and_requeues_it_first():
    # Two 32-token prompts fill all 4 blocks of 16; the first decode needs a fifth block and
    # must evict the youngest.
    sched, bm = make(num_blocks=4, block_size=16, max_num_batched_tokens=64)
    a, b = seq(0, 32), seq(1, 32)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert bm.num_free_blocks() == 0
    out = run_step(sched)
    assert [p.seq_id for p in out.preempted] == [1]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and len(b) == 33  # keeps its generated token
    assert [s.seq.seq_id for s in out.scheduled] == [0]
    assert sched.num_preemptions == 1
    sched.finish(a)
    out = run_step(sched)  # b is recomputed from its prompt + generated token
    assert out.scheduled[0].seq is b and out.scheduled[0].num_new_tokens == 33


def test_a_sequence_that_cannot_grow_preempts_itself_when_alone():
    sched, bm = make(num_blocks=2, block_size=16)
    a = seq(0, 32)
    sched.add(a)
    run_step(sched)
    out = sched.schedule()
    assert out.preempted == [a] and out.is_empty
    assert bm.num_free_blocks() == 2


def test_prefix_cache_hits_are_not_recomputed():
    sched, bm = make(caching=True)
    a = seq(0, 40, base=9)
    sched.add(a)
    run_step(sched)
    bm.commit(0, a.token_ids[: a.num_computed_tokens])
    b = seq(1, 40, base=9)  # same prompt
    sched.add(b)
    out = sched.schedule()
    (s,) = [x for x in out.scheduled if x.seq is b]
    assert b.num_computed_tokens == 32 and s.num_new_tokens == 8
    assert sched.num_prefix_cache_hit_tokens == 32


def test_finish_releases_blocks_for_waiting_and_running():
    sched, bm = make(num_blocks=8)
    a, b = seq(0, 20), seq(1, 20)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a)
    sched.finish(b)
    c = seq(2, 5)
    sched.add(c)
    sched.finish(c)  # never admitted
    assert bm.num_free_blocks() == 8 and not sched.has_unfinished()


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_conserves_blocks_and_finishes(seed):
    rng = random.Random(seed)
    sched, bm = make(num_blocks=24, block_size=16, max_num_seqs=6, max_num_batched_tokens=40)
    target = {}
    for i in range(20):
        s = seq(i, rng.randint(1, 60))
        target[i] = len(s) + rng.randint(1, 30)
        sched.add(s)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = run_step(sched, lookahead=rng.randint(0, 3))
        assert out.num_batched_tokens <= 40
        assert len(sched.running) <= 6
        for s in list(sched.running):
            assert bm.num_tokens(s.seq_id) >= s.num_computed_tokens
            if len(s) >= target[s.seq_id]:
                sched.finish(s)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks() == 24


def test_a_prompt_that_will_fork_reserves_its_seats():
    sched, _ = make(max_num_seqs=4)
    parent = seq(0, 5)
    parent.seats = 3  # n = 3 samples once the prompt is done
    sched.add(parent)
    sched.add(seq(1, 5))
    sched.add(seq(2, 5))
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]  # 3 + 1 seats: the third waits


def test_priority_admits_by_priority_and_preempts_the_lowest_first():
    """Under the "priority" policy (lower first, ties by arrival) the waiting queue is admitted
    in that order, and a decode short of blocks preempts the lowest-priority running sequence,
    which rejoins the queue at its place."""
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(policy="lifo")
    sched, bm = make(num_blocks=6, block_size=16, max_num_seqs=3, policy="priority")
    seqs = [seq(i, 32) for i in range(4)]
    for s, priority in zip(seqs, (5, 0, 9, 0), strict=True):
        s.priority = priority
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == [1, 3, 0, 2]
    out = run_step(sched)  # 3 seats: 1, 3 and 0 (6 blocks, all used)
    assert [s.seq.seq_id for s in out.scheduled] == [1, 3, 0]
    assert bm.num_free_blocks() == 0
    out = run_step(sched)  # 1 needs a block: 0 (priority 5) goes, though 3 is younger
    assert [p.seq_id for p in out.preempted] == [0]
    assert [s.seq.seq_id for s in out.scheduled] == [1, 3]
    assert [s.seq_id for s in sched.waiting] == [0, 2]  # 0 ahead of 2, by priority


def test_priority_decodes_in_priority_order_so_a_victim_is_never_scheduled():
    """A high-priority sequence admitted after a low-priority one: its decode, short of a
    block, preempts the older low-priority one, which this step had not scheduled yet."""
    sched, bm = make(num_blocks=4, block_size=16, max_num_batched_tokens=64, policy="priority")
    low, high = seq(0, 24), seq(1, 32)
    low.priority, high.priority = 7, 1
    sched.add(low)
    run_step(sched)
    sched.add(high)
    run_step(sched)  # low decodes in its second block, high's prompt fills the other two
    assert bm.num_free_blocks() == 0
    out = run_step(sched)  # high's decode needs a block first: low goes before it is scheduled
    assert [p.seq_id for p in out.preempted] == [0]
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    assert all(s.seq.status is SequenceStatus.RUNNING for s in out.scheduled)

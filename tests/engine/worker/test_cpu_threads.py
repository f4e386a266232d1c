"""The CPU kernels' thread count: the CPUs this process may use, less those others keep busy."""

from __future__ import annotations

import os

import pytest
import torch

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.worker.cpu_threads import (
    IDLE_S,
    INTERVAL_S,
    ThreadGovernor,
    cpu_limit,
    read_busy,
)

CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({}, CPUS),
        ({"cpu.max": "max 100000\n"}, CPUS),
        ({"cpu.max": "150000 100000\n"}, 1),  # 1.5 CPUs of quota: one thread
        ({"cpu.max": "50000 100000\n"}, 1),  # never below one
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, CPUS),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ],
)
def test_cpu_limit_is_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_limit(tmp_path) == limit


def test_read_busy_counts_this_process_cpus_and_its_own_time(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    mine = sorted(os.sched_getaffinity(0))
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    lines = ["cpu  999 0 999 999 0 0 0 0"]
    lines += [f"cpu{i} {tick} 0 {tick} 5000 700 0 0 0" for i in mine]
    lines.append(f"cpu{max(mine) + 1} {100 * tick} 0 0 0 0 0 0 0")  # not ours: not counted
    (tmp_path / "stat").write_text("\n".join(lines) + "\n")
    (tmp_path / "self").mkdir()
    own = ["S", *["0"] * 10, str(3 * tick), str(tick)]  # utime, stime are fields 14 and 15
    (tmp_path / "self" / "stat").write_text(f"42 (a name) with spaces) {' '.join(own)}\n")
    assert read_busy(tmp_path) == (2.0 * len(mine), 4.0)
    assert read_busy(tmp_path / "missing") is None
    real = read_busy()
    assert real is not None and real[0] >= real[1] > 0


class Fake:
    """A clock and /proc readings, and a governor on them: ``run`` steps the engine (a forward
    every STEP_S) while ``others`` + ``own`` cores are busy; ``wait`` passes time with no
    forward."""

    STEP_S = IDLE_S / 4  # a power-of-two fraction of a second: the clock adds up exactly

    def __init__(self, limit: int) -> None:
        self.now, self.busy, self.own, self.threads = 0.0, 0.0, 0.0, []
        self.governor = ThreadGovernor(limit, lambda: (self.busy, self.own), lambda: self.now,
                                       self.threads.append)  # fmt: skip

    def wait(self, seconds: float, others: float) -> None:
        self.now += seconds
        self.busy += seconds * others

    def run(self, seconds: float, others: float, own: float, step: float | None = None) -> None:
        """Forwards of ``step`` seconds (default STEP_S) back to back."""
        step = step or self.STEP_S
        for _ in range(round(seconds / step)):
            self.governor.tick()
            self.wait(step, others + own)
            self.own += step * own
            self.governor.done()


def test_the_governor_gives_up_the_cores_other_processes_keep_busy():
    fake = Fake(4)
    assert fake.threads == [4]
    fake.run(INTERVAL_S / 2, others=1.6, own=2.4)  # too soon: no reading yet
    assert fake.threads == [4]
    fake.run(INTERVAL_S / 2, others=1.6, own=2.4)  # 4 - 1.6 = 2.4 free: 2
    fake.run(INTERVAL_S, others=0.4, own=2.0)  # 3.6 free: 4
    fake.run(INTERVAL_S, others=0.5, own=3.5)  # 3.5 free: 4 (rounded)
    fake.run(INTERVAL_S, others=9.0, own=1.0)  # nothing free: one
    fake.governor.tick()  # (a phase's reading is taken as the next forward starts)
    assert fake.threads == [4, 2, 4, 4, 1]
    assert fake.governor.threads == 1


def test_the_governor_does_not_judge_by_the_load_while_it_was_idle():
    fake = Fake(2)
    fake.run(INTERVAL_S / 2, others=0.0, own=2.0)
    fake.wait(IDLE_S * 2, others=2.0)  # no forward while another process ran
    fake.run(INTERVAL_S / 2, others=0.0, own=2.0)  # a new interval started: no reading yet
    assert fake.threads == [2]
    fake.run(INTERVAL_S, others=0.0, own=2.0)
    assert fake.threads == [2, 2]


def test_slow_forwards_are_not_idle_spells():
    """Forwards longer than IDLE_S back to back: the load is still read (idle is the time
    between forwards), so the count comes back once a neighbour leaves."""
    fake = Fake(2)
    fake.run(INTERVAL_S * 2, others=1.0, own=1.0)  # a neighbour: one thread
    fake.run(IDLE_S * 12, others=0.0, own=1.0, step=IDLE_S * 2)  # it left; slow forwards
    assert fake.threads[-1] == 2


def test_a_quota_below_the_mask_leaves_the_spare_cpus_to_others():
    """2 CPUs of quota on a 64-CPU mask: 8 cores busy elsewhere take none of ours."""
    fake = Fake(2)
    fake.governor.spare = 62
    fake.run(INTERVAL_S * 2, others=8.0, own=2.0)
    assert fake.threads[1:] and fake.threads[-1] == 2 and fake.governor.threads == 2


def test_the_governor_keeps_its_count_when_proc_cannot_tell():
    calls = []
    now = [0.0]
    governor = ThreadGovernor(2, lambda: None, lambda: now[0], calls.append)
    now[0] = 10 * INTERVAL_S
    governor.tick()
    assert calls == [2] and governor.threads == 2


def test_num_threads_fixes_the_count_and_the_default_follows_the_load(tiny_llama):
    from pagedspec import LLM

    with pytest.raises(ValueError, match="num_threads must be an integer >= 1, got 0"):
        EngineConfig(model=tiny_llama, num_threads=0)
    before = torch.get_num_threads()
    try:
        fixed = LLM(tiny_llama, num_kv_blocks=16, num_threads=1)
        assert torch.get_num_threads() == 1 and fixed.llm_engine.runner.threads is None
        governed = LLM(tiny_llama, num_kv_blocks=16)
        assert isinstance(governed.llm_engine.runner.threads, ThreadGovernor)
        assert governed.llm_engine.runner.threads.limit == cpu_limit()
    finally:
        torch.set_num_threads(before)

"""How many threads the CPU kernels run on: the CPUs this process may use, less those other
processes keep busy.

Each kernel splits an op's work evenly over its threads and waits for the last one. A thread
that shares its core with another busy process gets about half of it, and every op then waits
for that thread: on a 2-core machine one busy neighbour cut throughput to 0.2x with 2 threads,
where 1 thread kept 0.6x (``benchmarks/contention.py``). So, unless the user fixes the count
(``EngineConfig.num_threads``), a ``ThreadGovernor`` sets it (``torch.set_num_threads``, which
the kernels read per call):

- at most ``cpu_limit()``: the CPUs of the affinity mask, and no more than the cgroup's CPU
  quota pays for (a container on a big host);
- re-read at most every ``INTERVAL_S`` (``tick``, once per forward): fewer by the cores that
  other processes kept busy on those CPUs over the last interval (``/proc/stat`` less this
  process's own CPU time), never below 1; an interval over an idle spell (no forward for
  ``IDLE_S``) is not used.

Off Linux (no ``/proc``) it keeps ``cpu_limit()`` threads.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

INTERVAL_S = 0.5
# No forward for this long: the engine waited (for requests, or while another process ran),
# so the last reading is stale. (While forwards take longer than this, the count stays put.)
IDLE_S = 0.25
# The free cores are rounded (2 - 0.4 busy elsewhere: 2 threads; 2 - 0.6: 1): a thread with
# half a core or less makes the others wait for it longer than its work would take them.
SLACK = 0.5
CGROUP = Path("/sys/fs/cgroup")
PROC = Path("/proc")


def affinity() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cpus or 1


def cpu_limit(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may run on (affinity mask), capped by the cgroup's CPU quota."""
    cpus, quota = affinity(), _cgroup_quota(cgroup)
    return max(1, min(cpus, math.floor(quota) if quota is not None else cpus))


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPUs' worth of quota (v2 ``cpu.max``, else v1 ``cpu.cfs_*``); None: unlimited."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def read_busy(proc: Path = PROC) -> tuple[float, float] | None:
    """(CPU-seconds all processes spent on this process's CPUs, CPU-seconds this process
    spent), since boot; None where /proc cannot tell."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy = 0
        for line in (proc / "stat").read_text().splitlines():
            name, *fields = line.split()
            if name in mine:  # user nice system idle iowait irq softirq steal ...
                values = [int(v) for v in fields[:8]]
                busy += sum(values) - values[3] - values[4]
        # /proc/self/stat: the command name (field 2) may hold spaces; utime, stime follow it.
        own = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        return busy / tick, (int(own[11]) + int(own[12])) / tick
    except (OSError, ValueError, AttributeError, IndexError):
        return None


class ThreadGovernor:
    """Sets the kernels' thread count from what the CPUs have free (see the module)."""

    def __init__(
        self,
        limit: int,
        read: Callable[[], tuple[float, float] | None] = read_busy,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        spare: int = 0,
    ) -> None:
        """``spare``: CPUs of the affinity mask beyond ``limit`` (a quota below the mask):
        other processes may keep that many busy without taking any of ours."""
        self.limit, self.spare = limit, spare
        self._read, self._clock, self._set = read, clock, set_threads
        self.threads = limit
        self._set(limit)
        self._restart(clock())

    def tick(self) -> None:
        """Before a forward: re-read the load once ``INTERVAL_S`` has passed since the last
        reading (after an idle spell, ``IDLE_S`` since the last forward ended, start a new
        interval: the load while idle says nothing about now)."""
        now = self._clock()
        if now - self._ended > IDLE_S:
            self._restart(now)
        if now < self._next:
            return
        busy = self._read()
        (then, before), self._last, self._next = self._last, (now, busy), now + INTERVAL_S
        if busy is None or before is None or now <= then:
            return
        others = ((busy[0] - before[0]) - (busy[1] - before[1])) / (now - then) - self.spare
        self.threads = max(1, min(self.limit, math.floor(self.limit - others + SLACK)))
        self._set(self.threads)  # each time: another engine in the process may have set its own

    def done(self) -> None:
        """After a forward."""
        self._ended = self._clock()

    def _restart(self, now: float) -> None:
        self._last, self._next, self._ended = (now, self._read()), now + INTERVAL_S, now

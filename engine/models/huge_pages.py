"""Memory for a model's CPU weight packs on 2 MB pages: one mapping, handed out front to back.

A batch-1 decode streams every weight once per step. Through 4 KB pages that is a TLB miss
every 4 KB and a hardware prefetcher stopped at every page boundary; through Linux's
transparent huge pages (2 MB) neither. On the AVX2 dev VM (THP in its common "madvise" mode,
which backs only memory advised MADV_HUGEPAGE with huge pages) the Q8_0 GEMVs of the default
model's 30 layers and LM head took 6.7-6.8 ms instead of 7.5-7.7 ms (min of 40 alternating
passes), and a whole batch-1 decode step 5-6% less in int8 and float32 (two engines in one
process, their steps alternating). llama.cpp gets the same from ``mmap``-ing one weights
buffer. torch's ``THP_MEM_ALLOC_ENABLE`` covers only tensors of 2 MB or more (none of an int8
layer's packs) and must be set before torch first allocates.

The loader allocates here what becomes a pack: a float weight that is packed in place, and a
quantised weight's packs. Nothing is copied, so loading's peak memory does not grow, and a
page becomes memory only when first written.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line, as torch's allocator places it
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
    """Linux with transparent huge pages not switched off ("[never]")."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class WeightArena:
    """``capacity`` bytes of one anonymous mapping advised MADV_HUGEPAGE, from a 2 MB boundary.

    ``empty`` hands out tensors back to back (each ALIGN-aligned); what no longer fits, and
    everything where huge pages are unavailable or the mapping is refused, gets ordinary
    ``torch.empty`` memory. The mapping lives as long as any tensor from it (so one pack kept
    after ``unpack`` or ``.to()`` keeps all of it), and memory once handed out is not reused."""

    def __init__(self, capacity: int) -> None:
        self._arena: torch.Tensor | None = None
        self._next = 0
        if capacity > 0 and huge_pages_available():
            # 2 MB of slack to start on a boundary; pages never written cost no memory
            try:
                region = mmap.mmap(-1, capacity + HUGE_PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError:  # refused (overcommit): ordinary memory then
                return
            region.madvise(mmap.MADV_HUGEPAGE)
            self._arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps it mapped
            self._next = -self._arena.data_ptr() % HUGE_PAGE

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor, from the mapping while it has room."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._arena is None or self._next + nbytes > self._arena.numel():
            return torch.empty(shape, dtype=dtype)
        view = self._arena[self._next : self._next + nbytes].view(dtype).view(shape)
        self._next += aligned(nbytes)
        return view

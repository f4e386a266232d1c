"""The physical side of the KV cache: per-block ref counts, the free pool and the prefix-cache map.

Free blocks live in one of two pools:
  * plain  - free blocks carrying no prefix-cache registration (a stack: O(1) push/pop);
  * cached - free blocks still registered in the prefix cache, in LRU order (an OrderedDict, so
    a prefix hit can take one out of the middle in O(1)).
New blocks come from the plain pool first; only when it is empty is the least recently freed cached
block evicted (its registration dropped). Invariant: ref[b] == 0 <=> b is in exactly one pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

# Parent hash of a sequence's first block. Empty, so no 16-byte digest can equal it.
ROOT_HASH = b""


def hash_block_tokens(parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Chained hash of one full block: identifies its tokens *and* every token before them.

    A cryptographic hash (blake2b, 128 bits) rather than Python's `hash`: tuples of ints have
    easily crafted collisions, and a colliding prefix would hand one request another's KV.
    """
    data = parent_hash + array("q", token_ids).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


class NoFreeBlocksError(RuntimeError):
    """Not enough free KV blocks for the request; the manager's state is unchanged."""


class BlockPool:
    """Ref counts, free pools and the hash -> block map. Knows nothing about sequences."""

    __slots__ = ("num_blocks", "ref", "_plain", "_cached", "_cache", "_block_hash", "_block_key")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._plain = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._cache: dict[bytes, int] = {}  # chained hash -> the one block registered under it
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # (parent hash, token ids) of each registered block: checked on every hit, so even a
        # hash collision can never return a block whose content differs from the request's.
        self._block_key: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks

    def num_free(self) -> int:
        return len(self._plain) + len(self._cached)

    def num_registered(self) -> int:
        return len(self._cache)

    def is_registered(self, block: int) -> bool:
        return self._block_hash[block] is not None

    def allocate(self) -> int:
        """Hand out a free block with ref 1 and no registration; the caller checked num_free()."""
        if self._plain:
            block = self._plain.pop()
        else:
            block, _ = self._cached.popitem(last=False)  # evict the least recently freed
            self._drop_registration(block)
        self.ref[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """One more table entry holds `block`; a free block must be a cached one (a prefix hit)."""
        if self.ref[block] == 0:
            del self._cached[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """One table entry fewer holds `block`; at ref 0 it joins a free pool (cached: MRU end)."""
        ref = self.ref[block] - 1
        self.ref[block] = ref
        if ref == 0:
            if self._block_hash[block] is None:
                self._plain.append(block)
            else:
                self._cached[block] = None

    def forget(self, block: int) -> None:
        """Drop a *held* block's registration: its owner is about to overwrite some of its slots."""
        if self._block_hash[block] is not None:
            self._drop_registration(block)

    def lookup(self, parent_hash: bytes, token_ids: tuple[int, ...]) -> tuple[bytes, int | None]:
        """(chained hash, the registered block with exactly this parent and tokens, or None)."""
        block_hash = hash_block_tokens(parent_hash, token_ids)
        block = self._cache.get(block_hash)
        if block is not None and self._block_key[block] != (parent_hash, token_ids):
            block = None  # hash collision: different content under the same hash
        return block_hash, block

    def register(self, block: int, parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
        """Register a held, full block's content; returns its chained hash.

        A block that is already registered, or content already registered on another block
        (a duplicate computed before the first was committed), is left as it is.
        """
        block_hash = hash_block_tokens(parent_hash, token_ids)
        if self._block_hash[block] is None and block_hash not in self._cache:
            self._cache[block_hash] = block
            self._block_hash[block] = block_hash
            self._block_key[block] = (parent_hash, token_ids)
        return block_hash

    def _drop_registration(self, block: int) -> None:
        # register() only maps a hash to a block while that block carries it, so this is exact.
        del self._cache[self._block_hash[block]]
        self._block_hash[block] = None
        self._block_key[block] = None

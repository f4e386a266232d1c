"""Per-sequence block tables over a BlockPool: admission with prefix caching, growth with
copy-on-write, rollback, fork and free. Pure bookkeeping: it never touches KV memory.

Invariants (checked by tests/memory/test_block_manager_properties.py):
  * len(table) == ceil(num_tokens / block_size) for every sequence;
  * a block's ref count == the number of table entries holding it; ref 0 <=> free;
  * a sequence's chain of prefix hashes covers only full blocks of tokens it committed, and a
    registered block's slots are never written while registered.

Errors: unknown sequence ids raise KeyError; bad arguments raise ValueError; running out of
blocks raises NoFreeBlocksError (a RuntimeError). Every failing call leaves the state unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedspec.memory.block_pool import ROOT_HASH, BlockPool, NoFreeBlocksError
from pagedspec.memory.slots import slot_of


@dataclass(frozen=True, slots=True)
class BlockStats:
    total: int
    free: int  # ref 0, including evictable cached blocks
    used: int  # ref > 0
    cached: int  # registered in the prefix cache, held or free
    usage: float  # used / total


class _Seq:
    __slots__ = ("table", "num_tokens", "hashes", "frozen")

    def __init__(self, table: list[int], num_tokens: int, hashes: list[bytes]) -> None:
        self.table = table
        self.num_tokens = num_tokens
        # Chained hashes of the first len(hashes) blocks, all full and committed.
        self.hashes = hashes
        # tuple(table) while the table is unchanged (None: made on the next request); every
        # change of the table drops it
        self.frozen: tuple[int, ...] | None = None


class BlockManager:
    """Paged KV block tables for many sequences sharing one pool of `num_blocks` blocks."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks)
        self._seqs: dict[int, _Seq] = {}

    # --- queries ---------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (ref 0), including evictable cached ones."""
        return self._pool.num_free()

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's live block table (not a copy): callers must not mutate it."""
        return (self._seqs.get(seq_id) or self._seq(seq_id)).table

    def frozen_table(self, seq_id: int) -> tuple[int, ...]:
        """The sequence's block table as a tuple, made once per change of the table (a decode's
        changes once every ``block_size`` tokens): a snapshot a step can hold."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        if seq.frozen is None:
            seq.frozen = tuple(seq.table)
        return seq.frozen

    def num_tokens(self, seq_id: int) -> int:
        """Slots reserved for the sequence: its logical length, lookahead slots included."""
        return self._seq(seq_id).num_tokens

    def get_stats(self) -> BlockStats:
        free = self._pool.num_free()
        used = self.num_blocks - free
        return BlockStats(
            total=self.num_blocks,
            free=free,
            used=used,
            cached=self._pool.num_registered(),
            usage=used / self.num_blocks,
        )

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks}), got {block_id}")
        return self._pool.ref[block_id]

    # --- admission -------------------------------------------------------------------------

    def can_allocate(self, token_ids: Sequence[int], reuse: bool = True) -> bool:
        """Whether allocate() would succeed for a prompt of these tokens (prefix hits counted)."""
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        hits, _ = self._match(token_ids) if reuse else ([], [])
        return self._blocks_to_allocate(len(token_ids), hits) <= self._pool.num_free()

    def allocate(self, seq_id: int, token_ids: Sequence[int], reuse: bool = True) -> int:
        """Create a sequence whose table covers len(token_ids) slots; return its cached tokens.

        Reuses registered blocks for the longest cached prefix of full blocks (unless not
        ``reuse``: its every token is computed), capped so that at least one token is left to
        compute. The engine writes KV for positions [returned, len).
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} already exists")
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        hits, hashes = self._match(token_ids) if reuse else ([], [])
        needed = self._blocks_to_allocate(len(token_ids), hits)
        if needed > self._pool.num_free():
            raise NoFreeBlocksError(
                f"seq_id {seq_id} needs {needed} free blocks, {self._pool.num_free()} free"
            )
        pool = self._pool
        for block in hits:  # before allocating, so eviction cannot take a hit block
            pool.acquire(block)
        num_blocks = -(-len(token_ids) // self.block_size)
        table = hits + [pool.allocate() for _ in range(num_blocks - len(hits))]
        self._seqs[seq_id] = _Seq(table, len(token_ids), hashes)
        return len(hits) * self.block_size

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Cached tokens allocate(token_ids) would reuse now; changes nothing."""
        return len(self._match(token_ids)[0]) * self.block_size

    # --- growth ----------------------------------------------------------------------------

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks append(seq_id, num_new_tokens) would consume (new blocks + a CoW copy)."""
        seq = self._seq(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self._append_cost(seq, num_new_tokens)

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_new_tokens) <= self._pool.num_free()

    def append(self, seq_id: int, num_new_tokens: int) -> tuple[int, int] | None:
        """Grow the sequence by `num_new_tokens` slots, allocating blocks as needed.

        Returns (src_block, dst_block) when the last block was shared and partially filled: the
        table now points at dst, and the engine must copy src's KV to dst before writing. Else
        None. Raises NoFreeBlocksError (changing nothing) if the pool is short.
        """
        seq = self._seq(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return None
        return self._grow(seq_id, seq, num_new_tokens)

    def reserve(self, seq_id: int, num_tokens: int) -> tuple[int, int] | None:
        """``append`` as many slots as the table lacks to cover ``num_tokens`` (none if it
        covers them already: it never shrinks)."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        extra = num_tokens - seq.num_tokens
        return self._grow(seq_id, seq, extra) if extra > 0 else None

    def _grow(self, seq_id: int, seq: _Seq, num_new_tokens: int) -> tuple[int, int] | None:
        pool = self._pool
        size = self.block_size
        table = seq.table
        old_len = seq.num_tokens
        new_len = old_len + num_new_tokens
        num_new_blocks = -(-new_len // size) - len(table)
        writes_into_last = old_len % size != 0
        cow = writes_into_last and pool.ref[table[-1]] > 1
        if num_new_blocks + cow and num_new_blocks + cow > pool.num_free():
            raise NoFreeBlocksError(
                f"seq_id {seq_id} needs {num_new_blocks + cow} free blocks, {pool.num_free()} free"
            )
        copy = None
        if cow:
            src = table[-1]
            dst = pool.allocate()
            pool.release(src)  # ref was > 1: src stays held by the other sequences
            table[-1] = dst
            copy = (src, dst)
            seq.frozen = None
        elif writes_into_last:
            # Sole owner about to overwrite slots past its (truncated) length: any registration
            # of this block would describe content that is about to change.
            pool.forget(table[-1])
        if num_new_blocks:
            table.extend([pool.allocate() for _ in range(num_new_blocks)])
            seq.frozen = None
        seq.num_tokens = new_len
        return copy

    def slot_ids(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slot ids (block * block_size + offset) of logical positions [start, end)."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"need 0 <= start <= end <= num_tokens ({seq.num_tokens}), got [{start}, {end})"
            )
        return [slot_of(seq.table, pos, self.block_size) for pos in range(start, end)]

    # --- rollback / lifecycle --------------------------------------------------------------

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll the sequence back to `num_tokens` slots. Blocks wholly past the end are released
        (freed only if no other sequence holds them); the partly used last block is kept and its
        stale slots are overwritten by later appends. Never touches KV memory."""
        self._truncate(seq_id, self._seq(seq_id), num_tokens)

    def _truncate(self, seq_id: int, seq: _Seq, num_tokens: int) -> None:
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"num_tokens must be in [0, {seq.num_tokens}] for seq_id {seq_id}, got {num_tokens}"
            )
        if num_tokens == seq.num_tokens:
            return
        keep = -(-num_tokens // self.block_size)
        table = seq.table
        if keep < len(table):  # (a rollback within the last block changes no entry)
            release = self._pool.release
            for index in range(len(table) - 1, keep - 1, -1):
                release(table[index])
            del table[keep:]
            seq.frozen = None
        del seq.hashes[num_tokens // self.block_size :]
        seq.num_tokens = num_tokens

    def keep(
        self, seq_id: int, num_tokens: int | None, token_ids: Sequence[int], num_cacheable: int
    ) -> None:
        """After a step: ``truncate`` to ``num_tokens`` slots (None: keep them all), then
        ``commit`` the full blocks of ``token_ids[:num_cacheable]``; one call, cheap when
        neither has anything to do (the engine makes it for every sequence every step)."""
        seq = self._seqs.get(seq_id) or self._seq(seq_id)
        if num_tokens is not None and num_tokens != seq.num_tokens:
            self._truncate(seq_id, seq, num_tokens)
        if self.enable_prefix_caching and num_cacheable // self.block_size > len(seq.hashes):
            self.commit(seq_id, token_ids, num_cacheable)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Create `child_id` sharing all of the parent's blocks (copy-on-write on append)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id} already exists")
        for block in parent.table:
            self._pool.acquire(block)
        self._seqs[child_id] = _Seq(list(parent.table), parent.num_tokens, list(parent.hashes))

    def free(self, seq_id: int) -> None:
        """Release all of the sequence's blocks, tail first: under LRU eviction, shared prefix
        blocks then outlive the sequence's private tail."""
        seq = self._seq(seq_id)
        release = self._pool.release
        for block in reversed(seq.table):
            release(block)
        del self._seqs[seq_id]

    # --- prefix caching --------------------------------------------------------------------

    def commit(self, seq_id: int, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """Register every full block inside `token_ids[:num_tokens]` not yet registered by this
        sequence (`num_tokens` defaults to all of them).

        Those are the sequence's committed tokens whose KV has been computed (prompt plus
        accepted outputs): a prefix of what its table holds. Never pass draft tokens: a block
        registered here is served to other requests as computed, verified KV.
        """
        seq = self._seq(seq_id)
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= min(len(token_ids), seq.num_tokens):
            raise ValueError(
                f"num_tokens must be in [0, {min(len(token_ids), seq.num_tokens)}] for seq_id "
                f"{seq_id}, got {num_tokens}"
            )
        size = self.block_size
        hashes = seq.hashes
        num_full = num_tokens // size
        if not self.enable_prefix_caching or num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else ROOT_HASH
        for index in range(len(hashes), num_full):
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            parent = self._pool.register(seq.table[index], parent, tokens)
            hashes.append(parent)

    # --- internals -------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Seq:
        """(Hot paths read ``self._seqs.get(seq_id) or self._seq(seq_id)``: no call when known.)"""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq_id {seq_id}") from None

    def _match(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Registered blocks (and their hashes) for the longest cached prefix of full blocks,
        at most (len - 1) // block_size of them so that one token is always computed."""
        blocks: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        size = self.block_size
        parent = ROOT_HASH
        for index in range((len(token_ids) - 1) // size):
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            parent, block = self._pool.lookup(parent, tokens)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def _blocks_to_allocate(self, num_tokens: int, hits: list[int]) -> int:
        """Free blocks an allocation consumes: fresh blocks plus hits that are currently free."""
        fresh = -(-num_tokens // self.block_size) - len(hits)
        return fresh + sum(1 for block in hits if self._pool.ref[block] == 0)

    def _append_cost(self, seq: _Seq, num_new_tokens: int) -> int:
        if num_new_tokens == 0:
            return 0
        size = self.block_size
        new_blocks = -(-(seq.num_tokens + num_new_tokens) // size) - len(seq.table)
        cow = seq.num_tokens % size != 0 and self._pool.ref[seq.table[-1]] > 1
        return new_blocks + cow

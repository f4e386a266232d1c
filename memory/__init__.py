"""Paged KV memory: block pool, per-sequence block tables, prefix caching and KV sizing."""

from pagedspec.memory.block_manager import BlockManager, BlockStats
from pagedspec.memory.block_pool import NoFreeBlocksError
from pagedspec.memory.kv_cache import allocate_kv_caches, kv_block_bytes, num_kv_blocks
from pagedspec.memory.slots import slot_mapping, slot_of

__all__ = [
    "BlockManager",
    "BlockStats",
    "NoFreeBlocksError",
    "allocate_kv_caches",
    "kv_block_bytes",
    "num_kv_blocks",
    "slot_mapping",
    "slot_of",
]

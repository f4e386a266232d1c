"""The slot formula, in one place: logical position p of a sequence whose block table is T
lives in KV slot ``T[p // block_size] * block_size + p % block_size``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    """The slot of one position of the sequence whose block table is ``table``."""
    return table[position // block_size] * block_size + position % block_size


def slot_mapping(
    tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Slot of each ``positions[t]`` of the sequence whose block table is ``tables[rows[t]]``
    (``tables``: [S, W] block ids, rows padded past their length)."""
    return tables[rows, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )

"""Tree masks for paged attention's ``tree_mask``: which earlier tokens of a span each token
sees when the span is a token tree (speculative decoding's draft trees), one bit per token."""

from collections.abc import Sequence

MAX_TREE_TOKENS = 64  # a tree_mask entry has one bit per span token


def tree_mask_of(parents: Sequence[int]) -> list[int]:
    """paged_attention's tree_mask entries (int64 values) for a span whose token j has parent
    token ``parents[j]`` (< j; -1 for the first token only): each token sees its ancestors and
    itself."""
    if len(parents) > MAX_TREE_TOKENS:
        raise ValueError(f"a tree span holds at most {MAX_TREE_TOKENS} tokens, got {len(parents)}")
    bits: list[int] = []
    for j, parent in enumerate(parents):
        if (parent < 0) != (j == 0) or parent >= j:
            raise ValueError(f"parents[{j}] must be in [0, {j}) (-1 for token 0), got {parent}")
        bits.append((bits[parent] if parent >= 0 else 0) | 1 << j)
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]

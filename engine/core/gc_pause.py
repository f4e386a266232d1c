"""A step's objects and CPython's cycle collector.

A decode step makes about ten small objects per sequence (its scheduled part, its span, the
sampled tokens, its output) that live until the step ends and are freed by reference counts:
they form no cycles. CPython's collector still runs after every 700 net allocations and walks
every young object alive at that moment, so a batch-256 step set it off about three times, each
walking the step's live objects (a tenth of the step's time). A step therefore runs with
collection deferred: the collector resumes as it returns, and its next pass finds the step's
temporaries gone and walks only what survived (the outputs). Nothing is left uncollected: the
allocation count still grows while paused, and the first allocation after the step collects.

The collector is process-wide: other threads allocate with it paused while a step runs, and a
caller that pauses it for its own reasons should not do so from another thread mid-step.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def collection_deferred(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with the cycle collector paused while it runs (left as it is where the caller, or
    another thread's step, has paused it already)."""

    @functools.wraps(fn)
    def deferred(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        try:  # (disabled inside: an interrupt landing just after it still re-enables)
            gc.disable()
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return deferred

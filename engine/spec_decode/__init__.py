"""Speculative decoding: the speculation round (``Speculation``: draft slots, drafts into the
step's spans, their verification, the drafters' state) and its proposers (n-gram, draft model,
EAGLE head). It plugs into the step through the round interface of ``sample.round``; it never
sees the engine loop, and the engine loads it only when speculation is on. ``rejection_sample``
(``sample.rejection``) is re-exported here, the name the design's contract gives it."""

from pagedspec.engine.sample.rejection import rejection_sample, verify_deterministic_drafts
from pagedspec.engine.spec_decode.ngram import propose_ngram

__all__ = ["propose_ngram", "rejection_sample", "verify_deterministic_drafts"]

"""Speculative decoding: draft proposers and the lossless rejection sampler."""

from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.rejection import rejection_sample, verify_deterministic_drafts

__all__ = ["propose_ngram", "rejection_sample", "verify_deterministic_drafts"]

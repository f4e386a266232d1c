"""Speculative decoding: draft proposers and the lossless rejection sampler."""

from pagedspec.engine.sample.rejection import rejection_sample, verify_deterministic_drafts
from pagedspec.engine.spec_decode.ngram import propose_ngram

__all__ = ["propose_ngram", "rejection_sample", "verify_deterministic_drafts"]

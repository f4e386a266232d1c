"""Logit rows to tokens: the step sampler, sampling and its draws, penalties, raw logprobs,
sample jobs, grammar masks, rejection sampling of drafts, and the round of a step without
speculation (``round``). It knows spans and sequences, never the engine loop or a proposer."""

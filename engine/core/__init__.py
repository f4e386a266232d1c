"""The loop: ``LLMEngine`` (add, step, abort), the async step, the commit of a step's tokens,
building the engine's parts from a config, graph-capture policy, request validation and
output processing. It owns the order of a step; what a step computes it asks the rooms below
(scheduler, worker, sample, spec_decode). Nothing below imports it."""

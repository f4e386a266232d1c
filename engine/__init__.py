"""The serving engine, in rooms by job. Highest layer first; a room imports only rooms below
it (the import-linter contract in pyproject.toml says the same, and ``make lint`` checks it):

- ``tools``: offline tools on top of the engine (the EAGLE trainer)
- ``serve``: the OpenAI-compatible HTTP server
- ``entrypoints``: ``LLM`` and the offline ``generate`` / ``bench`` commands
- ``core``: the loop (``LLMEngine``, the async step, the commit, building the parts)
- ``spec_decode``: the speculation round and its proposers
- ``sample``: logit rows to tokens (sampler, penalties, grammar masks, rejection sampling) and
  the plain step's round
- ``worker``: running the model (runner, spans, CUDA graphs, CPU threads, tensor-parallel ranks)
- ``loader``: weights from HF folders and GGUF files
- ``models``: the model definitions
- ``distributed``: joining ranks and which shard a rank holds
- ``request``: the engine's record of a request and its samples
- the public types: ``config``, ``sampling_params``, ``structured_params``, ``outputs``

The public API is re-exported by ``pagedspec``.
"""

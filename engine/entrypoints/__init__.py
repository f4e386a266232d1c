"""What a user calls: ``LLM`` (offline batches and chat), ``pagedspec generate`` (a file of
prompts) and ``pagedspec bench`` (offline throughput). Built on ``core``; the server sits
above it."""

"""Weights into models: HF folders (safetensors), GGUF files, the default model. It builds
``models`` and shards them for tensor parallelism; it never runs them."""

"""pagedspec's public API.

The names load on first use (PEP 562): ``python -m engine.serve --help`` and the scripts' flag
errors then answer without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, SpeculativeConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
    from engine.sampling_params import RequestOutputKind, SamplingParams
    from engine.structured_params import StructuredOutputsParams

_MODULES = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.outputs",
    "LLMEngine": "engine.llm_engine",
    "Logprob": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
    "SpeculativeConfig": "engine.config",
    "StructuredOutputsParams": "engine.structured_params",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)

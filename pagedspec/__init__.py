"""pagedspec: paged-KV LLM serving with Triton kernels and lossless speculative decoding.

The public API. The names load on first use (PEP 562): ``pagedspec serve --help`` and the
scripts' flag errors then answer without importing torch. The sub-packages are ``engine``
(the serving engine, in rooms by job: see its docstring), ``scheduler``, ``memory`` and
``kernels``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedspec.engine.config import EngineConfig, SpeculativeConfig
    from pagedspec.engine.core.llm_engine import LLMEngine
    from pagedspec.engine.entrypoints.llm import LLM
    from pagedspec.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
    from pagedspec.engine.sampling_params import RequestOutputKind, SamplingParams
    from pagedspec.engine.structured_params import StructuredOutputsParams

__version__ = "0.1.0"

_MODULES = {
    "LLM": "pagedspec.engine.entrypoints.llm",
    "CompletionOutput": "pagedspec.engine.outputs",
    "EngineConfig": "pagedspec.engine.config",
    "EngineStats": "pagedspec.engine.outputs",
    "LLMEngine": "pagedspec.engine.core.llm_engine",
    "Logprob": "pagedspec.engine.outputs",
    "RequestOutput": "pagedspec.engine.outputs",
    "RequestOutputKind": "pagedspec.engine.sampling_params",
    "SamplingParams": "pagedspec.engine.sampling_params",
    "SpeculativeConfig": "pagedspec.engine.config",
    "StructuredOutputsParams": "pagedspec.engine.structured_params",
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
        raise AttributeError(f"module 'pagedspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)

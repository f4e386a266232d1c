"""pagedspec's public API."""

from engine.config import EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SpeculativeConfig",
]

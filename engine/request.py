"""Engine-side state of a request and of each of its n sample sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from scheduler import Sequence


@dataclass
class SampleState:
    """One of a request's n samples: its sequence, text so far and finish state.

    ``text`` is everything decoded so far (cut at a stop string once one matched); what a caller
    sees of an unfinished sample may hold back its tail (``OutputProcessor``).
    """

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's private copy
    samples: list[SampleState] = field(default_factory=list)
    error: str | None = None  # why the engine aborted it, when a step failed on it

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

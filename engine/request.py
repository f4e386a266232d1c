"""Engine-side state of a request and of each of its n sample sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from scheduler import Sequence


@dataclass
class SampleState:
    """One of a request's n samples: its sequence, RNG, text so far and finish state."""

    index: int
    seq: Sequence
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> CompletionOutput:
        seq = self.seq
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=seq.token_ids[seq.num_prompt_tokens :],
            finish_reason=self.finish_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            stop_reason=self.stop_reason,
        )


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)
    finished: bool = False

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.samples],
            finished=self.finished,
        )

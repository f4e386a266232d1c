"""Engine-side state of a request and of each of its n sample sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedspec.engine.sampling_params import SamplingParams, greedy_from
from pagedspec.scheduler import Sequence


class Draft(Protocol):
    """What speculation keeps about a sequence (``pagedspec.engine.spec_decode.draft_state``)."""

    def fork(self) -> Draft:
        """The copy a forked sample starts with."""
        ...


class Detokenizer(Protocol):
    """Token ids to text, one token at a time (``pagedspec.engine.core.detokenizer``)."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class SampleState:
    """The one record the engine keeps per sequence (``seq.owner``): one of a request's n
    samples, its text so far, finish state, and what speculation keeps about it (``draft``).
    Forking a sample copies ``draft``; nothing about a sequence lives anywhere else above the
    scheduler and the block manager, so retiring it is dropping the record.

    ``text`` is everything decoded so far (cut at a stop string once one matched); what a caller
    sees of an unfinished sample may hold back its tail (``OutputProcessor``).
    """

    __slots__ = (
        "request",
        "index",
        "seq",
        "detokenizer",
        "text",
        "finish_reason",
        "stop_reason",
        "logprobs",
        "cumulative_logprob",
        "draft",
        "grammar",
    )

    def __init__(
        self,
        request: Request,
        index: int,
        seq: Sequence,
        detokenizer: Detokenizer | None,
        draft: Draft | None = None,
        grammar: Any = None,
    ) -> None:
        self.request = request
        self.index = index
        self.seq = seq
        self.detokenizer = detokenizer
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = (
            [] if request.params.logprobs is not None else None
        )
        self.cumulative_logprob = 0.0 if self.logprobs is not None else None
        self.draft = draft  # None: speculation is off
        # llguidance's matcher at the committed tokens (pagedspec.engine.sample.grammar); None:
        # unconstrained
        self.grammar = grammar
        seq.owner = self

    @property
    def params(self) -> SamplingParams:
        return self.request.params

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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # see RequestOutput
    # the output count from which its rows are plain greedy
    # (pagedspec.engine.sampling_params.greedy_from)
    greedy_from: int = field(init=False)
    # characters an unfinished sample's output holds back: len(longest stop string) - 1
    held_chars: int = field(init=False)
    # its rows sample on the device with nothing read back but their tokens and logprobs (no
    # prompt logprobs, no constraint, whose matcher reads each token): async scheduling can
    # take them
    device_sampled: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.greedy_from = greedy_from(params)
        stops = params.stop_strings
        self.held_chars = max(map(len, stops)) - 1 if stops else 0
        self.device_sampled = params.prompt_logprobs is None and params.structured_outputs is None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first token follows nothing

    @property
    def finished(self) -> bool:
        return all(sample.finish_reason is not None for sample in self.samples)

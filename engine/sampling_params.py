"""Per-request sampling parameters, with vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

from pagedspec.engine.structured_params import StructuredOutputsParams, as_structured


class RequestOutputKind(enum.IntEnum):
    """Which outputs ``LLMEngine.step`` returns for a request (vLLM's names and values)."""

    CUMULATIVE = 0  # every step it progressed: everything so far
    FINAL_ONLY = 2  # only the finished output (what LLM.generate asks for)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # vLLM's / OpenAI's penalties, applied to the raw logits before temperature (see
    # engine/sample/penalties.py): presence and frequency count generated tokens only, repetition
    # every token of the prompt or the output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # per prompt token after the first: its logprob and the top ``prompt_logprobs`` (vLLM's);
    # such a request computes its whole prompt (no prefix-cache hits)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this (pagedspec.engine.sample.grammar): masked before penalties,
    # temperature, top-k/p and min-p; logprobs stay those of the raw logits.
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        """An unknown keyword is a ValueError (the dataclass __init__ would raise TypeError)."""
        allowed = sorted(f.name for f in fields(cls) if f.init)
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s) {unknown}; allowed: {allowed}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_number("temperature", self.temperature, "a finite number >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p, "a number in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, int) and self.top_k == -1:
            self.top_k = 0  # vLLM's "off"; downstream reads 0 as off
        _check_int(
            "top_k",
            self.top_k,
            0,
            f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}",
        )
        _check_number("min_p", self.min_p, "a number in [0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value, "a number in [-2, 2]")
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stops = self.stop or []
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        self.stop_strings = tuple(stops)
        ids = self.stop_token_ids or []
        if not isinstance(ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        self.stop_token_ids = list(ids)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.structured_outputs = as_structured(self.structured_outputs)
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = [kind.name for kind in RequestOutputKind]
            raise ValueError(
                f"output_kind must be a RequestOutputKind ({kinds}), got {self.output_kind!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


def _check_number(name: str, value: object, allowed: str) -> None:
    """A real, finite number (no bool, nan or inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value: object, minimum: int, message: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(message or f"{name} must be an integer >= {minimum}, got {value!r}")


NEVER_GREEDY = 1 << 62  # greedy_from of a request that is never plain greedy


def greedy_from(params: SamplingParams) -> int:
    """The output count from which a sample's row is plain greedy: a greedy row with nothing
    that changes its argmax or asks for more (penalties, min_tokens not yet reached, a
    constraint, logprobs), so its token is the row's argmax and only that; NEVER_GREEDY if
    that never holds."""
    if (
        params.temperature
        or params.logprobs is not None
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.structured_outputs is not None
    ):
        return NEVER_GREEDY
    return params.min_tokens

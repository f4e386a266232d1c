"""What the completions and chat handlers share: sampling parameters from a request, streamed
deltas, usage, server-sent events and the errors a handler raises."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pagedspec.engine.outputs import CompletionOutput, RequestOutput
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.serve.async_engine import EngineDeadError, QueueFullError
from pagedspec.engine.serve.protocol import Usage

DONE = "data: [DONE]\n\n"


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "BadRequestError",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        info = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": info}


def bad_request(error: ValueError, renamed: dict[str, str] | None = None) -> APIError:
    """A 400 for the engine's ValueError; its messages start with the field's name, which is
    reported as ``param`` (under the request's name for it, via ``renamed``)."""
    message = str(error)
    word = message.split(" ", 1)[0].strip(":")
    param = word if all(part.isidentifier() for part in word.split(".")) else None
    if param is not None and renamed:
        param = renamed.get(param, param)
    return APIError(400, message, param=param, code="invalid_value")


def api_error(error: Exception) -> APIError:
    """Any exception a handler meets, as the answer a client gets."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return bad_request(error)
    if isinstance(error, QueueFullError):
        message = f"server overloaded: {error}; retry later"
        return APIError(503, message, "ServiceUnavailableError", headers={"Retry-After": "1"})
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), "ServiceUnavailableError")
    return APIError(500, f"{type(error).__name__}: {error}", "InternalServerError")


def sampling_params(kwargs: dict[str, Any], renamed: dict[str, str]) -> SamplingParams:
    """SamplingParams(**kwargs), its ValueError as a 400 naming the request's field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request(e, renamed) from None


def check_context(
    max_model_len: int, prompt_lens: Iterable[int], max_tokens: int | None, field: str
) -> None:
    """OpenAI's (and vLLM's server's) rule: a prompt plus ``max_tokens`` past the model's
    context is a 400 naming ``field``, not a completion cut short (the offline ``LLM`` stops
    such a request at max_model_len, finish reason "length"). A prompt that is empty or alone
    too long is left to the engine's own error about it."""
    if max_tokens is None:
        return
    for n in prompt_lens:
        if 0 < n < max_model_len and n + max_tokens > max_model_len:
            raise APIError(
                400,
                f"{field} must be <= {max_model_len - n} for this {n}-token prompt (the "
                f"model's context is {max_model_len} tokens), got {max_tokens}",
                param=field,
                code="invalid_value",
            )


def check_finished(outputs: list[RequestOutput]) -> None:
    """A request the engine aborted because a step failed on it is a server error."""
    for out in outputs:
        if out.error is not None:
            message = f"the engine failed on this request: {out.error}"
            raise APIError(500, message, "InternalServerError")


def check_complete(outputs: list[RequestOutput]) -> None:
    """A whole (non-streamed) answer: ``check_finished``, and a request the server aborted
    (only a shutdown does, once its drain time is up) is a 503, not a completion cut short."""
    check_finished(outputs)
    if any(c.finish_reason == "abort" for out in outputs for c in out.outputs):
        message = "the server shut down before the request finished; retry"
        raise APIError(503, message, "ServiceUnavailableError", code="shutting_down")


def usage(outputs: dict[str, RequestOutput]) -> Usage:
    prompt = sum(len(out.prompt_token_ids) for out in outputs.values())
    completion = sum(len(c.token_ids) for out in outputs.values() for c in out.outputs)
    total = prompt + completion
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text_offset: int  # characters of the choice sent before this delta
    finish_reason: str | None  # set once: in the delta that finishes the choice
    first: bool  # the choice's first delta


@dataclass
class Deltas:
    """What each choice has been sent so far, to turn cumulative outputs into deltas."""

    sent: dict[tuple[str, int], tuple[int, int, bool]] = field(default_factory=dict)

    def next(self, request_id: str, c: CompletionOutput) -> Delta | None:
        """The choice's news since the last call; None when it has none."""
        key = (request_id, c.index)
        first = key not in self.sent
        chars, tokens, finished = self.sent.get(key, (0, 0, False))
        if len(c.text) == chars and len(c.token_ids) == tokens and c.finished == finished:
            return None
        self.sent[key] = (len(c.text), len(c.token_ids), c.finished)
        logprobs = None if c.logprobs is None else c.logprobs[tokens:]
        return Delta(c.text[chars:], c.token_ids[tokens:], logprobs, chars, c.finish_reason, first)


def sse(chunk: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


async def sse_stream(
    outputs: AsyncIterator[RequestOutput],
    events: Callable[[RequestOutput], Iterable[str]],
    usage_chunk: Callable[[Usage], BaseModel] | None,
) -> AsyncIterator[str]:
    """A streamed response: ``events(out)`` for each engine output, then the chunk
    ``usage_chunk`` makes of the final usage (None: no usage chunk), then ``[DONE]``. A failure
    ends the stream with its error event and ``[DONE]``."""
    last: dict[str, RequestOutput] = {}
    try:
        async for out in outputs:
            check_finished([out])
            last[out.request_id] = out
            for event in events(out):
                yield event
    except Exception as e:  # noqa: BLE001 - the stream's last event says what failed
        yield sse_error(api_error(e))
        yield DONE
        return
    if usage_chunk is not None:
        yield sse(usage_chunk(usage(last)))
    yield DONE

"""``/v1/chat/completions``: messages through the tokenizer's chat template → choices, whole
or streamed. The prompt is rendered exactly as ``LLM.chat`` renders it (``render_chat``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.llm import MessageError, render_chat
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.serve.logprobs import chat_logprobs
from engine.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)
from engine.serve.request_group import RequestGroup
from engine.serve.serving import (
    APIError,
    Delta,
    Deltas,
    check_complete,
    sampling_params,
    sse,
    sse_stream,
    usage,
)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value"
        )
    limit = max_tokens_field(req)
    kwargs = req.sampling_kwargs() | {"max_tokens": getattr(req, limit)}
    if req.logprobs:
        kwargs["logprobs"] = req.top_logprobs or 0
    renamed = {"max_tokens": limit, "logprobs": "top_logprobs"} | req.renamed_fields()
    return sampling_params(kwargs, renamed)


def max_tokens_field(req: ChatCompletionRequest) -> str:
    """The request's length limit: OpenAI's max_completion_tokens, else the older max_tokens."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> dict[str, list[int]]:
    try:
        _, token_ids = render_chat(tokenizer, [m.for_template() for m in req.messages])
    except MessageError as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from None
    except Exception as e:  # noqa: BLE001 - a template error is the request's
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from None
    return {"prompt_token_ids": token_ids}


class Chat:
    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name

    async def full(self, group: RequestGroup, req: ChatCompletionRequest) -> ChatCompletionResponse:
        (out,) = await group.final_outputs()
        check_complete([out])
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessage(content=c.text),
                logprobs=self._logprobs(req, c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
            )
            for c in out.outputs
        ]
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            model=self.model_name,
            choices=choices,
            usage=usage({out.request_id: out}),
        )

    def stream(self, group: RequestGroup, req: ChatCompletionRequest) -> AsyncIterator[str]:
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        exclude = None if req.include_usage else {"usage"}
        deltas = Deltas()

        def response(choices: list[ChatChunkChoice], **extra: Any) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=choices, **extra
            )

        def events(out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                d = deltas.next(out.request_id, c)
                if d is None:
                    continue
                if d.first:  # OpenAI's first chunk of a choice carries the role
                    role = {"role": "assistant", "content": ""}
                    yield sse(response([ChatChunkChoice(index=c.index, delta=role)]), exclude)
                yield sse(response([self._delta_choice(req, c.index, d)]), exclude)

        with_usage = (lambda u: response([], usage=u)) if req.include_usage else None
        return sse_stream(group.outputs(), events, with_usage)

    def _delta_choice(self, req: ChatCompletionRequest, index: int, d: Delta) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=index,
            delta={"content": d.text},
            logprobs=self._logprobs(req, d.token_ids, d.logprobs),
            finish_reason=d.finish_reason,
        )

    def _logprobs(
        self, req: ChatCompletionRequest, token_ids: list[int], logprobs: list | None
    ) -> Any:
        if not req.logprobs or logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs, req.top_logprobs or 0)

"""``/v1/chat/completions``: messages through the tokenizer's chat template → choices, whole
or streamed. The prompt is rendered exactly as ``LLM.chat`` renders it (``render_chat``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pagedspec.engine.entrypoints.llm import MessageError, render_chat
from pagedspec.engine.outputs import CompletionOutput, RequestOutput
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.serve.logprobs import chat_logprobs
from pagedspec.engine.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)
from pagedspec.engine.serve.request_group import RequestGroup
from pagedspec.engine.serve.serving import (
    APIError,
    Delta,
    Deltas,
    check_complete,
    sampling_params,
    sse,
    sse_stream,
    usage,
)
from pagedspec.engine.serve.tools import tool_calls, tool_constraint, tool_mode


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value"
        )
    limit = max_tokens_field(req)
    kwargs = req.sampling_kwargs() | {"max_tokens": getattr(req, limit)}
    if (constraint := tool_constraint(req, tool_mode(req))) is not None:
        kwargs["structured_outputs"] = constraint
    if req.logprobs:
        kwargs["logprobs"] = req.top_logprobs or 0
    renamed = {"max_tokens": limit, "logprobs": "top_logprobs"} | req.renamed_fields()
    return sampling_params(kwargs, renamed)


def max_tokens_field(req: ChatCompletionRequest) -> str:
    """The request's length limit: OpenAI's max_completion_tokens, else the older max_tokens."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> dict[str, list[int]]:
    tools = None
    if tool_mode(req) not in (None, "none"):
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        _, token_ids = render_chat(tokenizer, [m.for_template() for m in req.messages], tools)
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
        mode, choices = tool_mode(req), []
        for c in out.outputs:
            content, calls = tool_calls(req, mode, c.text)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(req, c.token_ids, c.logprobs),
                    finish_reason=_finish(c.finish_reason, calls),
                )
            )
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

        mode = tool_mode(req)

        def events(out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                d = deltas.next(out.request_id, c)
                if d is None:
                    continue
                if d.first:  # OpenAI's first chunk of a choice carries the role
                    role = {"role": "assistant", "content": ""}
                    yield sse(response([ChatChunkChoice(index=c.index, delta=role)]), exclude)
                choice = self._delta_choice(req, c, d, mode)
                if choice is not None:
                    yield sse(response([choice]), exclude)

        with_usage = (lambda u: response([], usage=u)) if req.include_usage else None
        return sse_stream(group.outputs(), events, with_usage)

    def _delta_choice(
        self, req: ChatCompletionRequest, c: CompletionOutput, d: Delta, mode: str | None
    ) -> ChatChunkChoice | None:
        """Choice ``c``'s news as a chunk. Content streams as it comes; a named tool's
        arguments too (its name in the first delta); "auto" and "required" answers are parsed
        once whole, so they come in their last delta (None before it), logprobs and all."""
        delta: dict[str, Any] = {"content": d.text}
        reason, token_ids, logprobs = d.finish_reason, d.token_ids, d.logprobs
        if mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": d.text}}
            if d.first:
                name = req.tool_choice.function.name
                call |= {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
                call["function"] = {"name": name, "arguments": d.text}
            delta = {"tool_calls": [call]}
            reason = _finish(reason, [call])
        elif mode in ("auto", "required"):
            if reason is None:
                return None
            content, calls = tool_calls(req, mode, c.text)
            delta = {"content": content}
            if calls:
                delta["tool_calls"] = [
                    {"index": i} | call.model_dump() for i, call in enumerate(calls)
                ]
            reason, token_ids, logprobs = _finish(reason, calls), c.token_ids, c.logprobs
        return ChatChunkChoice(
            index=c.index,
            delta=delta,
            logprobs=self._logprobs(req, token_ids, logprobs),
            finish_reason=reason,
        )

    def _logprobs(
        self, req: ChatCompletionRequest, token_ids: list[int], logprobs: list | None
    ) -> Any:
        if not req.logprobs or logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs, req.top_logprobs or 0)


def _finish(reason: str | None, calls: list) -> str | None:
    """OpenAI's finish reason for an answer that calls tools (once it stopped by itself)."""
    return "tool_calls" if calls and reason == "stop" else reason

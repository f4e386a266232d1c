"""``/v1/completions``: prompts (text or token ids, one or a list) → choices, whole or streamed.

Choice ``index`` is ``prompt index * n + sample index``, as in OpenAI's API and vLLM.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pagedspec.engine.core.processor import PromptType, encode_prompt
from pagedspec.engine.outputs import RequestOutput
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.serve.logprobs import completion_logprobs, prompt_logprobs
from pagedspec.engine.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse
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


def completion_prompts(tokenizer: Any, prompt: str | list) -> list[PromptType]:
    """A string, a list of strings, token ids, or a list of token-id lists, one prompt each.
    Text is tokenized here, once, as the engine would (``encode_prompt``), so that the server
    knows each prompt's length; without a tokenizer it stays text (the engine rejects it)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    return [_token_prompt(tokenizer, p) for p in prompt]


def _token_prompt(tokenizer: Any, prompt: str | list[int]) -> PromptType:
    if not isinstance(prompt, str):
        return {"prompt_token_ids": prompt}
    return prompt if tokenizer is None else {"prompt_token_ids": encode_prompt(tokenizer, prompt)}


def completion_params(req: CompletionRequest) -> SamplingParams:
    kwargs = req.sampling_kwargs() | {"max_tokens": req.max_tokens}
    if req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
    # an echoed prompt comes with its own logprobs when the completion's are asked for
    wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    if wanted:
        kwargs["prompt_logprobs"] = max(wanted)
    return sampling_params(kwargs, req.renamed_fields())


class Completions:
    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name

    async def full(
        self, group: RequestGroup, req: CompletionRequest, params: SamplingParams
    ) -> CompletionResponse:
        outputs = await group.final_outputs()
        check_complete(outputs)
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text, ids, lps = c.text, c.token_ids, c.logprobs
                if req.echo:  # the prompt, then the completion (logprobs likewise)
                    text = self.tokenizer.decode(out.prompt_token_ids) + text
                    if lps is not None:
                        ids, lps = out.prompt_token_ids + ids, _prompt_entries(out) + lps
                choice = self._choice(i * params.n + c.index, text, ids, lps, 0, c.finish_reason)
                if req.prompt_logprobs is not None:
                    choice.prompt_logprobs = prompt_logprobs(self.tokenizer, out.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            model=self.model_name,
            choices=choices,
            usage=usage({out.request_id: out for out in outputs}),
        )

    def stream(
        self, group: RequestGroup, req: CompletionRequest, params: SamplingParams
    ) -> AsyncIterator[str]:
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        exclude = None if req.include_usage else {"usage"}
        deltas = Deltas()

        def response(choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
            return CompletionResponse(
                id=response_id, created=created, model=self.model_name, choices=choices, **extra
            )

        echoed: dict[str, str] = {}  # request id -> its prompt's text, with echo

        def events(out: RequestOutput) -> Iterator[str]:
            base = group.request_ids.index(out.request_id) * params.n
            if req.echo and out.request_id not in echoed:
                echoed[out.request_id] = self.tokenizer.decode(out.prompt_token_ids)
            choices = [
                self._delta_choice(base + c.index, d, out, echoed.get(out.request_id))
                for c in out.outputs
                if (d := deltas.next(out.request_id, c)) is not None
            ]
            if choices:
                yield sse(response(choices), exclude)

        with_usage = (lambda u: response([], usage=u)) if req.include_usage else None
        return sse_stream(group.outputs(), events, with_usage)

    def _delta_choice(
        self, index: int, d: Delta, out: RequestOutput, prompt: str | None
    ) -> CompletionChoice:
        """The choice's news; with echo (``prompt``: the prompt's text) the first delta starts
        with the prompt (its tokens and logprobs too) and every later offset counts it."""
        text, ids, lps, offset = d.text, d.token_ids, d.logprobs, d.text_offset
        if prompt is not None and not d.first:
            offset += len(prompt)
        elif prompt is not None:
            text = prompt + text
            if lps is not None:
                ids, lps = out.prompt_token_ids + ids, _prompt_entries(out) + lps
        return self._choice(index, text, ids, lps, offset, d.finish_reason)

    def _choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
        offset: int,
        finish_reason: str | None,
    ) -> CompletionChoice:
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(self.tokenizer, token_ids, logprobs, offset)
        return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish_reason)


def _prompt_entries(out: RequestOutput) -> list[dict[int, float] | None]:
    """The prompt's logprobs, one entry a token: None for those it has none of (the first
    token; a request aborted before its prompt was done)."""
    known = out.prompt_logprobs or [None]
    return known + [None] * (len(out.prompt_token_ids) - len(known))

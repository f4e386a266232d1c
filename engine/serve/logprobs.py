"""Engine logprobs → OpenAI's two formats (the legacy completions one and the chat one).

The engine gives one dict per output token, {token id: logprob}: the sampled token first, then
the request's N most likely tokens of the raw distribution (N + 1 entries when the sampled one
is not among them).
"""

from __future__ import annotations

from typing import Any

from pagedspec.engine.serve.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float] | None], offset: int
) -> CompletionLogprobs:
    """``offset``: characters of the choice's text before these tokens (for ``text_offset``);
    an entry None (an echoed prompt's first token) has no logprob."""
    tokens, offsets = [], []
    for t in token_ids:
        tokens.append(token_text(tokenizer, t))
        offsets.append(offset)
        offset += len(tokens[-1])
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[
            None if entry is None else entry[t]
            for t, entry in zip(token_ids, logprobs, strict=True)
        ],
        top_logprobs=[
            None if entry is None else {token_text(tokenizer, i): lp for i, lp in entry.items()}
            for entry in logprobs
        ],
        text_offset=offsets,
    )


def prompt_logprobs(
    tokenizer: Any, entries: list[dict[int, float] | None]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice."""
    return [
        None
        if entry is None
        else {
            str(i): {"logprob": lp, "decoded_token": token_text(tokenizer, i)}
            for i, lp in entry.items()
        }  # fmt: skip
        for entry in entries
    ]


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int
) -> ChatLogprobs:
    content = []
    for t, entry in zip(token_ids, logprobs, strict=True):
        top = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
        content.append(
            TokenLogprob(
                **_top(tokenizer, t, entry[t]).model_dump(),
                top_logprobs=[_top(tokenizer, i, lp) for i, lp in top],
            )
        )
    return ChatLogprobs(content=content)


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

"""``LLM``: offline batch generation over the engine loop, vLLM style."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.core.llm_engine import LLMEngine
from pagedspec.engine.core.processor import PromptType, is_token_id, parse_prompt
from pagedspec.engine.outputs import RequestOutput
from pagedspec.engine.sampling_params import RequestOutputKind, SamplingParams

Messages = list[dict[str, str]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer, vLLM's accessor (None for a model with no tokenizer files)."""
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Iterable[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. An output's
        ``prompt`` is the prompt's text, or None for a prompt given as token ids.
        ``priority``: one per prompt, for an engine with ``scheduling_policy="priority"``."""
        batch = [parse_prompt(p) for p in _prompt_list(prompts)]
        return self._generate(batch, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them; each
        output's ``prompt`` is the rendered template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [render_chat(self.tokenizer, c) for c in conversations]
        outputs = self._generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for out, (text, _) in zip(outputs, rendered, strict=True):
            out.prompt = text
        return outputs

    def _generate(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Add every prompt, then step until all are done. On the way out of a failed or
        interrupted call (KeyboardInterrupt included) its unfinished requests are aborted, so
        they hold no KV blocks and a later call does not advance them."""
        params = _params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority must have one entry per prompt ({len(prompts)})")
        priorities = priority or [0] * len(prompts)
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, p, rank in zip(prompts, params, priorities, strict=True):
                request_id = str(self._next_id)
                self._next_id += 1
                engine.add_request(request_id, prompt, p, rank)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:
                engine.abort_request(request_id)  # False for those already finished
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        start, generated = time.perf_counter(), 0
        seen: dict[str, int] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in engine.step():
                    if out.request_id not in pending:
                        continue
                    total = sum(len(c.token_ids) for c in out.outputs)
                    generated += total - seen.get(out.request_id, 0)
                    seen[out.request_id] = total
                    if out.finished:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
                rate = generated / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.1f}")
        return [finished[i] for i in ids]


def render_chat(
    tokenizer: Any, messages: Messages, tools: list[dict] | None = None
) -> tuple[str, list[int]]:
    """``messages`` (and OpenAI-style ``tools``) through the chat template, with the generation
    prompt, as text and as token ids. The template writes any BOS itself, so the text is encoded
    without special tokens: adding them would double the BOS on Llama-3 or Mistral tokenizers."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and this model has none")
    messages = checked_messages(messages)
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return text, tokenizer.encode(text, add_special_tokens=False)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class MessageError(ValueError):
    """A chat message that is not one: ``field`` names it (``messages[i].content``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as the chat template takes them: each a dict with a ``role`` of CHAT_ROLES
    and a ``content`` that is a string or a list of text parts (``{"type": "text", "text":
    ...}``, joined); anything else is a MessageError naming the field."""
    if not isinstance(messages, list | tuple) or not messages:
        raise MessageError("messages", "must be a non-empty list of {role, content} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise MessageError(f"messages[{i}]", f"must be a dict, got {type(message).__name__}")
        if message.get("role") not in CHAT_ROLES:
            raise MessageError(
                f"messages[{i}].role", f"must be one of {CHAT_ROLES}, got {message.get('role')!r}"
            )
        content = message.get("content")
        if content is None and message.get("tool_calls"):  # an assistant's calls, no text
            content = ""
        if isinstance(content, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise MessageError(
                f"messages[{i}].content",
                f"must be a string or a list of text parts, got {content!r}"[:200],
            )
        checked.append({**message, "content": content})
    return checked


def _prompt_list(prompts: PromptType | Iterable[PromptType]) -> list:
    """One prompt -> [it]; several -> a list. Token ids (a list whose first element is an
    integer, or a 1-D numpy array) are one prompt; a 2-D array is one prompt per row."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, str | Mapping) or not isinstance(prompts, Iterable):
        return [prompts]
    items = list(prompts)
    return [items] if items and is_token_id(items[0]) else items


def _params_list(
    sampling_params: SamplingParams | list[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [_final_only(sampling_params or SamplingParams())] * num_prompts
    if not isinstance(sampling_params, list | tuple):
        raise ValueError(
            "sampling_params must be a SamplingParams, a list of them or None, "
            f"got {type(sampling_params).__name__}"
        )
    for i, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            raise ValueError(
                f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}"
            )
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompts"
        )
    return [_final_only(p) for p in sampling_params]


def _final_only(params: SamplingParams) -> SamplingParams:
    """generate() reads each request's finished output alone: the engine makes no other."""
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)

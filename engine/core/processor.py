"""Input processing: a request as the caller gives it → validated token ids and private params.

Everything that can be wrong with a request is caught here, before the engine holds any state
for it: a rejected request raises ``ValueError`` naming the field and leaves nothing behind.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from pagedspec.engine.sample.grammar import Grammars
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.structured_params import StructuredOutputsParams

# One prompt: text, token ids (ints or numpy integers, in a list, a tuple or a 1-D array or
# tensor), or one of vLLM's prompt dicts, {"prompt": text} or {"prompt_token_ids": token ids}.
PromptType = str | Sequence[int] | np.ndarray | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class ProcessedRequest:
    prompt: str | None  # the text, when the caller gave one
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's own copy: the caller's object may change later


@dataclass(frozen=True)
class Processor:
    tokenizer: PreTrainedTokenizerBase | None
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    num_lookahead_slots: int  # slots a decode may reserve for drafts
    grammars: Grammars | None = None  # None: no tokenizer, no structured outputs

    def process(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str = "",
        in_use: Container[str] = (),
        priority: int = 0,
    ) -> ProcessedRequest:
        """Validate a request: its id (a str not ``in_use``), prompt, params and priority."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id in in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._prompt(prompt)
        self._check_params(params)
        self._check_fits(token_ids, params)
        return ProcessedRequest(text, token_ids, copy.deepcopy(params))

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids, checked against the
        vocabulary and max_model_len."""
        prompt = parse_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            token_ids = encode_prompt(self.tokenizer, prompt)
            text = prompt
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}"
                )
            token_ids, text = prompt, None
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len})"
            )
        return text, token_ids

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model and the engine's limits."""
        if params.n > self.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.max_num_seqs}), got {params.n}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name} must be in [0, {self.vocab_size}], got {value}")
        if params.structured_outputs is not None:
            self.check_constraint(params.structured_outputs)

    def check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compile ``constraint`` (once: it is cached), or refuse it naming its field."""
        if self.grammars is None:
            raise ValueError("structured_outputs needs a model with a tokenizer")
        self.grammars.compiled(constraint)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Reject what could never run: one sequence needing more KV blocks than exist."""
        longest = len(token_ids) + (params.max_tokens or self.max_model_len)
        longest = min(longest, self.max_model_len) + self.num_lookahead_slots
        needed = -(-longest // self.block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"request needs up to {needed} KV blocks ({longest} tokens) but the cache has "
                f"{self.num_kv_blocks}; lower max_tokens or raise num_kv_blocks"
            )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A text prompt's token ids, as the engine computes them (special tokens added)."""
    return tokenizer.encode(text, add_special_tokens=True) if text else []


def parse_prompt(prompt: PromptType) -> str | list[int]:
    """One prompt as text, or as token ids in Python ints (their range is checked by
    ``Processor``, which knows the vocabulary). ValueError names the bad field."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if len(prompt) != 1 or next(iter(prompt)) not in PROMPT_KEYS:
            raise ValueError(
                "a prompt dict has exactly one key, 'prompt' (text) or 'prompt_token_ids', "
                f"got {list(prompt)}"
            )
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a str, got {type(text).__name__}")
        return text
    if isinstance(prompt, list | tuple) or hasattr(prompt, "tolist"):
        return _token_ids(prompt, "prompt")
    raise ValueError(
        "prompt must be a str, a list of token ids, {'prompt': str} or "
        f"{{'prompt_token_ids': list[int]}}, got {type(prompt).__name__}"
    )


def is_token_id(value: object) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(value: object, name: str) -> list[int]:
    """Token ids as Python ints from a list, tuple or 1-D array or tensor of integers."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list | tuple) or not all(is_token_id(t) for t in value):
        raise ValueError(f"{name} must be a list of integer token ids, got {value!r:.80}")
    return [int(t) for t in value]

"""Input processing: a request as the caller gives it → validated token ids and private params.

Everything that can be wrong with a request is caught here, before the engine holds any state
for it: a rejected request raises ``ValueError`` naming the field and leaves nothing behind.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.sampling_params import SamplingParams

PromptType = str | list[int] | Mapping[str, Any]


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

    def process(self, prompt: PromptType, params: SamplingParams | None) -> ProcessedRequest:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._prompt(prompt)
        self._check_params(params)
        self._check_fits(token_ids, params)
        return ProcessedRequest(text, token_ids, copy.deepcopy(params))

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """str, token ids, or vLLM's {"prompt": str} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, Mapping):
            if set(prompt) == {"prompt"}:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise ValueError("prompt_token_ids must be a list of token ids, got str")
            else:
                raise ValueError(
                    "a prompt dict must have exactly one key, 'prompt' or 'prompt_token_ids'; "
                    f"got {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            token_ids = encode_prompt(self.tokenizer, prompt)
            text = prompt
        elif isinstance(prompt, list | tuple) or hasattr(prompt, "tolist"):
            token_ids = _token_ids(prompt, self.vocab_size)
            text = None
        else:
            raise ValueError(
                f"prompt must be a str, a list of token ids or a prompt dict, "
                f"got {type(prompt).__name__}"
            )
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
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be in [0, {self.vocab_size}], got {params.logprobs}")

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


def _token_ids(prompt: Any, vocab_size: int) -> list[int]:
    """Python ints from a list, tuple or 1-D array of integers (numpy's included)."""
    values = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    if not isinstance(values, list):
        raise ValueError(f"prompt token ids must be one-dimensional, got {prompt!r}")
    bad = [
        t
        for t in values
        if isinstance(t, bool)
        or not isinstance(t, numbers.Integral)
        or not 0 <= int(t) < vocab_size
    ]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    return [int(t) for t in values]

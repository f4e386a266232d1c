"""``LLM``: offline batch generation over the engine loop, vLLM style."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
                )
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(str(self._next_id))
                self._next_id += 1
                engine.add_request(ids[-1], prompt, p)
        except ValueError:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        seen: dict[str, int] = {}
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
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        bar.close()
        return [finished[i] for i in ids]

"""Output processing: incremental detokenization, stop checks and ``RequestOutput``s.

Given the tokens a step produced for a sample (its accepted drafts and one sampled token), it
decides how many of them the sample keeps: it appends them one at a time and stops exactly where
EOS, a stop token, a stop string, ``max_tokens`` or ``max_model_len`` hits, so tokens after a
stop inside an accepted run never leak. It never touches sequences or KV: the caller commits
the kept tokens.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from pagedspec.engine.core.detokenizer import IncrementalDetokenizer
from pagedspec.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedspec.engine.request import Draft, Request, SampleState
from pagedspec.engine.sample.grammar import Grammars, consume
from pagedspec.scheduler import Sequence


class OutputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
        max_model_len: int,
        grammars: Grammars | None = None,
    ) -> None:
        self.tokenizer = tokenizer  # None for a config-only model: token ids, no text
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.grammars = grammars

    def new_sample(
        self,
        request: Request,
        seq: Sequence,
        index: int,
        parent: SampleState | None = None,
        draft: Draft | None = None,
    ) -> SampleState:
        """The record of ``request``'s sample ``index``: a fork of ``parent``'s (its draft state
        forked too), or a new one with ``draft`` (the round's ``new_draft()``)."""
        detokenizer = (
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        )
        if parent is not None and parent.draft is not None:
            draft = parent.draft.fork()
        grammar = None
        if request.params.structured_outputs is not None:
            grammar = (
                self.grammars.matcher(request.params.structured_outputs)
                if parent is None
                else parent.grammar.deep_copy()
            )
        sample = SampleState(request, index, seq, detokenizer, draft, grammar)
        request.samples.append(sample)
        return sample

    def append(
        self, sample: SampleState, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> list[int]:
        """Take ``token_ids`` one at a time until a stop condition; return the ones kept."""
        params = sample.request.params
        seq = sample.seq
        num_outputs = len(seq.token_ids) - seq.num_prompt_tokens
        length = len(seq.token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        detokenizer, eos = sample.detokenizer, self.eos_token_ids
        for j, token in enumerate(token_ids):
            num_outputs += 1
            length += 1
            if sample.logprobs is not None and logprobs is not None:
                sample.logprobs.append(self._decoded(logprobs[j]))
                sample.cumulative_logprob += logprobs[j][token]
            delta = detokenizer.add(token) if detokenizer else ""
            if num_outputs < params.min_tokens:
                sample.text += delta
            else:
                stop_token = token in params.stop_token_ids
                if not stop_token or params.include_stop_str_in_output:
                    sample.text += delta
                if token in eos and not params.ignore_eos:
                    sample.finish_reason = "stop"
                elif stop_token:
                    sample.finish_reason, sample.stop_reason = "stop", token
                elif params.stop_strings:
                    self._check_stop_strings(sample, len(delta))
            if sample.finish_reason is None and (
                num_outputs >= max_tokens or length >= self.max_model_len
            ):
                sample.finish_reason = "length"
            if sample.finish_reason is not None:
                if detokenizer and not isinstance(sample.stop_reason, str):
                    sample.text += detokenizer.flush()  # held for an unfinished char
                token_ids = token_ids[: j + 1]
                break
        if sample.grammar is not None:
            consume(sample.grammar, token_ids, self.eos_token_ids)
        return token_ids

    def add_prompt_logprobs(
        self, request: Request, first: int, entries: list[dict[int, Logprob]]
    ) -> None:
        """``entries`` for prompt tokens first, first + 1, ...; those the request has (a
        prompt computed again after a preemption) are kept."""
        known = len(request.prompt_logprobs)
        if first <= known:
            request.prompt_logprobs.extend(map(self._decoded, entries[known - first :]))

    def _decoded(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """``entry`` with each token's text (vLLM's decoded_token), where there is a tokenizer."""
        if self.tokenizer is None:
            return entry
        decode = self.tokenizer.decode
        return {t: Logprob(lp, lp.rank, decode([t])) for t, lp in entry.items()}

    @staticmethod
    def _check_stop_strings(sample: SampleState, new_chars: int) -> None:
        """A stop string ends the text just before it (or after it, with
        ``include_stop_str_in_output``); only the new characters can complete one."""
        text, params = sample.text, sample.request.params
        for stop in params.stop_strings:
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at >= 0:
                keep = at + len(stop) if params.include_stop_str_in_output else at
                sample.text = text[:keep]
                sample.finish_reason, sample.stop_reason = "stop", stop
                return

    def aborted(self, request: Request) -> RequestOutput:
        """The output of a request just aborted: a sample whose fork was never made (its
        prompt had not finished) is there too, empty, with "abort"."""
        for index in range(len(request.samples), request.params.n):
            seq = Sequence(-1, request.prompt_token_ids)  # never scheduled
            self.new_sample(request, seq, index).finish_reason = "abort"
        return self.output(request, True)

    @staticmethod
    def output(request: Request, finished: bool | None = None) -> RequestOutput:
        """The request's output now (``finished``: request.finished, when the caller knows)."""
        samples = request.samples  # (one sample: no list comprehension's frame)
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            [_completion(request, samples[0])]
            if len(samples) == 1
            else [_completion(request, s) for s in samples],
            request.finished if finished is None else finished,
            request.error,
            None if request.prompt_logprobs is None else list(request.prompt_logprobs),
        )


def _completion(request: Request, sample: SampleState) -> CompletionOutput:
    """While a sample runs, the last len(longest stop string) - 1 characters are held back:
    they may be the start of a stop string that the next token completes, and text a caller
    has seen must never shrink."""
    text, seq, logprobs = sample.text, sample.seq, sample.logprobs
    if request.held_chars and sample.finish_reason is None:
        text = text[: max(0, len(text) - request.held_chars)]
    return CompletionOutput(
        sample.index,
        text,
        seq.token_ids[seq.num_prompt_tokens :],
        sample.finish_reason,
        None if logprobs is None else list(logprobs),
        sample.stop_reason,
        sample.cumulative_logprob,
    )

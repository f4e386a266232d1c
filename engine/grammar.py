"""Constrained decoding: the constraints of ``StructuredOutputsParams`` as llguidance matchers,
and the masks that keep a row's logits to the tokens a constraint allows next.

llguidance, chosen over xgrammar by measurement on the default model's tokenizer (49152 tokens):
a constraint compiles in ~0.7 ms (xgrammar 1.3-3.8 ms) and a mask takes 7-10 us a token
(xgrammar 1-3 us; either is well under 1% of a CPU decode step); it has no dependencies, copies
a matcher (``deep_copy``) for a request's n samples and for walking drafts, and validates a
token run without taking it (``validate_tokens``).

A sample's matcher stands at its committed tokens. Row j of a span that verifies drafts is
masked by a copy of it advanced along ``drafts[:j]``: a draft the
constraint refuses gets probability 0 there and is rejected, so what the engine emits is the
masked target's law exactly. EOS is allowed only where the constraint may end.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.structured_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped)
# JSON as json.dumps writes it (", " and ": "), not any whitespace anywhere: a small model
# given the choice can fill max_tokens with newlines. (A schema's "x-guidance" overrides it.)
JSON_OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """Compiles constraints against one tokenizer (cached by kind and value) and hands out a
    matcher per sample."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: Any = None  # llguidance's, made on first use (~0.25 s)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A new matcher for ``params`` at the start of the output; ValueError (naming the
        field, with llguidance's message) where the constraint does not compile."""
        key = params.key()
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(params)
            self._compiled[key] = template
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return template.deep_copy()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance.hf
        from llguidance import LLMatcher

        if self._tokenizer is None:
            eos = self.eos_token_ids or None
            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
            )
        kind, value = params.kind, getattr(params, params.kind)
        field = f"structured_outputs.{kind}"
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else value
                schema = schema if isinstance(schema, str) else json.dumps(schema)
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(value)
            elif kind == "choice":
                literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
                grammar = LLMatcher.grammar_from_lark(f"start: {literals}")
            else:
                from llguidance.gbnf_to_lark import any_to_lark

                grammar = LLMatcher.grammar_from_lark(any_to_lark(value))
        except Exception as error:  # noqa: BLE001 - the library's message, under the field
            raise ValueError(f"{field}: {_one_line(error)}") from None
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field}: {_one_line(matcher.get_error())}")
        return matcher


def _one_line(message: object) -> str:
    """llguidance's messages draw carets under the spot on lines of their own."""
    return " ".join(str(message).split())


def allowed(matcher: Any, vocab_size: int | None = None) -> torch.Tensor:
    """bool [vocab_size]: the tokens ``matcher`` accepts next (None: the mask's whole width, a
    multiple of 32)."""
    words = np.frombuffer(matcher.compute_bitmask(), np.uint8)
    bits = np.unpackbits(words, bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.view(np.bool_).copy())


def span_masks(matcher: Any, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:
    """bool [1 + len(drafts), vocab_size]: row j allows what follows ``drafts[:j]``. Past the
    first draft the constraint refuses, rows allow everything: verification rejects that
    draft, so they are never read. ``matcher`` itself does not move (a copy walks the drafts:
    rolling back over an EOS that completed the constraint is not exact)."""
    valid = matcher.validate_tokens(list(drafts))
    walker = matcher.deep_copy() if valid else matcher
    rows = torch.ones(len(drafts) + 1, vocab_size, dtype=torch.bool)
    for j in range(valid + 1):
        rows[j] = allowed(walker, vocab_size)
        if j < valid and not walker.consume_token(drafts[j]):
            raise RuntimeError(f"the grammar refused draft {drafts[j]} it had validated")
    return rows


def consume(matcher: Any, token_ids: Sequence[int]) -> None:
    """Advance ``matcher`` along committed tokens (each allowed by its mask when sampled; once
    the constraint is complete, only EOS is, which it takes no more)."""
    for token in token_ids:
        if matcher.is_stopped():
            return
        if not matcher.consume_token(token):
            raise RuntimeError(f"the output left its grammar: {matcher.get_error()}")

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
import threading
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

import numpy as np
import torch

from pagedspec.engine.structured_params import StructuredOutputsParams

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
        # the server compiles in its handlers' threads, the engine thread reads the cache
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A new matcher for ``params`` at the start of the output."""
        return self.compiled(params).deep_copy()

    def compiled(self, params: StructuredOutputsParams) -> Any:
        """The cached matcher ``params`` compile to (only ever copied); ValueError (naming the
        field, with llguidance's message) where the constraint does not compile."""
        key = params.key()
        with self._lock:
            template = self._compiled.get(key)
        if template is None:  # compiled outside the lock: others keep using the cache
            template = self._compile(params)
        with self._lock:
            self._compiled[key] = template
            self._compiled.move_to_end(key)
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template

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


def words(vocab_size: int) -> int:
    """int32 words of one row's bitmask (bit i of word w: token 32 w + i allowed)."""
    return (vocab_size + 31) // 32


def fill_bitmasks(
    matcher: Any, drafts: Sequence[int], out: np.ndarray, known: np.ndarray | None = None
) -> None:
    """Row j of ``out`` (int32 [1 + len(drafts), words]) := what follows ``drafts[:j]``. Past
    the first draft the constraint refuses, rows allow everything: verification rejects that
    draft, so they are never read. ``known``: rows 0 .. len(drafts) - 1 already computed (by
    the drafter, which drew the drafts under them). ``matcher`` itself does not move (a copy
    walks the drafts: rolling back over an EOS that completed the constraint is not exact)."""
    valid = matcher.validate_tokens(list(drafts)) if drafts else 0
    walker = matcher.deep_copy() if valid else matcher
    out[valid + 1 :] = -1
    reuse = known is not None and len(known) == len(drafts) == valid
    if reuse:
        out[:valid] = known
    for j in range(valid + 1):
        if not reuse or j == valid:
            walker.unsafe_compute_mask_ptr(out[j].ctypes.data, out.shape[1] * 4)
        if j < valid and not walker.consume_token(drafts[j]):
            raise RuntimeError(f"the grammar refused draft {drafts[j]} it had validated")


class BitmaskFiller:
    """A step's constrained rows' bitmasks: the rows at a sample's committed tokens in parallel
    (llguidance's executor: threads of its own, without the GIL; each matcher once, a request's
    n samples at its prompt's end sharing one), the rows after drafts by walking a copy."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor: Any = None  # made on first use

    def fill(self, rows: list[tuple[Any, Sequence[int], Any]], out: np.ndarray) -> None:
        """``rows[i]`` = (a matcher, the drafts after it, the drafter's bitmasks for them or
        None): its 1 + len(drafts) rows of ``out`` (int32), one after the other."""
        first: dict[int, int] = {}  # matcher id -> its committed row
        parallel, copies, at = [], [], 0
        for matcher, drafts, known in rows:
            if drafts:
                fill_bitmasks(matcher, drafts, out[at : at + 1 + len(drafts)], known)
            elif id(matcher) in first:
                copies.append((at, first[id(matcher)]))
            else:
                first[id(matcher)] = at
                parallel.append((matcher, at))
            at += 1 + len(drafts)
        if len(parallel) > 1:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor(self.threads)
            self._executor.unsafe_compute_mask_ptr(parallel, out.ctypes.data, out.shape[1] * 4,
                                                   out.shape[0])  # fmt: skip
        elif parallel:
            fill_bitmasks(parallel[0][0], (), out[parallel[0][1] : parallel[0][1] + 1])
        for to, source in copies:
            out[to] = out[source]


def refused(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where a row's bitmask refuses the token."""
    unpacked = np.unpackbits(np.invert(bits).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(unpacked[:, :vocab_size].view(np.bool_))


def advanced(matcher: Any, token_ids: Sequence[int], eos_token_ids: Container[int]) -> Any:
    """A copy of ``matcher`` past ``token_ids`` (tokens it allows, as verification emitted:
    an EOS once the constraint is complete among them)."""
    walker = matcher.deep_copy()
    consume(walker, token_ids, eos_token_ids)
    return walker


def consume(matcher: Any, token_ids: Sequence[int], eos_token_ids: Container[int]) -> None:
    """Advance ``matcher`` along committed tokens (each allowed by its mask when sampled; once
    the constraint is complete, only EOS is, which it takes no more)."""
    for token in token_ids:
        if matcher.is_stopped() and token in eos_token_ids:
            continue
        if matcher.is_stopped() or not matcher.consume_token(token):
            raise RuntimeError(
                f"the output left its grammar at token {token}: {matcher.get_error()}"
            )

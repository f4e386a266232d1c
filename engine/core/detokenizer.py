"""Incremental detokenization.

Decoding one token at a time is wrong for byte-level BPE (a multi-byte character spans
tokens) and for SentencePiece-style tokenizers (a token's leading space depends on what
precedes it). Like vLLM, we decode a short window of context before the new tokens and
emit only the text beyond the window's own decoding, holding back while the tail is an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.read_offset = len(self.token_ids)  # tokens[:read_offset] are context, already emitted

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        return self._emit(hold_partial=True)

    def flush(self) -> str:
        """At the end of the stream: the text held back for an unfinished character."""
        return self._emit(hold_partial=False)

    def _emit(self, hold_partial: bool) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[: self.read_offset], skip_special_tokens=True)
        full_text = decode(self.token_ids, skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or (hold_partial and full_text.endswith("\ufffd")):
            return ""
        # What was just emitted becomes the context for the next token.
        del self.token_ids[: self.read_offset]
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

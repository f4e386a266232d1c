"""Stage 0 (``--magpie-prompts N``): user prompts written by the target itself, Magpie style (Xu
et al., 2024, "Magpie: alignment data synthesis from scratch by prompting aligned LLMs with
nothing"). The target gets its chat template up to where a user's message begins and writes the
message; an instruct model has learnt what its users ask, so these prompts follow the chat it
was tuned on, far wider than the template lists in ``prompts.py``.

Kept: messages the model closed itself (finish reason "stop"), of ``MIN_WORDS`` to ``MAX_WORDS``
words, mostly printable ASCII, and new: no exact repeat (case and spacing aside) of another or
of ``seen`` (the template prompts and the held-out chat prompts). Cached in
``<work_dir>/magpie_prompts.jsonl`` once all are written."""

from __future__ import annotations

import os
import string
import time
from collections.abc import Callable, Iterable

from tqdm.auto import tqdm

from pagedspec.engine.tools.train_eagle.data import read_jsonl, write_jsonl

TEMPERATURE = 1.0
TOP_P = 0.9
MAX_TOKENS = 96
MIN_WORDS, MAX_WORDS = 4, 80
MIN_PRINTABLE = 0.97
SETTINGS = (
    f"written by the target after its chat template's user-turn prefix at temperature "
    f"{TEMPERATURE}, top-p {TOP_P}, at most {MAX_TOKENS} tokens; kept when finished, "
    f"{MIN_WORDS}-{MAX_WORDS} words, >= {MIN_PRINTABLE:.0%} printable ASCII, no exact repeat"
)
_MARKER = "\uffffUSER\uffff"
_PRINTABLE = set(string.printable)


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message begins, encoded as
    ``LLM.chat`` encodes a prompt. Spaces just before the message are left out: a tokenizer
    joins such a space to the message's first word (" What"), so a prefix ending in a lone
    space token is how no real prompt starts; the model writes the space itself."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--magpie-prompts needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in text:
        raise ValueError("--magpie-prompts: the chat template does not show the user's message")
    prefix = text[: text.index(_MARKER)].rstrip(" ")
    if not prefix:
        raise ValueError("--magpie-prompts: the chat template puts nothing before the user's text")
    return tokenizer.encode(prefix, add_special_tokens=False)


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def keep(text: str, finish_reason: str | None) -> bool:
    """A finished, plain-text message of a sensible length."""
    words = len(text.split())
    if finish_reason != "stop" or not MIN_WORDS <= words <= MAX_WORDS:
        return False
    return sum(c in _PRINTABLE for c in text) >= MIN_PRINTABLE * len(text)


def synthesize_prompts(
    llm_factory: Callable[[], object],
    count: int,
    work_dir: str,
    seen: Iterable[str] = (),
    batch_size: int = 256,
    max_rounds: int | None = None,
    on_done: Callable[[dict], object] | None = None,
) -> list[str]:
    """``count`` self-written user prompts (cached); ``seen``: texts none may repeat.
    ``max_rounds`` of ``batch_size`` messages at most (None: enough for a keep rate of one in
    four). ``on_done`` gets the seconds and the number of messages written when they were made."""
    path = os.path.join(work_dir, "magpie_prompts.jsonl")
    if os.path.isfile(path):
        cached = [r["prompt"] for r in read_jsonl(path)]
        if len(cached) != count:
            raise ValueError(f"{path} holds {len(cached)} prompts, not {count}")
        return cached
    from pagedspec import SamplingParams

    llm = llm_factory()
    start = time.perf_counter()
    prefix = user_turn_prefix(llm.tokenizer)
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=MAX_TOKENS)
    known = {normalize(t) for t in seen}
    out: list[str] = []
    written = 0
    bar = tqdm(total=count, desc="Stage 0: prompts", unit="prompt")
    if max_rounds is None:
        max_rounds = -(-4 * count // batch_size)
    for _ in range(max_rounds):
        outs = llm.generate([prefix] * batch_size, params, use_tqdm=False)
        written += len(outs)
        for o in outs:
            text = o.outputs[0].text.strip()
            key = normalize(text)
            if len(out) < count and keep(text, o.outputs[0].finish_reason) and key not in known:
                known.add(key)
                out.append(text)
                bar.update(1)
        if len(out) == count:
            break
    bar.close()
    if len(out) < count:
        raise ValueError(
            f"--magpie-prompts: the model wrote only {len(out)} usable prompts of {count} in "
            f"{max_rounds} rounds of {batch_size}; ask for at most {len(out)}"
        )
    write_jsonl(path, [{"prompt": t} for t in out])
    if on_done is not None:
        on_done({"seconds": time.perf_counter() - start, "written": written})
    return out

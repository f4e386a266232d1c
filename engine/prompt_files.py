"""Prompts for the offline script: ``--prompt`` values, a .txt file (one prompt per line) or a
.jsonl file (``{"prompt": ...}`` or ``{"messages": [...]}`` per line), checked line by line."""

from __future__ import annotations

import json
from pathlib import Path

Messages = list[dict[str, str]]


def read_prompts(prompts: list[str] | None, path: Path | None) -> list[str | Messages]:
    """``--prompt`` values, or the prompts of the ``--input`` file at ``path``: plain strings,
    or message lists for chat. A ValueError names --prompt, or the input file and line."""
    if prompts:
        return [_check_prompt(p, "--prompt") for p in prompts]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--input: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--input: {path} is not UTF-8 text: {e.reason}") from None
    jsonl = path.suffix == ".jsonl"
    items = [
        _parse_jsonl_line(line, f"--input: {path}, line {n}") if jsonl else line
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip()
    ]
    if not items:
        raise ValueError(f"--input: no prompts in {path}")
    return items


def _parse_jsonl_line(line: str, where: str) -> str | Messages:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict) or len(obj.keys() & {"prompt", "messages"}) != 1:
        raise ValueError(f"{where}: expected an object with a 'prompt' or a 'messages' key")
    unknown = sorted(obj.keys() - {"prompt", "messages"})
    if unknown:  # sampling options are the script's flags, the same for every line
        raise ValueError(
            f"{where}: unknown key(s) {unknown}: a line holds 'prompt' or 'messages' alone"
        )
    if "messages" in obj:
        return _check_messages(obj["messages"], where)
    return _check_prompt(obj["prompt"], where)


def _check_prompt(prompt: object, where: str) -> str:
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: prompt must be a non-empty string, got {prompt!r:.60}")
    return prompt


def _check_messages(messages: object, where: str) -> Messages:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError(
            f"{where}: messages must be a non-empty list of {{'role': str, 'content': str}}, "
            f"got {messages!r:.60}"
        )
    return messages

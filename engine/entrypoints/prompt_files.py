"""Prompts for the offline script: ``--prompt`` values, a .txt file (one prompt per line) or a
.jsonl file (``{"prompt": ...}`` or ``{"messages": [...]}`` per line, with at most one
constraint: ``response_format``, ``json_schema`` or ``structured_outputs``), checked line by
line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from pagedspec.engine.structured_params import StructuredOutputsParams, as_structured

Messages = list[dict[str, str]]
CONSTRAINT_KEYS = ("response_format", "json_schema", "structured_outputs")


class Line(NamedTuple):
    prompt: str | Messages
    structured_outputs: StructuredOutputsParams | None = None
    where: str = "--prompt"  # where it came from, for errors found later


def read_prompts(prompts: list[str] | None, path: Path | None) -> list[Line]:
    """``--prompt`` values, or the prompts of the ``--input`` file at ``path``: plain strings,
    or message lists for chat. A ValueError names --prompt, or the input file and line."""
    if prompts:
        return [Line(_check_prompt(p, "--prompt")) for p in prompts]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--input: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--input: {path} is not UTF-8 text: {e.reason}") from None
    jsonl = path.suffix == ".jsonl"
    items = [
        _parse_jsonl_line(line, f"--input: {path}, line {n}") if jsonl else Line(line)
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip()
    ]
    if not items:
        raise ValueError(f"--input: no prompts in {path}")
    return items


def _parse_jsonl_line(line: str, where: str) -> Line:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict) or len(obj.keys() & {"prompt", "messages"}) != 1:
        raise ValueError(f"{where}: expected an object with a 'prompt' or a 'messages' key")
    unknown = sorted(obj.keys() - {"prompt", "messages", *CONSTRAINT_KEYS})
    if unknown:  # sampling options are the script's flags, the same for every line
        raise ValueError(
            f"{where}: unknown key(s) {unknown}: a line holds 'prompt' or 'messages' and at "
            f"most one of {list(CONSTRAINT_KEYS)}"
        )
    if "messages" in obj:
        prompt = _check_messages(obj["messages"], where)
    else:
        prompt = _check_prompt(obj["prompt"], where)
    return Line(prompt, _constraint(obj, where), where)


def _constraint(obj: dict, where: str) -> StructuredOutputsParams | None:
    """A line's constraint: OpenAI's response_format, a bare JSON schema, or vLLM's fields."""
    given = [key for key in CONSTRAINT_KEYS if key in obj]
    if len(given) > 1:
        raise ValueError(f"{where}: give one of {given}, not several")
    try:
        if not given:
            return None
        value = obj[given[0]]
        if given[0] == "json_schema":
            return StructuredOutputsParams(json=value)
        if given[0] == "structured_outputs":
            return as_structured(value)
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (value.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if schema is None:
            raise ValueError(
                'response_format must be {"type": "json_object"} or {"type": "json_schema", '
                f'"json_schema": {{"schema": ...}}}}, got {value!r:.80}'
            )
        return StructuredOutputsParams(json=schema)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: {e}") from None


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

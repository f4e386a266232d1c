"""Tool calls for ``/v1/chat/completions``: ``tools`` and ``tool_choice`` in, OpenAI's
``tool_calls`` out.

- ``"none"``: the tools are not shown to the model; a plain answer.
- a named function: the output is constrained to that function's ``parameters`` schema, and is
  the call's ``arguments`` (valid JSON matching the schema, by construction).
- ``"required"``: the output is constrained to a JSON array of one or more
  ``{"name": ..., "arguments": {...}}``, each matching its function's schema.
- ``"auto"`` (the default with tools): free text; calls written the way Hermes-style chat
  templates ask for (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) are parsed
  out of it, and what is left is the content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pagedspec.engine.serve.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from pagedspec.engine.serve.serving import APIError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_mode(req: ChatCompletionRequest) -> str | None:
    """ "none", "auto", "required", "named", or None when the request has no tools."""
    if req.tools is None:
        if req.tool_choice not in (None, "none"):
            raise APIError(
                400, "tool_choice needs tools", param="tool_choice", code="invalid_value"
            )
        return None
    choice = req.tool_choice or "auto"
    if not isinstance(choice, str):
        if choice.function.name not in {t.function.name for t in req.tools}:
            message = f"tool_choice names {choice.function.name!r}, which is not in tools"
            raise APIError(400, message, param="tool_choice", code="invalid_value")
        return "named"
    return choice


def tool_constraint(req: ChatCompletionRequest, mode: str | None) -> dict[str, Any] | None:
    """The structured_outputs a named or required tool choice puts on the output."""
    if mode not in ("named", "required"):
        return None
    if req.response_format is not None or req.structured_outputs is not None:
        message = f"tool_choice {req.tool_choice if mode == 'required' else 'naming a function'} "
        message += "constrains the output itself: drop response_format / structured_outputs"
        raise APIError(400, message, param="tool_choice", code="invalid_value")
    if mode == "named":
        name = req.tool_choice.function.name
        return {"json": next(t.function.parameters for t in req.tools if t.function.name == name)}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in req.tools
    ]
    return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": calls}}}


def tool_calls(req: ChatCompletionRequest, mode: str | None, text: str) -> tuple[str | None, list]:
    """(content, tool calls) of an answer ``text``."""
    if mode == "named":
        return None, [_call(req.tool_choice.function.name, text)]
    if mode == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens
            return text, []
        return None, [_call(c["name"], json.dumps(c["arguments"])) for c in calls]
    if mode != "auto":
        return text, []
    names, calls = {t.function.name for t in req.tools}, []

    def take(found: re.Match) -> str:
        """A call to a known tool leaves the text; anything else stays in it."""
        try:
            call = json.loads(found.group(1))
        except json.JSONDecodeError:
            return found.group(0)
        if not isinstance(call, dict) or call.get("name") not in names:
            return found.group(0)
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(_call(call["name"], json.dumps(arguments)))
        return ""

    rest = TOOL_CALL.sub(take, text).strip()
    return (rest or None, calls) if calls else (text, [])


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name,
                    arguments=arguments))  # fmt: skip

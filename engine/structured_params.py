"""What a request's output must match: vLLM's ``StructuredOutputsParams`` (one constraint each).

Only the shape is checked here (no library is imported: the CLIs read this module); whether a
schema, regex or grammar compiles is checked against the tokenizer when the request is added
(``pagedspec.engine.sample.grammar``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (has "::=")
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {list(KINDS)}, got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"structured_outputs.{name} must be a non-empty str, got {value!r}"
                )
        if self.choice is not None and not (
            isinstance(self.choice, list | tuple)
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                f"{self.choice!r}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, its value as text): what a compiled constraint is cached under."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, str(value)


def as_structured(value: Any) -> StructuredOutputsParams | None:
    """``SamplingParams.structured_outputs`` as given: the params, a dict of them, or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; allowed: {KINDS}")
        return StructuredOutputsParams(**value)
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {value!r}")

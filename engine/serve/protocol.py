"""Request and response bodies, mirroring OpenAI's (plus vLLM's sampling extras).

Requests forbid unknown fields, so a misspelt option is a 400 naming it rather than silently
ignored, and take their types strictly, as OpenAI does (``"n": "2"`` or ``"stream": "yes"`` is a
400, not a 2 or a True). Sampling fields left out (None) take ``SamplingParams``' defaults,
which are OpenAI's.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# SamplingParams fields that a request may set under the same name.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


# Most logprobs a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required for type json_schema")
        return self


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = STRICT
    model: str | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and ignored, as OpenAI clients send it
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int = 0  # under --scheduling-policy priority: lower first
    # OpenAI's constraint, or vLLM's extra (StructuredOutputsParams' fields): one at most
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keywords this request sets (None fields are left out)."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        values["structured_outputs"] = self.structured_outputs or self._response_constraint()
        return {name: value for name, value in values.items() if value is not None}

    def _response_constraint(self) -> dict[str, Any] | None:
        f = self.response_format
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return {"json_object": True}
        return {"json": f.json_schema.json_schema}

    def renamed_fields(self) -> dict[str, str]:
        """What the engine calls a constraint's fields, as this request named them."""
        if self.response_format is None:
            return {}
        return {
            "structured_outputs": "response_format",
            "structured_outputs.json_object": "response_format",
            "structured_outputs.json": "response_format.json_schema",
        }

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingRequest:
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion (and its logprobs, with logprobs)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class FunctionDef(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; "required" and "auto" allow several


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt token (None for the first), {token id: {logprob, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls": [...]}
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedspec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

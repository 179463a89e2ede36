"""/v1/chat/completions bodies: the request (tools and tool choice on top of the sampling
fields shared with /v1/completions, see `protocol.py`), the chat.completion response and its
stream chunks. Messages themselves are shared with /tokenize and stay in `protocol.py`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from .protocol import (
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    ChatMessage,
    UsageInfo,
    _SamplingRequest,
    _Strict,
)

# -- the request -------------------------------------------------------------------------------


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; checked to describe an object
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the chat template as variables (e.g. `{"enable_thinking": false}`).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # passed to the template as `reasoning_effort`


# -- chat.completion / chat.completion.chunk (plain models, see `protocol.py`) ------------------


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token text's UTF-8 bytes (a token may be part of a character)


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str  # `call_<hex>` (or the id format the model's template requires)
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    """`content` is null when the model only called tools; `reasoning_content` and
    `tool_calls` are left out when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if body.get(key) is None:
                body.pop(key, None)
        return body


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _OnlyPresent(BaseModel):
    """Dumps without the fields that are None (stream deltas carry only what they add)."""

    @model_serializer(mode="wrap")
    def _only_present(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OnlyPresent):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OnlyPresent):
    """A piece of tool call `index`: the id, type and name in its first piece, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_OnlyPresent):
    """What a stream chunk adds to a choice: the role once, first, then content, reasoning or
    tool-call pieces."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None  # sent (null until the last chunk) only if asked for

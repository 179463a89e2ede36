"""Request, response and stream-event bodies of `POST /v1/responses` (OpenAI's Responses API,
the subset tallow serves).

Requests validate strictly, as in `tallow.server.protocol`; unknown fields are ignored. Input
items are told apart by `type` (a message may leave it out); content parts, tools, tool choices
and text formats likewise, so an item or part tallow does not serve (`input_image`, a
`web_search` tool, ...) is a 400 naming it. Response models are plain: built by us, never
parsed from clients; their field order is the JSON key order clients see.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from .protocol import MAX_TOOLS, Priority, Seed, Temperature, TopP

MAX_METADATA = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# -- request -----------------------------------------------------------------------------------


class InputTextPart(_Strict):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Strict):
    """Text of an earlier assistant turn, sent back (annotations and logprobs are ignored)."""

    type: Literal["output_text"]
    text: str


ContentPart = Annotated[InputTextPart | OutputTextPart, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """A call the model made earlier (`id` and `status`, when sent back, are ignored)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str  # JSON text


class FunctionCallOutputItem(_Strict):
    """The result of call `call_id`, for the model to read."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputTextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningTextPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInputItem(_Strict):
    """An earlier reasoning item, sent back: its text becomes the next assistant turn's
    `reasoning_content` (templates that keep past thinking render it)."""

    type: Literal["reasoning"]
    summary: list[ReasoningTextPart] = []
    content: list[ReasoningTextPart] | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        tag = value.get("type", "message")  # an "easy" message has no type
        return tag if isinstance(tag, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message=(
            "input items must be messages, or items of type 'function_call', "
            "'function_call_output' or 'reasoning'"
        ),
    ),
]


class FunctionTool(_Strict):
    """A function tool in the Responses shape (flat: no `function` wrapper)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    model_config = ConfigDict(
        strict=True, extra="ignore", populate_by_name=True, allow_inf_nan=False
    )

    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")
]


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None  # passed to the chat template as `reasoning_effort`
    summary: str | None = None  # accepted; the reasoning item carries the whole thinking


class ResponseCreateRequest(_Strict):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None
    user: str | None = None
    previous_response_id: str | None = None  # a 400: no responses are stored
    # tallow's extensions, as on the chat route
    seed: Seed | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: Priority | None = None  # lower starts first (see the chat route)
    speculative: bool | None = None  # false: no speculative decoding for this request


# -- response ----------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningItem(BaseModel):
    """The thinking text, whole, as `reasoning_text` content (there is no summary)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = OutputMessage | ReasoningItem | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """A response; the request's settings are echoed as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


# -- stream events (each is one SSE event named by its `type`) ---------------------------------


class _Event(BaseModel):
    type: str
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    """response.created / in_progress / completed / incomplete / failed."""

    response: ResponseObject


class OutputItemEvent(_Event):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDeltaEvent(_Event):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDoneEvent(_Event):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDeltaEvent(_Event):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(_Event):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    """An engine failure after the stream started (then `response.failed`)."""

    code: str | None = None
    message: str
    param: str | None = None

"""Request and response bodies of the OpenAI-compatible API (the subset tallow serves): what the
routes share (messages, sampling fields, usage, errors), /v1/completions, /tokenize, /v1/models,
/health and /v1/embeddings. Chat completions are in `protocol_chat.py`, the Responses API in
`protocol_responses.py`.

Requests validate in pydantic's strict mode: OpenAI rejects `"temperature": "0.5"`, and
silently coercing strings or booleans to numbers would hide client bugs. OpenAI's ranges
(temperature 0-2, top_p 0-1, penalties -2-2, logit_bias values -100-100, top_logprobs 0-20,
n >= 1) and tallow's caps (list sizes, a seed's 64 bits) are checked here, so a 400 names the
field before anything reaches the engine; token ids are checked against the vocabulary in
`server/prompts.py`, and `SamplingParams.validate` checks again what the engine cannot hold.
Infinite numbers (`1e999`) are refused like NaN. Unknown fields are ignored, as clients send
extras (`metadata`, ...) freely.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
MAX_STOP_CHARS = 1024  # each stop string (the stop matcher's work grows with its square)
MAX_STOP_TOKEN_IDS = 256
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # any signed or unsigned 64-bit seed

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A tool call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    reasoning_content: str | None = None  # assistant messages: their thinking, sent back

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; None: any JSON value.
    json_schema: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`; `json_schema` is required with type "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions.

    Output constraints (at most one per request; `server/prompts.py` turns it into a grammar):
    OpenAI's `response_format`, or vLLM's `guided_json` (a JSON Schema, as an object or its
    JSON text), `guided_regex`, `guided_choice` and `guided_grammar` (llguidance's Lark).
    """

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None  # 0: only the most likely token
    top_k: Annotated[int, Field(ge=-1)] | None = None  # 0, -1: off; >= vocabulary size: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's extension: the order in which waiting requests start (their prefill turns);
    # lower first, 0 by default.
    priority: Priority | None = None
    # false: this request does not speculate (`tallow serve --speculative`); default true
    speculative: bool | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    # A string, a batch of strings, one token-id prompt, or a batch of token-id prompts.
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | list[TokenIds]
    # 0 only with echo: the prompt is returned (and scored, with logprobs), nothing generated.
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False  # the prompt before each choice's text (and in its logprobs)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# -- responses (plain models: they are built by us, never parsed from clients) ----------------
#
# Field order is the JSON key order clients see; optional fields dump as null unless a model
# says otherwise (a chat delta omits what it does not carry, as OpenAI's does).


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# text_completion (non-streaming bodies and stream chunks have the same shape)


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (with echo, the
    prompt's tokens first; the first has null logprobs: nothing predicts it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # sent (null until the last chunk) only if asked for


# the other routes


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tallow"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]


# -- embeddings --------------------------------------------------------------------------------

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(_Strict):
    model: str | None = None
    # A string, a batch of strings, one token-id input, or a batch of token-id inputs.
    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32, as OpenAI's


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage

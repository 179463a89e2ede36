"""A Responses API request as engine inputs, through the chat path.

The request is rewritten as the equivalent chat completion request (`as_chat_request`):
`instructions` become a system message, input items become chat messages (`function_call`
items an assistant turn's `tool_calls`, `function_call_output` items `tool` messages, a sent-back
reasoning item the next assistant turn's `reasoning_content`), flat function tools the chat
shape, `reasoning.effort` the template's `reasoning_effort`. `chat_inputs` then renders the
template, picks the tool-call parser and forcing grammar exactly as for the chat route, so both
routes give a conversation the same prompt. `text.format` adds a JSON grammar
(`attach_text_format_grammar`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tallow.runtime.constraint import (
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
)
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.served_model import ServedModel

from .chat_output import ChatOutputOptions
from .errors import APIError, bad_request, from_validation_error
from .prompts import chat_inputs
from .protocol import ChatMessage, FunctionCall, MessageToolCall
from .protocol_chat import (
    ChatCompletionRequest,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
)
from .protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningInputItem,
    ResponseCreateRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)

# The chat request's parameter names, as the Responses request calls them (for 400s).
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}


def check_unsupported(req: ResponseCreateRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation in input",
            "previous_response_id",
            "unsupported_parameter",
        )


def input_messages(req: ResponseCreateRequest) -> list[ChatMessage]:
    """The conversation as chat messages, the way the chat API would carry it."""
    messages: list[ChatMessage] = []
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
    items = (
        [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    reasoning: str | None = None  # a reasoning item waiting for its assistant turn
    calls: set[str] = set()
    joinable = False  # the last message is an assistant turn that later calls may join
    for i, item in enumerate(items):
        if isinstance(item, ReasoningInputItem):
            reasoning = (reasoning or "") + item.text()
            joinable = False
        elif isinstance(item, MessageItem):
            assistant = item.role == "assistant"
            messages.append(
                ChatMessage(
                    role=item.role,
                    content=item.text(),
                    reasoning_content=reasoning if assistant else None,
                )
            )
            reasoning, joinable = None, assistant  # reasoning only precedes assistant turns
        elif isinstance(item, FunctionCallItem):
            call = MessageToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            if joinable:
                last = messages[-1]
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(
                    ChatMessage(
                        role="assistant",
                        content=None,
                        tool_calls=[call],
                        reasoning_content=reasoning,
                    )
                )
                reasoning, joinable = None, True
            calls.add(item.call_id)
        else:
            assert isinstance(item, FunctionCallOutputItem)
            if item.call_id not in calls:
                raise bad_request(
                    f"input[{i}]: no function_call item with call_id {item.call_id!r} "
                    "comes before this function_call_output",
                    "input",
                )
            messages.append(
                ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text())
            )
            joinable = False
    return messages


def as_chat_request(req: ResponseCreateRequest) -> ChatCompletionRequest:
    tools = [
        ToolDefinition(
            type="function",
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            ),
        )
        for t in req.tools or []
    ]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatCompletionRequest(
        model=req.model,
        messages=input_messages(req),
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        priority=req.priority,
        speculative=req.speculative,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning.effort if req.reasoning else None,
        user=req.user,
    )


def responses_param(e: APIError) -> APIError:
    """A chat-path error, naming the Responses request's parameter."""
    if e.info.param in _PARAM_NAMES:
        e.info.param = _PARAM_NAMES[e.info.param]
    return e


def attach_text_format_grammar(
    params: SamplingParams, fmt: TextFormatJSONObject | TextFormatJSONSchema, model: ServedModel
) -> None:
    """Put `text.format`'s JSON grammar on `params` (an unset `strict` counts as strict, as
    for the chat route's `response_format`); a schema llguidance rejects is a 400 naming
    `text`."""
    try:
        if isinstance(fmt, TextFormatJSONSchema):
            grammar = json_schema_grammar(fmt.schema_, strict=fmt.strict is not False)
        else:
            grammar = json_object_grammar()
        model.check_grammar(grammar)
    except GrammarError as e:
        raise bad_request(f"text.format: {e}", "text") from None
    params.grammar = grammar


def responses_inputs(
    req: ResponseCreateRequest, model: ServedModel, cap: int
) -> tuple[list[list[int]], list[SamplingParams], ChatOutputOptions]:
    """Prompt ids, sampling params and output options, as for the equivalent chat request."""
    check_unsupported(req)
    try:
        try:
            chat = as_chat_request(req)
        except ValidationError as e:  # a value the chat request refuses: still the client's
            raise from_validation_error(e) from None
        prompts, params, output = chat_inputs(chat, model, cap)
    except APIError as e:
        raise responses_param(e) from None
    fmt = req.text.format if req.text else None
    # JSON output is enforced when the model answers in text: not when it may call tools (a
    # JSON grammar would rule the calls out) and not when a call is forced (its own grammar).
    may_call = bool(req.tools) and req.tool_choice != "none"
    if isinstance(fmt, (TextFormatJSONObject, TextFormatJSONSchema)) and not may_call:
        attach_text_format_grammar(params[0], fmt, model)
    return prompts, params, output


def echoed_settings(req: ResponseCreateRequest, model: ServedModel) -> dict[str, Any]:
    """The request's settings as a response repeats them (unset sampling fields: the values
    used, the model's defaults)."""
    choice: str | dict[str, Any] = "auto"
    if isinstance(req.tool_choice, str):
        choice = req.tool_choice
    elif req.tool_choice is not None:
        choice = req.tool_choice.model_dump()
    fmt = req.text.format if req.text and req.text.format else None
    reasoning = None
    if req.reasoning is not None:
        reasoning = {"effort": req.reasoning.effort, "summary": req.reasoning.summary}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": dict(req.metadata or {}),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "reasoning": reasoning,
        "temperature": (
            model.sampling_defaults.value("temperature")
            if req.temperature is None
            else req.temperature
        ),
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": choice,
        "tools": [t.model_dump() for t in req.tools or []],
        "top_p": model.sampling_defaults.value("top_p") if req.top_p is None else req.top_p,
        "user": req.user,
    }

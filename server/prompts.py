"""Turning API requests into engine inputs: prompts as token ids, and SamplingParams.

Encoding is `ServedModel`'s, shared with `tallow generate`: plain text gets the tokenizer's
special tokens (BOS), a rendered chat template does not, since the template already writes
them where the model wants them. Special tokens come only from the template (or BOS): a
special token's text in messages, prompts or tools is tokenized as text (`ServedModel`'s
rule); clients that want control tokens send token ids. An output constraint
(`response_format`, `guided_*`) becomes `SamplingParams.grammar`, compiled here so a bad
schema, regex or grammar is a 400 naming it.
This module words its errors as OpenAI 400s.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tallow.runtime.constraint import (
    GrammarError,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.served_model import (
    ChatTemplateError,
    NoChatTemplateError,
    PromptTooLongError,
    ServedModel,
    TokenIdError,
)

from .chat_output import ChatOutputOptions
from .errors import bad_request
from .formatters.completions import EchoedPrompt
from .protocol import ChatMessage, CompletionRequest, _SamplingRequest
from .protocol_chat import ChatCompletionRequest
from .reasoning import prompt_opens_reasoning, template_has_reasoning
from .tool_calls import JsonListParser, ToolCallParser, parser_for_template
from .tool_calls.forcing import forced_tool_grammar

# /v1/completions' max_tokens when a request omits it (OpenAI's default there).
COMPLETION_DEFAULT_MAX_TOKENS = 16

# Template variables a request may not set through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _template_arguments(arguments: str) -> Any:
    """A past call's arguments as templates want them. OpenAI sends JSON text; transformers'
    documented message format (what templates are written against, e.g. Llama's `| tojson`)
    has the object itself, so JSON object text becomes that object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_message(m: ChatMessage) -> dict[str, Any]:
    """One request message as `apply_chat_template` takes it."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.content is None and (m.tool_calls or m.role == "tool"):
        out["content"] = None  # left out for the template, as transformers does
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {
                    "name": c.function.name,
                    "arguments": _template_arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def encode_messages(
    model: ServedModel, messages: list[ChatMessage], **template_kwargs: Any
) -> list[int]:
    """A conversation's prompt ids, through the same template rules as `tallow generate`."""
    return render_messages(model, messages, **template_kwargs)[1]


def render_messages(
    model: ServedModel,
    messages: list[ChatMessage],
    *,
    within_context: bool = False,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """A conversation's prompt text and ids; template errors become 400s, and so does a
    prompt too long for the context window when `within_context`."""
    convo = [template_message(m) for m in messages]
    try:
        return model.render_and_encode_chat(convo, within_context=within_context, **template_kwargs)
    except PromptTooLongError as e:
        raise bad_request(str(e), "messages", PromptTooLongError.code) from None
    except NoChatTemplateError:
        raise bad_request(
            "this model has no chat template; use /v1/completions", "messages"
        ) from None
    except ChatTemplateError as e:
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e


def check_token_ids(model: ServedModel, ids: list[int], param: str) -> None:
    try:
        model.check_token_ids(ids)
    except TokenIdError as e:
        raise bad_request(str(e), param, "invalid_token_id") from None


def completion_prompts(req: CompletionRequest, model: ServedModel) -> list[list[int]]:
    p = req.prompt
    try:
        if isinstance(p, str):
            prompts = [model.encode_text(p, within_context=True)]
        elif all(isinstance(x, str) for x in p):
            texts: list[str] = p  # type: ignore[assignment]
            prompts = [model.encode_text(x, within_context=True) for x in texts]
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
    except PromptTooLongError as e:
        raise bad_request(str(e), "prompt", PromptTooLongError.code) from None
    if not prompts:
        raise bad_request("the prompt is empty", "prompt")
    if len(prompts) * req.n > 64:
        raise bad_request("at most 64 completions (prompts x n) per request", "prompt")
    for ids in prompts:
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        check_token_ids(model, ids, "prompt")
    return prompts


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_grammar(req: _SamplingRequest, model: ServedModel) -> str | None:
    """The llguidance grammar of a request's output constraint; None when it has none.

    400 when the request sets more than one constraint, or one that llguidance rejects (the
    message names the parameter and carries llguidance's reason).
    """
    fmt = req.response_format
    given = ["response_format"] if fmt is not None and fmt.type != "text" else []
    given += [name for name in _GUIDED if getattr(req, name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(
            f"only one output constraint per request; got {' and '.join(given)}", given[1]
        )
    param = given[0]
    try:
        if param == "response_format":
            assert fmt is not None
            if fmt.type == "json_object":
                grammar = json_object_grammar()
            elif fmt.json_schema is None:
                raise GrammarError('type "json_schema" needs a json_schema object')
            else:
                js = fmt.json_schema
                # Unset strict counts as strict: keywords llguidance cannot enforce are
                # reported rather than silently ignored.
                schema = {} if js.json_schema is None else js.json_schema
                grammar = json_schema_grammar(schema, strict=js.strict is not False)
        elif param == "guided_json":
            schema = req.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise GrammarError(f"not valid JSON: {e}") from None
            grammar = json_schema_grammar(schema)  # type: ignore[arg-type]
        elif param == "guided_regex":
            grammar = regex_grammar(req.guided_regex)  # type: ignore[arg-type]
        elif param == "guided_choice":
            grammar = choice_grammar(req.guided_choice)  # type: ignore[arg-type]
        else:
            grammar = lark_grammar(req.guided_grammar)  # type: ignore[arg-type]
        model.check_grammar(grammar)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return grammar


def sampling_params(
    req: _SamplingRequest,
    prompt_len: int,
    model: ServedModel,
    max_tokens_cap: int,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingParams:
    """The engine's parameters for one prompt of `req`. The request models have checked the
    ranges; here the values are checked against the model (token ids) and put in the form
    the engine holds."""
    if max_tokens is None:
        # The rest of the context window, capped: if the prompt already fills it, ask for one
        # token so the engine's context check reports the overflow with its usual message.
        max_tokens = max(1, min(max_tokens_cap, model.context_window - prompt_len))
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not re.fullmatch(r"[0-9]{1,10}", key):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
        tid = int(key)
        check_token_ids(model, [tid], "logit_bias")
        bias[tid] = value
    if req.stop_token_ids:
        check_token_ids(model, req.stop_token_ids, "stop_token_ids")
    # A field the request leaves unset takes the model's default (its generation_config.json,
    # recorded in the manifest, or what `tallow serve` was told), else the neutral value.
    defaults = model.sampling_defaults

    def field(name: str) -> Any:
        value = getattr(req, name)
        return defaults.value(name) if value is None else value

    top_p = field("top_p")
    top_k = field("top_k")
    if top_k >= model.vocab_size:
        top_k = 0  # keeps the whole vocabulary: no cut
    if top_p == 0.0:
        # OpenAI's top_p=0: the smallest set of tokens holding probability 0, i.e. the most
        # likely token alone; the engine says that as top_k=1 (its top_p must be positive).
        top_p, top_k = 1.0, 1
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=field("temperature"),
        top_p=top_p,
        top_k=top_k,
        min_p=field("min_p"),
        repetition_penalty=field("repetition_penalty"),
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=bias,
        # numpy wants a non-negative seed; OpenAI accepts any integer.
        seed=None if req.seed is None else req.seed % (1 << 64),
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=req.n,
        grammar=request_grammar(req, model),
        priority=req.priority or 0,
        speculative=req.speculative is not False,
    )


def _check_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tools as the template and the grammar take them; 400 on bad ones."""
    tools = req.tools or []
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in names:
            raise bad_request(f"tools[{i}]: the function name {fn.name!r} is repeated", "tools")
        names.add(fn.name)
        schema = fn.parameters
        if schema is not None and schema.get("type", "object") != "object":
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema of an object "
                f"(type 'object'), got type {schema.get('type')!r}",
                "tools",
            )
    choice = req.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise bad_request(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            "tool_choice",
        )
    return [t.model_dump(exclude_none=True) for t in tools]


def _template_kwargs(req: ChatCompletionRequest, tools: list[dict[str, Any]]) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    if tools:
        kwargs["tools"] = tools
    return kwargs


def _tool_parser(
    req: ChatCompletionRequest, model: ServedModel, forced: bool
) -> ToolCallParser | None:
    """The format to read (and force) calls in, or None when calls are not looked for."""
    if not req.tools or req.tool_choice == "none":
        return None
    source = model.chat_template.template_source if model.chat_template else ""
    parser = parser_for_template(source, [t.function.name for t in req.tools])
    if parser is None and forced:
        return JsonListParser()  # the grammar makes the model write this generic format
    if parser is None and "tools" not in source:
        raise bad_request(
            "this model's chat template does not support tools and its tool-call format is "
            "unknown; leave out tools, or force a call with tool_choice",
            "tools",
            "tools_not_supported",
        )
    return parser


def chat_inputs(
    req: ChatCompletionRequest, model: ServedModel, cap: int
) -> tuple[list[list[int]], list[SamplingParams], ChatOutputOptions]:
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    tools = _check_tools(req)
    forced = req.tool_choice == "required" or not isinstance(req.tool_choice, (str, type(None)))
    parser = _tool_parser(req, model, forced)
    kwargs = _template_kwargs(req, tools)
    prompt, ids = render_messages(model, req.messages, within_context=True, **kwargs)
    source = model.chat_template.template_source if model.chat_template else None
    reasoning = template_has_reasoning(source)
    output = ChatOutputOptions(
        tool_parser=parser,
        max_tool_calls=1 if req.parallel_tool_calls is False else None,
        reasoning=reasoning,
        reasoning_starts_inside=reasoning and prompt_opens_reasoning(prompt),
    )
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(
        req,
        len(ids),
        model,
        cap,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
    )
    if forced and parser is not None:
        if params.grammar is not None:
            raise bad_request(
                "a forced tool_choice and an output constraint (response_format or guided_*) "
                "cannot both apply; drop one",
                "tool_choice",
            )
        choice = req.tool_choice
        choice_dict = choice if isinstance(choice, str) else choice.model_dump()  # type: ignore[union-attr]
        parallel = req.parallel_tool_calls is not False
        try:
            params.grammar = forced_tool_grammar(parser, tools, choice_dict, parallel, model)
        except GrammarError as e:
            raise bad_request(f"the tools cannot be enforced as a grammar: {e}", "tools") from None
    return [ids], [params], output


def completion_inputs(
    req: CompletionRequest, model: ServedModel, cap: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompt ids and engine parameters. With `echo` and `logprobs` the engine scores the
    prompt (`prompt_logprobs`); `max_tokens` 0 then generates nothing: prompt scoring, as
    lm-evaluation-harness asks for loglikelihoods."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens 0 generates nothing; it is allowed only with echo (to return or "
            "score the prompt)",
            "max_tokens",
        )
    prompts = completion_prompts(req, model)
    scored = req.echo and req.logprobs is not None
    params = []
    for ids in prompts:
        p = sampling_params(
            req,
            len(ids),
            model,
            # Without max_tokens, OpenAI's completions default of 16 (less when the window
            # has less room left).
            min(cap, COMPLETION_DEFAULT_MAX_TOKENS),
            max_tokens=req.max_tokens,
            logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs or 0,
        )
        if scored:
            p.prompt_logprobs = req.logprobs
        params.append(p)
    return prompts, params


def echoed_prompts(
    req: CompletionRequest, model: ServedModel, prompts: list[list[int]]
) -> list[EchoedPrompt]:
    """What `echo` puts before each choice: a text prompt as sent, ids decoded."""
    p = req.prompt
    texts = [p] if isinstance(p, str) else list(p) if isinstance(p[0], str) else None
    if texts is None:
        texts = [model.decode(ids) for ids in prompts]
    return [EchoedPrompt(t, ids) for t, ids in zip(texts, prompts, strict=True)]  # type: ignore[arg-type]

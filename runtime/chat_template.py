"""Render Hugging Face (Jinja) chat templates the way transformers' `apply_chat_template` does.

The runtime ships without transformers, so we reproduce the environment that transformers gives a
template: a sandbox (templates come from model files and are untrusted), `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` block, and the globals
and filters templates rely on (`raise_exception`, `strftime_now`, a JSON `tojson`, `namespace`).
Only the standard library and jinja2 are imported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template is invalid, or it refused the conversation (e.g. via `raise_exception`)."""


class _GenerationBlock(jinja2.ext.Extension):
    # transformers marks assistant text with `{% generation %}...{% endgeneration %}` to build
    # training masks. For inference it renders its body unchanged; without the tag such
    # templates would not even parse.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes (<, >, &, ') and always sorts keys; chat templates expect
    # plain JSON with non-ASCII text left as is, as transformers provides.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    # Refuse underscore names so a template cannot reach Python internals through a namespace.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _plain(value: Any) -> Any:
    """A deep copy made of JSON-like types, so a template can neither mutate the caller's
    messages nor call methods of arbitrary objects passed in."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic messages (e.g. OpenAI SDK)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A compiled chat template. Compile once per model, render per request."""

    def __init__(self, template: str, bos_token: str | None, eos_token: str | None):
        if not isinstance(template, str):
            raise ChatTemplateError(
                f"chat template must be a string, got {type(template).__name__}"
            )
        self.template_source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template syntax error at line {e.lineno}: {e.message}"
            ) from e

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages`; extra kwargs (`tools`, `documents`, flags such as
        `enable_thinking`) are passed to the template as variables, like transformers does."""
        if not isinstance(messages, list):
            raise ChatTemplateError(
                f"messages must be a list of dicts, got {type(messages).__name__}"
            )
        chat = []
        for message in messages:
            if callable(getattr(message, "model_dump", None)):
                message = message.model_dump()
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"each message must be a dict, got {message!r}")
            # Like transformers: a key set to None (OpenAI's content=None) counts as absent, since
            # many templates would otherwise print the literal "None".
            message = _plain({k: v for k, v in message.items() if v is not None})
            # Like transformers: reasoning given under an older name is also passed as
            # `reasoning_content` (what most templates read) and `thinking` (gpt-oss).
            reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables = {k: v for k, v in variables.items() if v is not None}
        variables.update(_plain(kwargs))
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e.message or e}") from e
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

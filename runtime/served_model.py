"""What a front end (the HTTP server, `tallow generate`) needs to know about the served model.

`ServedModel` bundles the tokenizer, the chat template, the end-of-sequence ids and the limits
(vocabulary, context window), together with the one set of rules that turns text or a chat
conversation into prompt token ids. Both front ends encode through it, so the CLI and the
server feed the model the same ids for the same conversation.

Errors are plain `ValueError`s carrying the facts; each front end words them for its users
(an OpenAI error body, a CLI message). Nothing here imports TVM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .artifact import TokenizerBundle
from .chat_template import ChatTemplate, ChatTemplateError

__all__ = [
    "ChatTemplateError",
    "NoChatTemplateError",
    "ServedModel",
    "TokenIdError",
]


class NoChatTemplateError(ValueError):
    """A conversation was given, but the model ships no chat template to render it with."""


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"token id {token_id} is outside the vocabulary (size {vocab_size})")
        self.token_id = token_id


@dataclass(frozen=True)
class ServedModel:
    name: str  # the model's own name (the manifest's); a server may publish another one
    tokenizer: Any  # tokenizers.Tokenizer
    vocab_size: int
    context_window: int  # most tokens (prompt + output) per sequence
    eos_token_ids: frozenset[int]
    chat_template: ChatTemplate | None = None

    @classmethod
    def from_runner(
        cls,
        runner: Any,
        tokenizer: Any | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> ServedModel:
        """The bundle for a model runner, from its public attributes.

        The TVM runner carries the artifact's `TokenizerBundle` (`runner.tokenizer`) and its
        `manifest`; other runners (the test fake) carry neither, and their engine supplies the
        tokenizer and EOS ids. An explicit `tokenizer`/`eos_token_ids` wins over the bundle's.
        """
        bundle = getattr(runner, "tokenizer", None)
        if not isinstance(bundle, TokenizerBundle):
            bundle = None
        template = None
        if bundle is not None and bundle.chat_template:
            template = ChatTemplate(bundle.chat_template, bundle.bos_token, bundle.eos_token)
        if tokenizer is None and bundle is not None:
            tokenizer = bundle.tokenizer
        if eos_token_ids is None:
            eos_token_ids = bundle.eos_token_ids if bundle is not None else ()
        manifest = getattr(runner, "manifest", None)
        name = manifest.model.name if manifest is not None else "model"
        return cls(
            name=name,
            tokenizer=tokenizer,
            vocab_size=int(runner.vocab_size),
            context_window=int(runner.context_window),
            eos_token_ids=frozenset(int(t) for t in eos_token_ids),
            chat_template=template,
        )

    # -- prompts -------------------------------------------------------------------------------

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text gets the tokenizer's special tokens (BOS) unless told otherwise."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, messages: list[Mapping[str, Any]], **template_kwargs: Any) -> str:
        """The prompt text for a conversation, ready for the assistant's turn. Extra keyword
        arguments (`tools`, `enable_thinking`, ...) reach the template as variables.

        Raises `NoChatTemplateError`, or `ChatTemplateError` when the template refuses it.
        """
        if self.chat_template is None:
            raise NoChatTemplateError("this model has no chat template")
        return self.chat_template.render(
            list(messages), add_generation_prompt=True, **template_kwargs
        )

    def render_and_encode_chat(
        self, messages: list[Mapping[str, Any]], **template_kwargs: Any
    ) -> tuple[str, list[int]]:
        """The rendered prompt text and its ids (for callers that inspect the text too)."""
        text = self.render_chat(messages, **template_kwargs)
        # The template writes BOS itself where the model wants it (transformers assumes the
        # same), so the tokenizer must not add another.
        return text, self.encode_text(text, add_special_tokens=False)

    def encode_chat(self, messages: list[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        return self.render_and_encode_chat(messages, **template_kwargs)[1]

    # -- token ids -----------------------------------------------------------------------------

    def check_token_ids(self, ids: Iterable[int]) -> None:
        """Raise `TokenIdError` for the first id outside the vocabulary."""
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise TokenIdError(t, self.vocab_size)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (for logprobs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Token ids back to text, special tokens included (what /detokenize returns)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

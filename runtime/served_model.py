"""What a front end (the HTTP server, `tallow generate`) needs to know about the served model.

`ServedModel` bundles the tokenizer, the chat template, the end-of-sequence ids and the limits
(vocabulary, context window), together with the one set of rules that turns text or a chat
conversation into prompt token ids. Both front ends encode through it, so the CLI and the
server feed the model the same ids for the same conversation.

Special tokens (the tokenizer's added tokens marked special: `<|im_start|>`, `<s>`, ...) come
only from the chat template and from the tokenizer's own post-processing (BOS), never from text
a client sends: a message's content, a plain-text prompt, a tool's description are tokenized as
text, so `<|im_end|>` typed in a user message is spelled out and cannot close the user's turn
or open a system one. A client that wants control tokens sends token ids.

Errors are plain `ValueError`s carrying the facts; each front end words them for its users
(an OpenAI error body, a CLI message). Nothing here imports TVM.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .artifact import TokenizerBundle
from .chat_template import ChatTemplate, ChatTemplateError
from .constraint import GrammarTokenizer, check_grammar, grammar_tokenizer
from .request import ContextLengthExceededError
from .sampling_defaults import NEUTRAL, SamplingDefaults

__all__ = [
    "ChatTemplateError",
    "NoChatTemplateError",
    "PromptTooLongError",
    "ServedModel",
    "TokenIdError",
]


class PromptTooLongError(ContextLengthExceededError):
    """A prompt with more characters than the context window's tokens could spell, refused
    before tokenizing it (megabytes of text take seconds to tokenize)."""


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
    # Values for the sampling fields a request leaves unset: the manifest's record of the
    # model's own (`sampling_defaults.py`); a runner without a manifest (the tests' fake)
    # gets OpenAI's neutral ones. `tallow serve` flags may replace them.
    sampling_defaults: SamplingDefaults = NEUTRAL

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
            sampling_defaults=manifest.sampling_defaults if manifest is not None else NEUTRAL,
        )

    # -- prompts -------------------------------------------------------------------------------

    def encode_text(
        self, text: str, add_special_tokens: bool = True, *, within_context: bool = False
    ) -> list[int]:
        """Plain text gets the tokenizer's special tokens (BOS) unless told otherwise; special
        tokens spelled inside `text` stay text (see the module docstring). `within_context`:
        raise `PromptTooLongError` for text too long to fit, without tokenizing it."""
        if within_context:
            self.check_prompt_chars(text)
        return _encode(self._text_tokenizer, text, add_special_tokens)

    def check_prompt_chars(self, text: str) -> None:
        """Raise `PromptTooLongError` when `text` needs more tokens than the context window
        holds, judged from its length alone: no token spells more than `max_token_chars`
        characters, so a text longer than window x that cannot fit. Exact, and free: a 3.6 MB
        message that could never fit took 3.8 s to tokenize before it was refused."""
        limit = self.context_window * self.max_token_chars
        if len(text) <= limit:
            return
        # What the tokenizer splits is the normalized text, which may be shorter (NFC joins
        # a letter and its combining accent; a strip drops spaces).
        normalizer = getattr(self.tokenizer, "normalizer", None)
        n = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
        if n > limit:
            raise PromptTooLongError(
                f"this model's context window is {self.context_window} tokens; the prompt has "
                f"{n} characters, more than {self.context_window} tokens can hold (one token "
                f"spells at most {self.max_token_chars} characters)"
            )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters a token's text can cover: the longest vocabulary entry (a
        byte-level vocabulary writes each byte as one character, so an entry is never
        shorter than the text it decodes to)."""
        get_vocab = getattr(self.tokenizer, "get_vocab", None)
        if get_vocab is None:
            return 1 << 30  # not a `tokenizers.Tokenizer`: no bound
        return max((len(t) for t in get_vocab(with_added_tokens=True)), default=1)

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
        self,
        messages: list[Mapping[str, Any]],
        *,
        within_context: bool = False,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The rendered prompt text and its ids (for callers that inspect the text too).

        Special tokens in the ids come only from the template. Every string the caller passes
        (contents, names, tool calls and tools, template variables) that spells a special token
        has each occurrence swapped for a marker before rendering; the rendered text is then
        tokenized piece by piece: the template's pieces with special-token parsing, each marker
        as the text it stands for, without. A conversation that spells no special token (the
        usual case) renders and tokenizes in one piece, exactly as transformers'
        `apply_chat_template` does. `within_context`: a rendered prompt too long to fit raises
        `PromptTooLongError` before it is tokenized.
        """
        specials = self._special_pattern
        originals: list[str] = []
        if specials is not None:
            sentinel = _free_sentinel(
                [
                    messages,
                    template_kwargs,
                    self.chat_template and self.chat_template.template_source,
                ]
            )

            def mark(text: str) -> str:
                def one(m: re.Match[str]) -> str:
                    originals.append(m.group(0))
                    return f"{sentinel}{len(originals) - 1}{sentinel}"

                return specials.sub(one, text)

            marked_messages = _map_strings(list(messages), mark)
            marked_kwargs = _map_strings(template_kwargs, mark)
        if not originals:
            text = self.render_chat(messages, **template_kwargs)
            if within_context:
                self.check_prompt_chars(text)
            # The template writes BOS itself where the model wants it (transformers assumes the
            # same), so the tokenizer must not add another.
            return text, self._encode_template_text(text)
        rendered = self.render_chat(marked_messages, **marked_kwargs)
        if within_context:
            self.check_prompt_chars(rendered)
        pieces = re.split(f"{sentinel}([0-9]+){sentinel}", rendered)
        ids: list[int] = []
        text_parts: list[str] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:  # the template's text, with special-token-free client text in it
                text_parts.append(piece)
                ids += self._encode_template_text(piece) if piece else []
            else:  # a special token the client spelled: text
                original = originals[int(piece)]
                text_parts.append(original)
                ids += self.encode_text(original, add_special_tokens=False)
        return "".join(text_parts), ids

    def encode_chat(self, messages: list[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        return self.render_and_encode_chat(messages, **template_kwargs)[1]

    def _encode_template_text(self, text: str) -> list[int]:
        """Template output: special tokens spelled in it are the control tokens."""
        return _encode(self.tokenizer, text, False)

    @functools.cached_property
    def _text_tokenizer(self) -> Any:
        """A copy of the tokenizer that reads special-token text as text
        (`tokenizers.Tokenizer.encode_special_tokens`); a copy, because the attribute is the
        tokenizer's state and the original is shared (detokenizers, grammars, other threads)."""
        tok = self.tokenizer
        if not hasattr(tok, "encode_special_tokens") or not hasattr(tok, "to_str"):
            return tok  # not a `tokenizers.Tokenizer`: nothing to switch off
        copy = type(tok).from_str(tok.to_str())
        copy.encode_special_tokens = True
        return copy

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        """Matches the special tokens' texts (longest first); None when there are none."""
        added = getattr(self.tokenizer, "get_added_tokens_decoder", None)
        if added is None:
            return None
        texts = {t.content for t in added().values() if t.special and t.content}
        if not texts:
            return None
        ordered = sorted(texts, key=lambda t: (-len(t), t))
        return re.compile("|".join(re.escape(t) for t in ordered))

    # -- grammars ------------------------------------------------------------------------------

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's view of the tokenizer, shared with the engine (and its cache of
        compiled grammars, so a grammar a front end checked is not compiled again)."""
        return grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def check_grammar(self, grammar: str) -> None:
        """Compile `grammar` for this model as the engine will; raises `GrammarError`."""
        check_grammar(grammar, self.grammar_tokenizer)

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
        batch = getattr(self.tokenizer, "decode_batch", None)
        if batch is None:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return batch([ids], skip_special_tokens=False)[0]  # without the GIL, as `_encode`


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text).ids`, through `encode_batch`: `tokenizers` 0.23's `encode`
    holds the GIL throughout (a 3.6 MB prompt on a worker thread still stopped the event loop
    for 3-5 s), `encode_batch` releases it (the loop's worst gap: 10 ms) and gives the same
    ids."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:  # not a `tokenizers.Tokenizer`
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _map_strings(value: Any, fn: Any) -> Any:
    """`value` (JSON-like) with `fn` applied to every string in it, dict keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _map_strings(value.model_dump(), fn)
    return value


def _free_sentinel(values: Any) -> str:
    """A private-use character that no string in `values` contains (a marker delimiter)."""
    seen: set[str] = set()
    _map_strings(values, lambda s: seen.update(c for c in s if "\ue000" <= c <= "\uf8ff"))
    for code in range(0xE000, 0xF900):
        if chr(code) not in seen:
            return chr(code)
    raise ChatTemplateError("the conversation uses every private-use character")

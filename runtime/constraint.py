"""Constrained decoding: grammars, the tokenizer they are matched against, per-sequence matchers.

The one home of grammar handling, built on llguidance. A constraint travels as an llguidance
grammar string (`SamplingParams.grammar`), made by one of the builders:

* `json_schema_grammar(schema, strict=True)`: JSON that validates against a JSON Schema;
  `strict=False` ignores keywords llguidance does not implement instead of rejecting them;
* `json_object_grammar()`: any JSON object (OpenAI's `json_object` mode);
* `regex_grammar(pattern)`, `choice_grammar(choices)`, `lark_grammar(text)`.

Builders refuse only a grammar past tallow's size limits (`grammar_limits.py`: a deep enough
grammar crashes llguidance) or a schema that is not one; `check_grammar(grammar, tokenizer)`
compiles a grammar and raises `GrammarError` (a `ValueError` carrying llguidance's message),
which a front end reports as a bad request before the engine sees it. Everything that
compiles runs on a deep-stack thread (`deep_stack.py`).

`grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)` wraps the artifact's `tokenizers`
tokenizer once per model (about 0.3 s for a 49k vocabulary): the mask is `vocab_size` wide, the
width of the logits, which can be wider than the tokenizer's vocabulary (padding tokens are
never allowed). `GrammarTokenizer.matcher(grammar)` gives a `GrammarMatcher`, the state of one
sequence: the allowed-token mask for its next token, `accept(token)`, `is_finished` (the
grammar is complete: the engine finishes with "stop") and `is_dead_end` (the matcher errored
or stopped short of a complete output: the engine finishes with "grammar_error").

Masks are bitmasks, one bit per token in int32 words (llguidance's layout); `compute_masks`
fills several sequences' masks at once with llguidance's thread pool, without the GIL, so the
engine computes them in a worker thread while the forward runs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance as llg
import numpy as np

from tallow.runtime import grammar_limits
from tallow.runtime.deep_stack import run_on_deep_stack

__all__ = [
    "GRAMMAR_ERROR",
    "GrammarError",
    "GrammarMatcher",
    "GrammarTokenizer",
    "check_grammar",
    "choice_grammar",
    "compute_masks",
    "disallow_tokens",
    "grammar_tokenizer",
    "json_object_grammar",
    "json_schema_grammar",
    "lark_grammar",
    "masks_to_bool",
    "regex_grammar",
]

# The finish reason of a sequence whose grammar cannot be continued (no token allowed, or the
# matcher entered its error state).
GRAMMAR_ERROR = "grammar_error"

_MATCHER_CACHE_SIZE = 64  # compiled grammars kept per tokenizer (a template each, then copied)


class GrammarError(ValueError):
    """A grammar (JSON Schema, regex, Lark, ...) llguidance rejects; the message is its own."""


# -- grammar builders ------------------------------------------------------------------------


def json_schema_grammar(schema: dict[str, Any], strict: bool = True) -> str:
    """JSON that validates against `schema`. Not strict: unimplemented keywords are ignored
    (the output may then not validate against them); strict: they are an error."""
    if not isinstance(schema, dict):
        raise GrammarError("a JSON Schema must be a JSON object")
    _within_limits(grammar_limits.check_schema, schema)
    try:
        return run_on_deep_stack(
            llg.LLMatcher.grammar_from_json_schema,
            schema,
            overrides=None if strict else {"lenient": True},
        )
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON Schema: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """Text that `pattern` matches in full (Rust regex syntax: no lookarounds or backrefs)."""
    _within_limits(grammar_limits.check_regex, pattern)
    return run_on_deep_stack(llg.LLMatcher.grammar_from_regex, pattern)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices`."""
    if not choices:
        raise GrammarError("a choice needs at least one option")
    _within_limits(grammar_limits.check_choices, choices)
    # One terminal, not one rule alternative per option: llguidance's parser keeps an item per
    # live alternative and stops at 2,000 in a row (a 2,500-option choice compiled, then ended
    # in "grammar_error" after its first token); a terminal's options are one lexer automaton,
    # built lazily, whatever their number (60,000 options, 1.3 MB: 1.3 s to compile, and
    # not recursive: the Lark text limit is not theirs). Lark strings take JSON escapes.
    text = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(str(c)) for c in choices)
    return run_on_deep_stack(llg.LLMatcher.grammar_from_lark, text)


def lark_grammar(text: str) -> str:
    """A grammar in llguidance's Lark dialect (`start` is the start rule)."""
    _within_limits(grammar_limits.check_lark, text)
    return run_on_deep_stack(llg.LLMatcher.grammar_from_lark, text)


def _within_limits(check: Any, value: Any) -> None:
    try:
        check(value)
    except grammar_limits.GrammarLimitError as e:
        raise GrammarError(str(e)) from None


def check_grammar(grammar: str, tokenizer: GrammarTokenizer | None = None) -> None:
    """Raise `GrammarError` with llguidance's message when `grammar` does not compile.

    With a tokenizer the grammar is compiled as the engine will (and kept in its cache, so the
    engine does not compile it again); without one only the grammar itself is checked.
    """
    if tokenizer is not None:
        tokenizer.matcher(grammar)
        return
    is_error, messages = run_on_deep_stack(llg.LLMatcher.validate_grammar_with_warnings, grammar)
    if is_error:
        raise GrammarError(_clean(messages[0] if messages else "invalid grammar"))


def _clean(message: str) -> str:
    # llguidance appends its parser state and the whole grammar to some errors; keep the
    # part a client can act on.
    return message.split("\n<state>", 1)[0].strip()


# -- the tokenizer and matchers ----------------------------------------------------------------


class GrammarTokenizer:
    """llguidance's view of one model's tokenizer, plus a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        eos = sorted({int(t) for t in eos_token_ids})
        own = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.vocab_size = int(vocab_size)  # the logits' width
        n_vocab = max(self.vocab_size, own)
        self.ll = llg.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos or None)
        self.eos_token_ids = tuple(eos) if eos else tuple(self.ll.eos_tokens)
        self.mask_words = (n_vocab + 31) // 32
        self._templates: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; raises `GrammarError` if it does not compile.

        Compiled grammars are cached (LRU): a repeated grammar costs a copy, not a compile.
        """
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
                return GrammarMatcher(self, template.deep_copy())
        # Compiling drops the GIL; it runs outside the lock so others are not held up, on a
        # deep stack: llguidance recurses as deep as the grammar nests (`deep_stack.py`).
        m = run_on_deep_stack(llg.LLMatcher, self.ll, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_clean(m.get_error()))
        with self._lock:
            self._templates[grammar] = m
            while len(self._templates) > _MATCHER_CACHE_SIZE:
                self._templates.popitem(last=False)
            return GrammarMatcher(self, m.deep_copy())

    def empty_masks(self, rows: int) -> np.ndarray:
        return np.zeros((rows, self.mask_words), dtype=np.int32)


_tokenizers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, GrammarTokenizer]] = {}
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(
    tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]
) -> GrammarTokenizer:
    """The `GrammarTokenizer` of a `tokenizers.Tokenizer`, built once per (tokenizer, width,
    EOS ids): the server's request checks and the engine share it, and its grammar cache."""
    eos = tuple(sorted({int(t) for t in eos_token_ids}))
    key = (id(tokenizer), int(vocab_size), eos)
    with _tokenizers_lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        gt = GrammarTokenizer(tokenizer, vocab_size, eos)
        if len(_tokenizers) >= 8:
            _tokenizers.pop(next(iter(_tokenizers)))
        # The entry holds the tokenizer, so its id cannot be reused while cached.
        _tokenizers[key] = (tokenizer, gt)
        return gt


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m", "tokenizer")

    def __init__(self, tokenizer: GrammarTokenizer, matcher: llg.LLMatcher) -> None:
        self.tokenizer = tokenizer
        self._m = matcher

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the next token's bitmask into `out` (int32, `mask_words` long, contiguous)."""
        if out.dtype != np.int32 or out.size != self.tokenizer.mask_words:
            raise ValueError("mask row must be int32 and mask_words long")
        if not out.flags["C_CONTIGUOUS"]:
            raise ValueError("mask row must be contiguous")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def allowed_mask(self) -> np.ndarray:
        """The tokens allowed next, as a bool array as wide as the logits."""
        row = self.tokenizer.empty_masks(1)
        self.fill_mask(row[0])
        return masks_to_bool(row, self.tokenizer.vocab_size)[0]

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and a dead end from now on) if not allowed."""
        return self._m.consume_token(int(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (nothing consumed)."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens."""
        self._m.rollback(int(count))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing more may follow (only EOS is allowed)."""
        m = self._m
        return m.is_stopped() and not m.is_error() and m.is_accepting()

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete (EOS would be allowed), though it may go on."""
        return self._m.is_accepting()

    @property
    def is_dead_end(self) -> bool:
        """No output can complete the grammar: the matcher errored or stopped unsatisfied."""
        m = self._m
        return m.is_error() or (m.is_stopped() and not m.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher is a dead end ("" while it is not)."""
        if self._m.is_error():
            message = _clean(self._m.get_error())
            if message.isidentifier():  # a bare stop reason, such as "NoExtensionBias"
                return f"no token can continue the grammar ({message})"
            return message
        if self.is_dead_end:
            return f"no token can continue the grammar ({self._m.stop_reason()})"
        return ""

    def clone(self) -> GrammarMatcher:
        """An independent copy at the same position (for n > 1 forks)."""
        return GrammarMatcher(self.tokenizer, self._m.deep_copy())

    def reset(self) -> None:
        """Back to the grammar's start."""
        self._m.reset()


_executor: llg.LLExecutor | None = None


def compute_masks(matchers: Sequence[GrammarMatcher], out: np.ndarray | None = None) -> np.ndarray:
    """Each matcher's next-token bitmask, one int32 row per matcher.

    Runs without the GIL; several matchers go through llguidance's thread pool.
    """
    global _executor
    if not matchers:
        return np.zeros((0, 0), dtype=np.int32)
    tok = matchers[0].tokenizer
    if out is None:
        out = tok.empty_masks(len(matchers))
    if len(matchers) == 1:
        matchers[0].fill_mask(out[0])
        return out
    if _executor is None:
        _executor = llg.LLExecutor()
    pairs = [(m._m, i) for i, m in enumerate(matchers)]
    _executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, tok.mask_words * 4, len(matchers))
    return out


def masks_to_bool(masks: np.ndarray, width: int) -> np.ndarray:
    """Bitmask rows (int32 words, bit j of word w = token 32 w + j) as bool [rows, width]."""
    words = np.ascontiguousarray(masks, dtype="<i4")  # llguidance writes little-endian words
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :width].view(bool)


def disallow_tokens(mask: np.ndarray, token_ids: Iterable[int]) -> None:
    """Clear `token_ids`' bits in one bitmask row, in place."""
    words = mask.view(np.uint32)
    for t in token_ids:
        if 0 <= t < 32 * words.size:
            words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))

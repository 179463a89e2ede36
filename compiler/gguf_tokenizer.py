"""Rebuild a Hugging Face `tokenizers` tokenizer from the metadata of a GGUF file.

A GGUF carries no `tokenizer.json`; llama.cpp stores the vocabulary, merges/scores, token types and
special-token ids as `tokenizer.ggml.*` metadata. We turn that back into a `tokenizers.Tokenizer`
(plus the bits of `tokenizer_config.json` that transformers needs) so the runtime can tokenize with
the fast Rust implementation and never needs llama.cpp or the original HF repo.

Two vocabulary families are supported, named by `tokenizer.ggml.model`:

* ``gpt2``  - byte-level BPE. The tokens are already spelled in GPT-2's byte alphabet and the file
  lists the merges. How text is split before BPE depends on `tokenizer.ggml.pre`.
* ``llama`` - SentencePiece BPE (Llama 1/2, Mistral, ...). Tokens use ``▁`` for spaces, bytes that
  have no piece fall back to ``<0xNN>`` tokens, and the merge order is implied by the scores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp's token types (gguf.TokenType); the values match sentencepiece's piece types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The GPT-2 split, written into tokenizers' ByteLevel pre-tokenizer when use_regex=True.
# Llama-3 style split: case-insensitive contractions, a letter run may take one leading
# non-letter, numbers in groups of at most three, newlines kept with the punctuation before them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is the Llama-3 split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# `tokenizer.ggml.pre` values grouped by the split they need (names as llama.cpp writes them).
_GPT2_PRES = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"}
_DIGIT_THEN_GPT2_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_LLAMA3_PRES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"}
_QWEN2_PRES = {"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"}


@dataclass
class GGUFTokenizer:
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    unk_token_id: int | None = None
    model_max_length: int | None = None

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    def save(self, folder: Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json`, loadable by `AutoTokenizer`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(folder / "tokenizer.json"))
        config: dict = {
            # The generic fast class: it takes everything from tokenizer.json and does not
            # rebuild the pre-tokenizer the way a model-specific class (e.g. LlamaTokenizer) would.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token(self.bos_token_id),
            "eos_token": self._token(self.eos_token_id),
            "pad_token": self._token(self.pad_token_id),
            "unk_token": self._token(self.unk_token_id),
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        config = {k: v for k, v in config.items() if v is not None}
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (folder / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")


def _value(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value as a Python object (str, int, bool, list), or `default` if absent."""
    field = reader.get_field(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    # Older gguf packages: strings are uint8 arrays in parts[data[i]], scalars one-element arrays.
    main_type = field.types[0]
    elem_type = field.types[-1]

    def one(index: int):
        part = field.parts[index]
        if elem_type == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if main_type == gguf.GGUFValueType.ARRAY:
        return [one(i) for i in field.data]
    return one(field.data[0])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _gpt2_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRES:
        # llama.cpp's "default" adds extra punctuation/digit splits that no HF tokenizer has; the
        # files that say "default" were converted from HF GPT-2-style tokenizers, so use that split.
        return byte_level_gpt2
    if pre in _DIGIT_THEN_GPT2_PRES:
        # Each digit is its own word first, then the GPT-2 split (as in SmolLM's tokenizer.json).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level_gpt2]
        )
    split = {
        **dict.fromkeys(_LLAMA3_PRES, _LLAMA3_SPLIT),
        **dict.fromkeys(_QWEN2_PRES, _QWEN2_SPLIT),
    }
    if pre in split:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_PRES | _DIGIT_THEN_GPT2_PRES | set(split))
    raise ValueError(
        f"Unsupported tokenizer.ggml.pre {pre!r} for a gpt2 vocabulary; known: {known}"
    )


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    # A few GGUF vocabularies repeat a string; BPE needs one id per string, keep the first.
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _gpt2_model(tokens: list[str], types: list[int], merges: list[str]) -> models.BPE:
    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    spelled = []
    for tok, typ in zip(tokens, types, strict=True):
        # Normal tokens must be written in the byte alphabet for BPE to ever produce them; some
        # converters store raw text instead, so respell those. Added tokens are matched on raw
        # text and keep their spelling.
        if typ in (_NORMAL, _UNKNOWN, _UNUSED, _BYTE) and not set(tok) <= alphabet:
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        spelled.append(tok)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    return models.BPE(vocab=_unique_vocab(spelled), merges=pairs, fuse_unk=False)


def _spm_merges(
    tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the highest-scoring
    piece. HF BPE applies an ordered merge list instead; listing every (left, right) split of each
    piece, ranked by the joined piece's score, makes the two pick the same merges.
    """
    ranked = []
    for tok, score, typ in zip(tokens, scores, types, strict=True):
        # Control/byte/unknown pieces are never the result of a merge; unused ones are disabled.
        if typ not in (_NORMAL, _USER_DEFINED) or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[tok], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]


def _llama_tokenizer(
    tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, prefix: bool
) -> Tokenizer:
    vocab = _unique_vocab(tokens)
    merges = _spm_merges(tokens, scores, types, vocab)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # Spaces become "▁" and, with add_space_prefix, one "▁" is prepended, as sentencepiece does.
    # A normalizer (not Metaspace) because Metaspace skips the prefix when the text already starts
    # with a space, unlike sentencepiece. Being a normalizer, it also runs on each text run after a
    # special token, which is what llama.cpp and the original Llama-2 tokenizer.json do.
    space = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), space]) if prefix else space
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # undo the prepended space
    tok.decoder = decoders.Sequence(steps)
    return tok


def _post_processor(
    tok: Tokenizer, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    used: dict[str, int] = {}
    head: list[str] = []
    tail: list[str] = []
    if add_bos and bos is not None:
        used[tok.id_to_token(bos)] = bos
        head = [tok.id_to_token(bos)]
    if add_eos and eos is not None:
        used[tok.id_to_token(eos)] = eos
        tail = [tok.id_to_token(eos)]
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *[f"{t}:1" for t in head], "$B:1", *[f"{t}:1" for t in tail]],
        special_tokens=list(used.items()),
    )


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> GGUFTokenizer:
    model = _value(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise ValueError(
            f"Unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )
    tokens: list[str] = _value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    types: list[int] = _value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

    def token_id(key: str) -> int | None:
        value = _value(reader, f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos, eos, eot = token_id("bos_token_id"), token_id("eos_token_id"), token_id("eot_token_id")
    pad, unk = token_id("padding_token_id"), token_id("unknown_token_id")

    if model == "gpt2":
        merges = _value(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("gpt2 tokenizer in GGUF file lacks tokenizer.ggml.merges")
        tok = Tokenizer(_gpt2_model(tokens, types, merges))
        tok.pre_tokenizer = _gpt2_pre_tokenizer(_value(reader, "tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
        default_add_bos = False
    else:
        scores = _value(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("llama tokenizer in GGUF file lacks tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ValueError(f"GGUF has {len(tokens)} tokens but {len(scores)} scores")
        if unk is None and _UNKNOWN in types:
            unk = types.index(_UNKNOWN)
        prefix = bool(_value(reader, "tokenizer.ggml.add_space_prefix", True))
        tok = _llama_tokenizer(tokens, scores, types, unk, prefix)
        # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
        default_add_bos = True

    # Control (and unknown) tokens become special: matched whole, dropped by skip_special_tokens.
    # User-defined tokens are matched whole too (llama.cpp does) but are ordinary text.
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, typ in zip(tokens, types, strict=True)
        if typ in (_CONTROL, _UNKNOWN)
    ]
    for token_id_ in (bos, eos, eot, pad):
        if token_id_ is not None and types[token_id_] not in (_CONTROL, _UNKNOWN):
            specials.append(AddedToken(tokens[token_id_], special=True, normalized=False))
    tok.add_special_tokens(specials)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED
    ]
    tok.add_tokens(user)

    add_bos = bool(_value(reader, "tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(_value(reader, "tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tok, bos, eos, add_bos, add_eos)

    arch = _value(reader, "general.architecture")
    ctx = _value(reader, f"{arch}.context_length") if arch else None
    return GGUFTokenizer(
        tokenizer=tok,
        bos_token_id=bos,
        eos_token_id=eos,
        eot_token_id=eot,
        pad_token_id=pad,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_value(reader, "tokenizer.chat_template"),
        unk_token_id=unk,
        model_max_length=int(ctx) if ctx is not None else None,
    )

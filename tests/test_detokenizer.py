"""IncrementalDetokenizer against full decode, on tokenizers built here (no downloads).

Two families: byte-level BPE (GPT-2/Llama-3 style: every byte is a token, characters split
over tokens) and SentencePiece-style BPE with byte fallback (Llama-2 style: `<0xE2>` tokens,
Metaspace "▁" spaces, a decoder that strips the first leading space).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tallow.runtime.detokenizer import IncrementalDetokenizer, byte_level_pieces

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "Café, naïve, façade, über, jalapeño, crème brûlée — déjà vu.",
    "日本語のテキストと中文文本，还有한국어 텍스트도 있습니다。",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 👨‍👩‍👧 and math ∑ ∫ √ ≈ ≠ ∞.",
    "The quick brown fox jumps over the lazy dog. 123 4567 89.",
    "Ελληνικά και русский текст, עברית وعربي.",
]
SPECIALS = ["<s>", "</s>", "<|im_end|>"]


def _sample_texts(rng: random.Random, n: int) -> list[str]:
    pool = "".join(CORPUS) + "  \n\t"
    # Characters outside the training corpus too: they exercise pure byte paths.
    pool += "€ẞ✓🚀𝔘ⅷ᠀ꙮ"
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        out.append("".join(rng.choice(pool) for _ in range(k)))
    return out


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


def _byte_fallback_bpe() -> Tokenizer:
    """Llama-2 style: train a small char BPE, then splice <0x00>..<0xFF> into its vocab."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", *SPECIALS],
        limit_alphabet=70,  # most accented/CJK/emoji characters must fall back to bytes
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer(request) -> Tokenizer:
    return _byte_level_bpe() if request.param == "byte_level" else _byte_fallback_bpe()


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = ()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(t) for t in ids]
    return pieces, detok.flush()


def test_tokenizers_really_split_characters(tokenizer):
    # Guard for the tests below: multi-byte characters must span several tokens.
    ids = tokenizer.encode("😀€ẞ").ids
    assert len(ids) > 3
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    if tokenizer.get_vocab().get("<0xE2>") is not None:
        assert tokenizer.token_to_id("<0xE2>") in tokenizer.encode("€").ids


def test_valid_text_streams_exactly_and_never_emits_partial_characters(tokenizer):
    rng = random.Random(0)
    for text in _sample_texts(rng, 300):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        assert "\ufffd" not in expected  # the tokenizers round-trip valid text
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) + tail == expected
        for piece in [*pieces, tail]:
            assert "\ufffd" not in piece
        # Only a still-open byte-fallback run may be left for flush().
        if tail:
            assert _is_byte_token(tokenizer, ids[-1])


def _is_byte_token(tok: Tokenizer, token_id: int) -> bool:
    piece = tok.id_to_token(token_id)
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def test_streaming_lags_only_by_unfinished_characters(tokenizer):
    # Emitted text is always a prefix of the final decode, and once the decode so far ends in
    # a complete character outside a byte run, nothing is held back.
    rng = random.Random(1)
    for text in _sample_texts(rng, 80):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        final = tokenizer.decode(ids)
        detok = IncrementalDetokenizer(tokenizer, [])
        emitted = ""
        for n, t in enumerate(ids, 1):
            emitted += detok.push(t)
            assert final.startswith(emitted)
            so_far = tokenizer.decode(ids[:n])
            if not so_far.endswith("\ufffd") and not _is_byte_token(tokenizer, t):
                assert emitted == so_far


def test_random_ids_match_full_decode(tokenizer):
    # Arbitrary id streams (invalid UTF-8, special tokens anywhere): pushes + flush == decode.
    rng = random.Random(2)
    size = tokenizer.get_vocab_size()
    special_ids = [tokenizer.token_to_id(s) for s in SPECIALS]
    for _ in range(400):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 30))]
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special_ids))
        final = tokenizer.decode(ids, skip_special_tokens=True)
        pieces, tail = _stream(tokenizer, ids)
        assert "".join(pieces) + tail == final
        # Never emit text that a later token rewrites.
        emitted = ""
        for piece in pieces:
            emitted += piece
            assert final.startswith(emitted)


def test_special_tokens_skipped_mid_stream(tokenizer):
    ids = tokenizer.encode("Café 😀 ok", add_special_tokens=False).ids
    eos = tokenizer.token_to_id("</s>")
    mixed = ids[:2] + [eos] + ids[2:] + [eos]
    pieces, tail = _stream(tokenizer, mixed)
    assert "".join(pieces) + tail == "".join(pieces) == tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    streamed = "".join(detok.push(t) for t in mixed) + detok.flush()
    assert streamed == tokenizer.decode(mixed, skip_special_tokens=False)
    assert "</s>" in streamed


def test_prompt_does_not_change_default_output(tokenizer):
    rng = random.Random(3)
    for text in _sample_texts(rng, 40):
        prompt = tokenizer.encode("Prompt: déjà 😀", add_special_tokens=False).ids
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces, tail = _stream(tokenizer, ids, prompt)
        assert "".join(pieces) + tail == tokenizer.decode(ids)


def test_prompt_context_keeps_the_leading_space():
    tok = _byte_fallback_bpe()
    prompt = tok.encode("The capital of France is", add_special_tokens=False).ids
    # The SentencePiece normaliser prepends "▁", so this output starts with "▁Paris".
    out = tok.encode("Paris, naïve 🚀", add_special_tokens=False).ids
    assert tok.id_to_token(out[0]).startswith("▁")
    detok = IncrementalDetokenizer(tok, prompt, prompt_context=True)
    streamed = "".join(detok.push(t) for t in out) + detok.flush()
    assert streamed == " Paris, naïve 🚀"
    # The default mode follows decode(output_ids), which strips that first space.
    pieces, tail = _stream(tok, out)
    assert "".join(pieces) + tail == tok.decode(out) == "Paris, naïve 🚀"
    assert tail == "🚀"  # an output-final byte run is released by flush()


def test_window_stays_small_over_long_outputs():
    tok = _byte_level_bpe()
    ids = tok.encode("Café 😀 日本語 " * 200, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [])
    out = []
    for t in ids:
        out.append(detok.push(t))
        assert len(detok._ids) - detok._prefix_offset < 32
    assert "".join(out) == tok.decode(ids)


def test_byte_level_table_streams_like_the_window_decoder():
    """The fast path: per-token bytes through an incremental UTF-8 decoder. On valid text it
    never emits a partial character and never lags the window decoder (it can lead it: a
    token holding " " plus a character's first byte releases the space at once); on any ids
    its total is `decode`'s."""
    tok = _byte_level_bpe()
    rng = random.Random(5)
    for skip in (True, False):
        pieces = byte_level_pieces(tok, skip_special_tokens=skip)
        for text in _sample_texts(rng, 40):
            ids = tok.encode(text).ids
            fast = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, byte_pieces=pieces)
            slow = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            fast_chunks = [fast.push(t) for t in ids]
            slow_chunks = [slow.push(t) for t in ids]
            assert "".join(fast_chunks) + fast.flush() == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in c for c in fast_chunks)
            fast_len = np.cumsum([len(c) for c in fast_chunks])
            assert (fast_len >= np.cumsum([len(c) for c in slow_chunks])).all()
        vocab = tok.get_vocab_size()
        for _ in range(200):  # random ids: lone bytes, broken characters, special tokens
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            fast = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, byte_pieces=pieces)
            text = "".join(fast.push(t) for t in ids) + fast.flush()
            assert text == tok.decode(ids, skip_special_tokens=skip)


def test_byte_level_table_only_for_byte_level_decoders():
    assert byte_level_pieces(_byte_fallback_bpe()) is None
    assert len(byte_level_pieces(_byte_level_bpe())) == _byte_level_bpe().get_vocab_size()

"""GGUF -> tokenizers parity tests.

Oracles: transformers' own GGUF tokenizer loader (SmolLM2, byte-level BPE), and sentencepiece
itself for the llama/SentencePiece path (a model trained here and exported into GGUF metadata).
"""

from __future__ import annotations

import io
import re

import gguf
import numpy as np
import pytest

from tallow.compiler.gguf_tokenizer import tokenizer_from_gguf

from conftest_gguf import (  # noqa: F401  (fixtures)
    smollm2_gguf,
    smollm2_hf_tokenizer,
    smollm2_reader,
)

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ünïcödé ŝtřïñğ ẞ",
    "日本語のテキストと中文句子，한국어",
    "emoji 🤖🎉 family 👩‍👩‍👧 flags 🇫🇷",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\n",
    "a   b\n\n\n  c \t d    \n",
    "   leading and trailing   ",
    "I'm sure we'll see, don't you THINK'S?",
    "1234567 3.14159 1,000,000 2024-05-01",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y<repo_name>z",
    "<|im_start|",
    "",
    " ",
    "\n",
    "\u00a0non-breaking\u200bzero-width",
    '{"json": [1, 2, {"k": "v"}], "html": "<b>&amp;</b>"}',
]


@pytest.fixture(scope="module")
def smollm2(smollm2_reader, smollm2_hf_tokenizer):  # noqa: F811
    return tokenizer_from_gguf(smollm2_reader), smollm2_hf_tokenizer


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_encode_matches_transformers(smollm2, text):
    ours, ref = smollm2
    for special in (True, False):
        expected = ref(text, add_special_tokens=special)["input_ids"]
        assert ours.tokenizer.encode(text, add_special_tokens=special).ids == expected


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_decode_matches_transformers(smollm2, text):
    ours, ref = smollm2
    ids = ref(text)["input_ids"]
    for skip in (True, False):
        assert ours.tokenizer.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


def test_smollm2_special_tokens(smollm2):
    ours, ref = smollm2
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.add_bos_token is False and ours.add_eos_token is False
    assert ours.chat_template == ref.chat_template
    assert ours.model_max_length == 8192
    im_start = ref.convert_tokens_to_ids("<|im_start|>")
    assert ours.tokenizer.encode("<|im_start|>", add_special_tokens=False).ids == [im_start]
    assert ours.tokenizer.decode([im_start, *ref.encode("hi")], skip_special_tokens=True) == "hi"
    assert ours.tokenizer.get_vocab_size() == len(ref)


def test_smollm2_save_roundtrip(smollm2, tmp_path):
    """What `save` writes loads in AutoTokenizer and behaves like transformers' GGUF tokenizer."""
    ours, ref = smollm2
    ours.save(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
    )
    assert loaded.chat_template == ref.chat_template
    assert loaded.model_max_length == 8192
    for text in CORPUS:
        assert loaded(text)["input_ids"] == ref(text)["input_ids"]
    msgs = [{"role": "user", "content": "Hi"}]
    assert loaded.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(
        msgs, tokenize=False
    )


# ---- llama / SentencePiece path -------------------------------------------------------------

SPM_TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces.\n"
    "Sentencepiece treats spaces as markers; byte fallback covers unseen characters.\n"
    "def main():\n    return 42  # the answer\n"
    "Über café naïve résumé, 東京 and 北京 are cities.\n"
)
USER_DEFINED = "<tool>"
SPM_CORPUS = [
    "Hello world",
    "The quick brown fox jumps",
    "  two leading spaces",
    "trailing space ",
    "a\nb\n\nc\td",
    "x  y   z",
    "café 東京 🤖 ẞ unseen wörds",
    "def main():\n    return 42",
    "1234 56",
    "",
    " ",
]
SPM_SPECIAL_CORPUS = ["<s>hi</s>", "<tool> call it", "say <tool>now</s> ok", "<s>"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    # Llama-like settings: identity normalization, whitespace kept, dummy prefix, byte fallback.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TRAIN_TEXT.splitlines() * 20),
        model_writer=model,
        vocab_size=350,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        user_defined_symbols=[USER_DEFINED],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]

    def token_type(i: int) -> int:
        # gguf.TokenType numbering, as llama.cpp's converter derives it from sentencepiece.
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        if sp.is_unused(i):
            return gguf.TokenType.UNUSED
        return gguf.TokenType.USER_DEFINED if pieces[i] == USER_DEFINED else gguf.TokenType.NORMAL

    folder = tmp_path_factory.mktemp("spm")
    path = folder / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([int(token_type(i)) for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_tensor("token_embd.weight", np.zeros((4, n), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, sp


def _llama_cpp_oracle(sp, text: str, specials: dict[str, int]) -> list[int]:
    """BOS, then the text cut at special/user-defined token strings: those become their id and
    every text run in between is encoded by sentencepiece (which adds its dummy "▁" prefix to
    each run, as llama.cpp does for each raw-text fragment)."""
    ids = [sp.bos_id()]
    pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
    for part in re.split(pattern, text):
        ids.extend([specials[part]] if part in specials else sp.encode(part) if part else [])
    return ids


def test_llama_spm_matches_sentencepiece(spm_gguf):
    path, sp = spm_gguf
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    assert ours.add_bos_token and ours.bos_token_id == sp.bos_id()
    specials = {p: sp.piece_to_id(p) for p in ("<s>", "</s>", USER_DEFINED)}
    for text in SPM_CORPUS + SPM_SPECIAL_CORPUS:
        assert ours.tokenizer.encode(text).ids == _llama_cpp_oracle(sp, text, specials), text
        ids = [sp.bos_id(), *sp.encode(text)]
        assert ours.tokenizer.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]), text
    # The byte fallback really fires on text the vocabulary cannot spell.
    unseen = ours.tokenizer.encode("🤖", add_special_tokens=False).tokens
    assert unseen == [sp.id_to_piece(i) for i in sp.encode("🤖")]
    assert any(re.fullmatch(r"<0x[0-9A-F]{2}>", t) for t in unseen)
    # Control tokens are one id each and dropped by skip_special_tokens.
    hi = ours.tokenizer.encode("<s>hi</s>", add_special_tokens=False).ids
    assert hi[0] == sp.bos_id() and hi[-1] == sp.eos_id()
    assert ours.tokenizer.decode(hi, skip_special_tokens=True) == sp.decode(sp.encode("hi"))


def test_llama_spm_matches_transformers(spm_gguf):
    """transformers loads the same file; it agrees with us wherever its Metaspace pre-tokenizer
    and sentencepiece agree (text that does not start with a space or contain special tokens)."""
    path, sp = spm_gguf
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SPM_CORPUS:
        if text[:1].isspace():
            continue  # transformers skips the dummy prefix there; sentencepiece does not
        for special in (True, False):
            expected = ref(text, add_special_tokens=special)["input_ids"]
            assert ours.tokenizer.encode(text, add_special_tokens=special).ids == expected, text
    for text in SPM_CORPUS + SPM_SPECIAL_CORPUS:
        ids = ref(text)["input_ids"]
        for skip in (True, False):
            got = ours.tokenizer.decode(ids, skip_special_tokens=skip)
            assert got == ref.decode(ids, skip_special_tokens=skip), text


def _write_minimal(path, model: str) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["<unk>", "a", "b"])
    writer.add_tensor("dummy", np.zeros((2,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_minimal(path, "bert")
    with pytest.raises(ValueError, match=r"'bert'.*gpt2.*llama"):
        tokenizer_from_gguf(gguf.GGUFReader(path))


def _byte_alphabet() -> list[str]:
    # GPT-2's printable stand-ins for the 256 bytes, taken from transformers (the oracle side).
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


# Merges that make the split visible: digit groups, contractions, space/newline runs, words.
TINY_MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "1 2",
    "12 3",
    "' s",
    "' S",
    "Ċ Ċ",
    "Ġ Ġ",
    "ĠĠ Ġ",
    "Ġ 1",
    "Ġ 'S",
]
SPLIT_CORPUS = [
    "the 12345 theme's 1234567",
    "IT'S 12,3\n\n\nthe   the  \n 1",
    "x!!! 'S ?\r\n\t1\u00a0the",
    "日本 123 é the",
]


@pytest.mark.parametrize("pre", ["gpt-2", "default", "llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    alphabet = _byte_alphabet()
    merged = ["".join(m.split(" ")) for m in TINY_MERGES]
    tokens = ["<|end|>", *alphabet, *dict.fromkeys(merged)]
    path = tmp_path / f"tiny-{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_token_merges(TINY_MERGES)
    writer.add_eos_token_id(0)
    writer.add_tensor("dummy", np.zeros((2,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*SPLIT_CORPUS, "the<|end|>12"]:
        expected = ref(text)["input_ids"]
        assert ours.tokenizer.encode(text).ids == expected, text
        for skip in (True, False):
            got = ours.tokenizer.decode(expected, skip_special_tokens=skip)
            assert got == ref.decode(expected, skip_special_tokens=skip), text

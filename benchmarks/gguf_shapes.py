"""Random-weight GGUF files of real model shapes in llama.cpp's Q4_K_M mix, for benchmarks.

    python benchmarks/gguf_shapes.py [SHAPE ...] [--out /work/shapes]
        [--ftype Q4_K_M Q5_K_M IQ4_XS IQ3_M]

With no SHAPE, every shape but the `LARGE` ones (4B and 8B: an 8B file takes a 16 GB f16
intermediate and 20-40 minutes on two cores); name those to build them.

Speed does not depend on weight values, so a file with the shape, tensor names and quant types
of a downloaded model stands in for it. Each shape is written as an f16 GGUF (f32 where
llama.cpp keeps f32: norms and biases) by `gguf.GGUFWriter`, with random normal weights scaled
by 0.02 so activations stay finite, then requantized by llama.cpp's own `llama_model_quantize`
to Q4_K_M, Q5_K_M, IQ4_XS or IQ3_M (`--ftype`, llama-cpp-python), so the mix is exactly what
llama.cpp chooses (IQ3_M's iq3_s grid search takes llama.cpp about 15 minutes for the 3B shape
on two cores). One f16 intermediate serves every `--ftype` and is then deleted; a finished
`<shape>.<ftype>.gguf` already in the folder is reused.

Tokenizers: the llama, qwen2 and qwen3 shapes carry SmolLM2's gpt2 BPE vocabulary padded with UNUSED
`[PAD{i}]` tokens up to the model's vocabulary size (llama.cpp and tallow both accept it);
Gemma 3 copies the real 270M file's metadata, tokenizer and tensor names and shapes.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

DEFAULT_OUT = Path("/work/shapes")
# the real file on the development machine; elsewhere it is joined from its PyPI wheels
GEMMA_FILE = Path("/work/notes/gemma-3-270m-q4_k_m.gguf")
_F32 = ("_norm.weight", ".bias")  # tensors llama.cpp keeps in f32
_TYPE_UNUSED = int(gguf.TokenType.UNUSED)


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shape: what decides the kernels' sizes and llama.cpp's Q4_K_M mix."""

    arch: str  # GGUF architecture (llama, qwen2)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # qwen3: per-head RMSNorm scales attn_q_norm / attn_k_norm
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context: int = 32768


SHAPES: dict[str, Shape | None] = {
    "qwen2.5-0.5b": Shape(
        "qwen2", 896, 24, 14, 2, 64, 4864, 151936, tied=False, qkv_bias=True, rope_theta=1e6,
        rms_eps=1e-6,
    ),
    "llama-3.2-1b": Shape(
        "llama", 2048, 16, 32, 8, 64, 8192, 128256, tied=True, rope_theta=500000.0, context=131072
    ),
    # 3B class: the size users run on CPUs, where prefill too streams the weights from memory
    "llama-3.2-3b": Shape(
        "llama", 3072, 28, 24, 8, 128, 8192, 128256, tied=True, rope_theta=500000.0,
        context=131072,
    ),
    # 4B class with Qwen3's q/k norms and a 151,936-token tied head (Qwen3-4B)
    "qwen3-4b": Shape(
        "qwen3", 2560, 36, 32, 8, 128, 9728, 151936, tied=True, qk_norm=True, rope_theta=1e6,
        rms_eps=1e-6, context=40960,
    ),
    # 8B: ~4.6 GB of weights in Q4_K_M, read once per decoded token
    "llama-3.1-8b": Shape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, tied=False, rope_theta=500000.0,
        context=131072,
    ),
    "gemma-3-270m": None,  # copied from the real file (GEMMA_FILE)
    # SmolLM2-1.7B's shape and SmolLM2's own vocabulary: the embedded 135M model can draft
    # for it (benchmarks/speculative_decode.py --draft-for)
    "smollm2-1.7b": Shape(
        "llama", 2048, 24, 32, 32, 64, 8192, 49152, tied=True, rope_theta=130000.0, context=8192
    ),
}  # fmt: skip


LARGE = ("qwen3-4b", "llama-3.1-8b")  # built and benchmarked only when named


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


_CHUNK = 1 << 24  # values drawn at a time: 64 MiB of f32, whatever the tensor's size


def _random(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, 0.02) weights (norm scales near one), drawn in chunks straight into the output
    array: an 8B head of 525M values then peaks at its 1 GB of f16, not 3 GB of f32 + f16."""
    f32 = name.endswith(_F32)
    out = np.empty(shape, np.float32 if f32 else np.float16)
    flat = out.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        x = rng.standard_normal(min(_CHUNK, flat.size - i), dtype=np.float32)
        x *= 0.02
        if name.endswith("_norm.weight"):
            x += 1.0  # a norm's scale near one keeps every layer's activations in range
        flat[i : i + x.size] = x
    return out


Vocabulary = tuple[list[str], list[int], list[str]]  # gpt2 BPE: tokens, token types, merges


def smollm2_vocabulary() -> Vocabulary:
    """SmolLM2's gpt2 BPE vocabulary (49152 tokens), read from the embedded GGUF."""
    from tallow.compiler.default_model import default_model_path

    src = gguf.GGUFReader(default_model_path(check_hash=False))
    return tuple(
        list(_field(src, f"tokenizer.ggml.{key}")) for key in ("tokens", "token_type", "merges")
    )


def _gpt2_tokenizer(writer: gguf.GGUFWriter, size: int, base: Vocabulary) -> None:
    """A gpt2 BPE vocabulary of `size` entries: `base` cut, or padded with UNUSED tokens.

    Token 0 is the unknown token, 1 BOS, 2 EOS and padding (SmolLM2's numbering)."""
    tokens, types, merges = (list(x) for x in base)
    if size < len(tokens):  # keep the merges whose pieces remain
        tokens, types = tokens[:size], types[:size]
        kept = set(tokens)
        merges = [m for m in merges if {*m.split(" ", 1), m.replace(" ", "")} <= kept]
    pad = size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(pad)]
    types += [_TYPE_UNUSED] * pad
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)


def _dense_tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes ([rows, cols]) of a llama/qwen2 decoder."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (s.hidden,))]
        for part, rows in (("q", q), ("k", kv), ("v", kv)):
            out.append((f"{b}.attn_{part}.weight", (rows, s.hidden)))
            if s.qkv_bias:
                out.append((f"{b}.attn_{part}.bias", (rows,)))
        if s.qk_norm:
            out += [(f"{b}.attn_{p}_norm.weight", (s.head_dim,)) for p in ("q", "k")]
        out += [
            (f"{b}.attn_output.weight", (s.hidden, q)),
            (f"{b}.ffn_norm.weight", (s.hidden,)),
            (f"{b}.ffn_gate.weight", (s.ffn, s.hidden)),
            (f"{b}.ffn_up.weight", (s.ffn, s.hidden)),
            (f"{b}.ffn_down.weight", (s.hidden, s.ffn)),
        ]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden)))
    return out


def _dense_metadata(w: gguf.GGUFWriter, s: Shape, name: str, vocabulary: Vocabulary) -> None:
    w.add_name(f"random {name}")
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_block_count(s.layers)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.head_dim)
    # a head's width as llama.cpp's converter writes it: Qwen3-4B's 32 heads of 128 are not
    # hidden / heads (80), and without the key readers take 80 (tallow refused the file)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _gpt2_tokenizer(w, s.vocab, vocabulary)


_SKIP_KEYS = ("GGUF.", "general.file_type", "general.quantization_version")


def _copied_metadata(w: gguf.GGUFWriter, src: gguf.GGUFReader) -> None:
    """Every key of `src` but the file's own bookkeeping (version, counts, quant type)."""
    for key, f in src.fields.items():
        if key.startswith(_SKIP_KEYS) or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _real_gemma(folder: Path) -> Path:
    """The real Gemma 3 270M Q4_K_M file: GEMMA_FILE, else joined from its PyPI wheels."""
    import bench_files  # imports this module: imported late

    return bench_files.shape_file(bench_files.REAL_GEMMA, folder)


def write_f16(
    path: Path,
    name: str,
    shape: Shape | None = None,
    vocabulary: Vocabulary | None = None,
    seed: int = 0,
) -> None:
    """The float GGUF of `name` (or of `shape`, for a custom one), streamed tensor by tensor;
    a dense shape's tokenizer is `vocabulary` (default SmolLM2's) cut or padded to size."""
    shape = shape if shape is not None else SHAPES[name]
    if shape is None:
        src = gguf.GGUFReader(_real_gemma(path.parent))
        arch = _field(src, "general.architecture")
        tensors = [(t.name, tuple(int(n) for n in reversed(t.shape))) for t in src.tensors]
    else:
        arch, tensors = shape.arch, _dense_tensors(shape)
    w = gguf.GGUFWriter(str(path), arch)
    if shape is None:
        _copied_metadata(w, src)
    else:
        _dense_metadata(w, shape, name, vocabulary or smollm2_vocabulary())
    for tname, tshape in tensors:
        f32 = tname.endswith(_F32)
        dtype = np.float32 if f32 else np.float16
        nbytes = int(np.prod(tshape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(tname, tshape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, tshape in tensors:
        w.write_tensor_data(_random(rng, tname, tshape))
    w.close()


def quantize(src: Path, dst: Path, ftype: str = "Q4_K_M", threads: int = 2) -> None:
    """llama.cpp's own requantization of `src` (its recipe picks every tensor's type)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    tmp = dst.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {src.name} -> {ftype} failed ({rc})")
    tmp.rename(dst)


def type_histogram(path: Path) -> Counter:
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)


# llama.cpp recipes a shape can be requantized to (IQ4_XS and IQ3_M need no importance matrix)
FTYPES = ("Q4_K_M", "Q5_K_M", "IQ4_XS", "IQ3_M")


def file_name(name: str, ftype: str = "Q4_K_M") -> str:
    return f"{name}.{ftype.lower()}.gguf"


def build(name: str, out: Path, ftypes: tuple[str, ...] = ("Q4_K_M",)) -> list[Path]:
    """`out/<name>.<ftype>.gguf` for each of `ftypes`, built unless already there; one f16
    intermediate (16 GB for the 8B shape) serves every ftype and is deleted after."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    for ftype in ftypes:
        if ftype not in FTYPES:
            raise SystemExit(f"unknown --ftype {ftype!r}; known: {', '.join(FTYPES)}")
    dsts = [out / file_name(name, f) for f in ftypes]
    todo = [(f, d) for f, d in zip(ftypes, dsts, strict=True) if not d.exists()]
    if not todo:
        return dsts
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{name}.f16.gguf.tmp"
    t = time.perf_counter()
    try:
        write_f16(f16, name)
        print(f"{name}: f16 written ({f16.stat().st_size / 2**20:.0f} MiB) "
              f"in {time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
        for ftype, dst in todo:
            quantize(f16, dst, ftype)
            print(f"{name}: {ftype} at {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        f16.unlink(missing_ok=True)
    return dsts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = [s for s in SHAPES if s not in LARGE]
    ap.add_argument("shapes", nargs="*", default=default, help=", ".join(SHAPES))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--ftype", nargs="+", default=["Q4_K_M"], type=str.upper, help=" ".join(FTYPES))
    args = ap.parse_args()
    for name in args.shapes:
        for path in build(name, args.out, tuple(args.ftype)):
            hist = ", ".join(f"{k} {v}" for k, v in sorted(type_histogram(path).items()))
            print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB): {hist}", flush=True)
        done = sorted(args.out.glob("*.q4_k_m.gguf"))
        if len(done) >= 2:  # other helpers' tools poll for this list
            (args.out / "READY").write_text("".join(f"{p}\n" for p in done))
    return 0


if __name__ == "__main__":
    sys.exit(main())

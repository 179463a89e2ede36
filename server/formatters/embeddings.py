"""The embeddings shape: a `list` of `embedding` objects and the prompt-token usage.

It does not share `ResponseFormatter`'s job machinery: an embedding is one vector per input,
never streamed. `base64` is the vector's little-endian float32 bytes, as OpenAI sends it (the
`openai` client asks for it by default and decodes it with numpy).
"""

from __future__ import annotations

import base64

import numpy as np

from ..protocol import EmbeddingData, EmbeddingResponse, EmbeddingUsage


def shorten(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values, L2-normalised again (None: the vector as it is)."""
    if dimensions is None:
        return vector
    v = np.asarray(vector[:dimensions], dtype=np.float64)
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    v = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return v.tolist()


class EmbeddingFormatter:
    endpoint = "embeddings"  # the metrics label of the route

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def response(
        self,
        vectors: list[np.ndarray],
        prompt_tokens: int,
        encoding_format: str = "float",
        dimensions: int | None = None,
    ) -> EmbeddingResponse:
        data = [
            EmbeddingData(index=i, embedding=encode_vector(shorten(v, dimensions), encoding_format))
            for i, v in enumerate(vectors)
        ]
        usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return EmbeddingResponse(data=data, model=self.model_name, usage=usage)

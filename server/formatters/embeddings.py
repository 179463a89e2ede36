"""The embeddings shape: a `list` of `embedding` objects and the prompt-token usage.

It does not share `ResponseFormatter`'s job machinery: an embedding is one vector per input,
never streamed. `base64` is the vector's little-endian float32 bytes, as OpenAI sends it (the
`openai` client asks for it by default and decodes it with numpy).
"""

from __future__ import annotations

import base64
import json

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


def render(body: EmbeddingResponse) -> bytes:
    """`body` as JSON text, one embedding at a time. One `json.dumps` of 2,048 x 576 floats
    takes 1.3 s in C with the GIL held, and that stops the event loop however it is called;
    one `dumps` per vector lets the loop run between them (the same text: compact, as
    `JSONResponse` writes it)."""
    compact = {"separators": (",", ":"), "ensure_ascii": False, "allow_nan": False}
    items = ",".join(json.dumps(d.model_dump(), **compact) for d in body.data)
    rest = json.dumps(body.model_dump(exclude={"object", "data"}), **compact)
    return ('{"object":"list","data":[' + items + "]," + rest[1:]).encode()

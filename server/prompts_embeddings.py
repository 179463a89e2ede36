"""`/v1/embeddings` inputs as engine prompts, and its `dimensions`; errors as OpenAI 400s.

Text is encoded as `/v1/completions` prompts are (the tokenizer's special tokens included,
e.g. the EOS that last-token pooled embedding models append). An empty string is refused, as
OpenAI does: it has no tokens to pool.
"""

from __future__ import annotations

from tallow.runtime.served_model import PromptTooLongError, ServedModel

from .errors import bad_request
from .prompts import check_token_ids
from .protocol import EmbeddingRequest


def embedding_prompts(req: EmbeddingRequest, model: ServedModel) -> list[list[int]]:
    inp = req.input
    if isinstance(inp, str):
        texts: list[str] | None = [inp]
    elif isinstance(inp[0], str):
        texts = list(inp)  # type: ignore[arg-type]
    else:
        texts = None
    if texts is not None:
        prompts = []
        for i, text in enumerate(texts):
            where = "input" if isinstance(inp, str) else f"input.{i}"
            if not text:
                raise bad_request(f"{where}: an empty string has nothing to embed", "input")
            try:
                ids = model.encode_text(text, within_context=True)
            except PromptTooLongError as e:
                raise bad_request(f"{where}: {e}", "input", PromptTooLongError.code) from None
            if not ids:
                raise bad_request(f"{where}: the text encodes to no tokens", "input")
            prompts.append(ids)
        return prompts
    prompts = [list(inp)] if isinstance(inp[0], int) else [list(x) for x in inp]  # type: ignore[arg-type]
    for ids in prompts:
        check_token_ids(model, ids, "input")
    return prompts


def check_dimensions(dimensions: int | None, width: int) -> int | None:
    """`dimensions` when it shortens the embedding; None for the full width.

    Any model may be asked for fewer dimensions (the vector is truncated, then L2-normalised
    again, Matryoshka-style); only models trained that way keep their quality when shortened.
    """
    if dimensions is None or dimensions == width:
        return None
    if dimensions > width:
        raise bad_request(
            f"dimensions: this model's embeddings have {width} dimensions (got {dimensions})",
            "dimensions",
        )
    return dimensions

"""One formatter per API shape: it turns a job's engine outputs into that API's JSON.

A new shape (e.g. the Responses API) is a new formatter plus a new router; the job, the
streaming machinery and the other shapes stay as they are.
"""

from .base import ResponseFormatter
from .chat import ChatFormatter
from .completions import CompletionFormatter
from .embeddings import EmbeddingFormatter
from .responses import ResponsesFormatter

__all__ = [
    "ChatFormatter",
    "CompletionFormatter",
    "EmbeddingFormatter",
    "ResponseFormatter",
    "ResponsesFormatter",
]

"""Every path the server answers, in one table.

The routers take their paths from here, `tallow serve --help` lists `ROUTES`, the OpenAPI
document and the gate read its flags, and tests/test_docs_drift.py checks that the app,
the help and docs/api.md's route table all name the same routes: a route cannot be added
without appearing in the help and the docs.

Standard library only: `tallow serve --help` reads it before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    what: str  # one line, for `tallow serve --help`
    queues_work: bool = False  # queues engine work, so may answer 429 (`jobs.check_queue`)
    needs_key: bool = True  # guarded by --api-key (`gate.APIGate`)


CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
MODELS = "/v1/models"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
HEALTH = "/health"
# Kubernetes' two probes (issue 34): live restarts a hung process, ready takes a pod out of
# the Service while it loads or drains. Neither needs the API key; the gate passes `PROBES`
# even while draining, so a draining pod stays live.
HEALTH_LIVE = "/health/live"
HEALTH_READY = "/health/ready"
PROBES = frozenset({HEALTH, HEALTH_LIVE, HEALTH_READY})
METRICS = "/metrics"
OPENAPI = "/openapi.json"  # served by FastAPI itself (`openapi.install_openapi`)
CHAT_PAGE = "/"

ROUTES: tuple[Route, ...] = (
    Route("POST", CHAT_COMPLETIONS, "chat, streamed or not", queues_work=True),
    Route("POST", RESPONSES, "OpenAI's Responses API over the chat path", queues_work=True),
    Route("POST", COMPLETIONS, "text or token-id prompts; echo scores them", queues_work=True),
    Route("POST", EMBEDDINGS, "pooled, normalised hidden states", queues_work=True),
    Route("GET", MODELS, "the one served model"),
    Route("POST", TOKENIZE, "a prompt or chat messages to token ids"),
    Route("POST", DETOKENIZE, "token ids to text"),
    Route("GET", HEALTH, "200, or 503 while starting or draining; no API key", needs_key=False),
    Route("GET", HEALTH_LIVE, "200 while the process is up, draining too", needs_key=False),
    Route("GET", HEALTH_READY, "200, or 503 while loading or draining", needs_key=False),
    Route("GET", METRICS, "Prometheus metrics"),
    Route("GET", OPENAPI, "the OpenAPI document of these routes"),
    Route("GET", CHAT_PAGE, "the chat page, its files under /ui/ (--no-ui: off)", needs_key=False),
)

# The chat page's own files (`routes/ui.py` maps each to a file in server/ui/).
UI_ASSETS: tuple[str, ...] = ("/ui/chat.js", "/ui/markdown.js", "/ui/chat.css")


def routes_help() -> str:
    """The route list `tallow serve --help` prints, one `METHOD PATH  what` line each."""
    width = max(len(f"{r.method} {r.path}") for r in ROUTES)
    return "\n".join(f"  {f'{r.method} {r.path}':<{width}}  {r.what}" for r in ROUTES)

"""The server's structure, over the fake runner (no compile, every test takes milliseconds):
each route has one home and is reachable, every body matches both our pydantic protocol models
and the official `openai` types, a bad body on one route leaves a concurrent good request on
another alone, and `tallow generate` encodes a conversation exactly as the server does."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import openai.types
import openai.types.chat
import pytest
from fastapi.routing import APIRoute
from server_helpers import MODEL, serve_engine, tiny_tokenizer_bundle  # noqa: I001

from tallow.cli.main import main
from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server import paths, protocol, protocol_chat
from tallow.server.app import ServerOptions, create_app

VOCAB = 320  # the tiny tokenizer's vocabulary fits below it
JSON_TYPE = {"Content-Type": "application/json"}  # raw bodies must say they are JSON
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The capital of France is"},
]
# Every route in `server/paths.py`'s table, and the chat page's files (routes/ui.py;
# tests/test_chat_page.py). FastAPI serves /openapi.json itself, outside the routers.
ROUTES = [(r.method, r.path) for r in paths.ROUTES] + [("GET", p) for p in paths.UI_ASSETS]
ROUTER_ROUTES = [route for route in ROUTES if route[1] != paths.OPENAPI]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> TokenizerBundle:
    """The tiny models' byte-level BPE tokenizer and chat template, as an artifact ships them."""
    return tiny_tokenizer_bundle(tmp_path_factory.mktemp("tokenizer"), VOCAB)


def fake_runner(bundle: TokenizerBundle) -> FakeModelRunner:
    runner = FakeModelRunner(vocab_size=VOCAB, context_window=256, num_pages=256)
    # Public attributes of the TVM runner that the fake lacks: the artifact's tokenizer bundle
    # (which `ServedModel` reads) and the prefill chunk (which `tallow generate` reads).
    runner.tokenizer = bundle
    runner.prefill_chunk_size = 64
    return runner


@pytest.fixture(scope="module")
def server(bundle):
    engine = Engine(
        fake_runner(bundle),
        tokenizer=bundle.tokenizer,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )
    s = serve_engine(engine, ServerOptions(max_body_bytes=64 * 1024))
    yield s
    s.stop()


def greedy(**kw):
    return {"model": MODEL, "temperature": 0.0, "ignore_eos": True, "max_tokens": 6, **kw}


def sse_payloads(response: httpx.Response) -> list[dict]:
    lines = [ln for ln in response.text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def matches(model: type, body: dict) -> None:
    """`body` is exactly what `model` describes: it validates and dumps back unchanged."""
    assert model.model_validate(body).model_dump() == body


# -- routes --------------------------------------------------------------------------------------


def api_routes(app) -> list:
    """`app.routes`' API routes, with included routers flattened (newer FastAPI keeps each
    `include_router` as one lazy entry in `app.routes`)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI copies the routes into app.routes
        return [r for r in app.routes if isinstance(r, APIRoute)]
    return [c for c in iter_route_contexts(app.routes) if isinstance(c.original_route, APIRoute)]


def test_every_route_registered_once_in_its_own_module(bundle):
    app = create_app(Engine(fake_runner(bundle), tokenizer=bundle.tokenizer), MODEL)
    api = api_routes(app)
    assert len(api) == len(ROUTER_ROUTES)
    assert Counter((m, r.path) for r in api for m in r.methods) == Counter(ROUTER_ROUTES)
    for r in api:
        assert r.endpoint.__module__.startswith("tallow.server.routes."), r.path


def test_no_route_or_dependency_runs_on_a_worker_thread(bundle):
    """FastAPI runs a plain `def` endpoint or dependency on anyio's worker threads (lazily
    started, up to 40): a thread hop per request, and a thread count that grows with load (the
    soak's "threads flat" caught `get_context`). Blocking work goes through `off_loop`."""
    app = create_app(Engine(fake_runner(bundle), tokenizer=bundle.tokenizer), MODEL)

    def calls(dependant):
        yield dependant.call
        for sub in dependant.dependencies:
            yield from calls(sub)

    sync = {
        (r.path, getattr(call, "__qualname__", repr(call)))
        for r in api_routes(app)
        for call in calls(r.dependant)
        if call is not None and not inspect.iscoroutinefunction(call)
    }
    assert not sync


def test_every_route_is_reachable(server):
    bodies = {
        "/v1/chat/completions": {**greedy(), "messages": CHAT},
        "/v1/completions": {**greedy(), "prompt": "The"},
        "/v1/responses": {"model": MODEL, "input": "The", "max_output_tokens": 4},
        "/v1/embeddings": {"model": MODEL, "input": "The"},
        "/tokenize": {"prompt": "hello"},
        "/detokenize": {"tokens": [5, 6]},
    }
    for method, path in ROUTES:
        r = httpx.request(method, server.base_url + path, json=bodies.get(path), timeout=30)
        assert r.status_code == 200, (path, r.text)


def test_server_never_reaches_into_the_runner():
    server_dir = Path(__file__).parent.parent / "server"
    for path in server_dir.rglob("*.py"):
        assert ".runner" not in path.read_text(), path


def test_front_ends_import_no_compiler():
    """The server, `tallow generate` and the runtime load without TVM's compiler or ours."""
    script = (
        "import sys, json\n"
        "import tallow.server.app, tallow.server.launch, tallow.cli.generate\n"
        "import tallow.runtime.engine_factory, tallow.runtime.served_model\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('ray'):  # tallow[ray]: the Serve application too\n"
        "    import tallow.server.ray_app, tallow.server.ray_routing, tallow.cli.serve_ray\n"
        "bad = ('tvm.relax', 'tallow.compiler', 'tallow.model_defs', 'tallow.schedules')\n"
        "print(json.dumps([m for m in sys.modules if m.startswith(bad)]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# -- bodies --------------------------------------------------------------------------------------


def test_chat_bodies_match_protocol_and_openai_types(server):
    url = f"{server.base_url}/v1/chat/completions"
    body = {**greedy(temperature=1.0, seed=3), "messages": CHAT, "n": 2}
    r = httpx.post(url, json={**body, "logprobs": True, "top_logprobs": 2}, timeout=30)
    assert r.status_code == 200, r.text
    full = r.json()
    matches(protocol_chat.ChatCompletionResponse, full)
    sdk = openai.types.chat.ChatCompletion.model_validate(full)
    assert len(sdk.choices) == 2 and len(sdk.choices[0].logprobs.content) == 6
    assert sdk.choices[0].logprobs.content[0].top_logprobs[0].bytes
    options = {"stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    chunks = sse_payloads(httpx.post(url, json={**body, **options}, timeout=30))
    for chunk in chunks:
        matches(protocol_chat.ChatCompletionChunk, chunk)
        openai.types.chat.ChatCompletionChunk.model_validate(chunk)
    role = {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [role, role]  # one per choice
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    for c in chunks[:-1]:
        assert c["usage"] is None  # asked for usage: null on every chunk but the last
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text  # gibberish, but some
    # Without include_usage the chunks carry no usage key at all.
    plain = sse_payloads(httpx.post(url, json={**body, "stream": True}, timeout=30))
    assert all("usage" not in c and c["choices"] for c in plain)


def test_completion_bodies_match_protocol_and_openai_types(server):
    url = f"{server.base_url}/v1/completions"
    body = {**greedy(), "prompt": ["The quick", "brown fox"], "logprobs": 2}
    full = httpx.post(url, json=body, timeout=30).json()
    matches(protocol.CompletionResponse, full)
    sdk = openai.types.Completion.model_validate(full)
    assert [c.index for c in sdk.choices] == [0, 1]
    lp = sdk.choices[0].logprobs
    assert len(lp.tokens) == 6 and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    options = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_payloads(httpx.post(url, json={**body, **options}, timeout=30))
    for chunk in chunks:
        matches(protocol.CompletionChunk, chunk)
        # OpenAI streams `finish_reason: null` until a choice ends, although its `Completion`
        # type says non-null (the SDK builds stream chunks without validating): a null one is
        # the only difference allowed from a valid `Completion`.
        ended = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        openai.types.Completion.model_validate({**chunk, "choices": ended})
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    first = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == 0]
    streamed = "".join(c["text"] for c in first)
    assert streamed == full["choices"][0]["text"]  # greedy: the same text both ways
    assert chunks[-1]["usage"] == full["usage"]


def test_other_bodies_match_protocol(server):
    models = httpx.get(f"{server.base_url}/v1/models").json()
    matches(protocol.ModelList, models)
    openai.types.Model.model_validate(models["data"][0])
    tok = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()
    matches(protocol.TokenizeResponse, tok)
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tok["tokens"]}).json()
    matches(protocol.DetokenizeResponse, text)
    assert "The capital of France is" in text["prompt"] and text["prompt"].startswith("<s>")
    matches(protocol.HealthResponse, httpx.get(f"{server.base_url}/health").json())
    err = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [VOCAB]}).json()
    matches(protocol.ErrorResponse, err)
    assert err["error"]["code"] == "invalid_token_id" and err["error"]["param"] == "tokens"


# -- isolation -----------------------------------------------------------------------------------


def test_bad_body_on_one_route_leaves_a_concurrent_request_alone(server):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            good = {**greedy(max_tokens=40), "messages": CHAT, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=good) as stream:
                lines = stream.aiter_lines()
                first = await anext(lines)  # the good request is running now
                bad = await asyncio.gather(
                    client.post("/v1/completions", json={**greedy(), "prompt": "x", "n": "2"}),
                    client.post("/v1/completions", json={"model": MODEL}),
                    client.post("/tokenize", json={"prompt": ["not", "a", "string"]}),
                    client.post("/detokenize", content=b"{broken", headers=JSON_TYPE),
                )
                rest = [ln async for ln in lines if ln]
        for r, param in zip(bad, ("n", "prompt", "prompt", None), strict=True):
            assert r.status_code in (400, 422), r.text
            assert r.headers["content-type"] == "application/json"
            assert r.json()["error"]["param"] == param, r.text
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        finish = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in rest[:-1]]
        assert finish[-1] == "length" and len(finish) == 40

    asyncio.run(run())


# -- the CLI and the server encode alike ---------------------------------------------------------


def test_generate_cli_encodes_prompts_like_the_server(server, bundle, monkeypatch, capsys):
    import tallow.cli.generate as cli_generate

    seen: list[list[int]] = []
    real = cli_generate.generate_tokens

    def spy(runner, prompt_ids, params, stats=None):
        seen.append(list(prompt_ids))
        return real(runner, prompt_ids, params, stats)

    monkeypatch.setattr(
        cli_generate, "runner_class", lambda *a, **kw: lambda *a2, **kw2: fake_runner(bundle)
    )
    monkeypatch.setattr(cli_generate.Manifest, "read", staticmethod(lambda *a, **kw: None))
    monkeypatch.setattr(cli_generate, "generate_tokens", spy)
    system, user = CHAT[0]["content"], CHAT[1]["content"]
    argv = ["generate", "unused", "--prompt", user, "--max-tokens", "3", "--ignore-eos"]
    assert main([*argv, "--chat", "--system", system]) == 0
    assert main(argv) == 0
    assert "generated 3 tokens" in capsys.readouterr().err

    tokenize = f"{server.base_url}/tokenize"
    chat_ids = httpx.post(tokenize, json={"messages": CHAT}).json()["tokens"]
    text_ids = httpx.post(tokenize, json={"prompt": user}).json()["tokens"]
    assert seen == [chat_ids, text_ids]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={**greedy(), "messages": CHAT})
    assert r.json()["usage"]["prompt_tokens"] == len(chat_ids)

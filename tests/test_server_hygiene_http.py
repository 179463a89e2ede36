"""Serving you can trust, over HTTP (issue 24): lone surrogates repaired on every route, and
cross-origin requests refused (the JSON content type, DNS rebinding, CORS), against the live
server of `hygiene_server.py`; every refusal is followed by a normal request that still works.
"""

from __future__ import annotations

import json

import httpx
from hygiene_server import (
    CHAT,
    greedy,
    make_server,
    post,
    raw_post,
    still_serves,
    tokenize,
)
from server_helpers import MODEL  # noqa: I001

from tallow.cli.main import build_parser
from tallow.server.app import ServerOptions
from tallow.server.gate import APIGate

# -- 3: lone surrogates ------------------------------------------------------------------------


def test_lone_surrogates_become_replacement_characters_on_every_route(
    hygiene_server, hygiene_client
):
    fffd = tokenize(hygiene_server, prompt="a\ufffdb")
    assert tokenize(hygiene_server, prompt="a\ud800b") == fffd
    assert tokenize(hygiene_server, prompt="a\udfffb") == fffd
    assert tokenize(hygiene_server, prompt="a\ud83d\ude00b") != fffd  # a pair is one character
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": "\ud800"}'},
    }
    bodies = {
        "/v1/chat/completions": {
            **greedy(stop=["\udc00", "x\ud800"]),
            "messages": [
                {"role": "user", "content": "\ud800 hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {
                    "role": "tool",
                    "tool_call_id": "c",
                    "content": [{"type": "text", "text": "\udfff"}],
                },
            ],
        },
        "/v1/completions": {**greedy(stop="\ud800"), "prompt": ["\ud800", "ok"]},
        "/v1/responses": {"model": MODEL, "input": "\ud800", "instructions": "\udc00"},
        "/tokenize": {"messages": [{"role": "user", "content": "\ud800"}]},
        "/detokenize": {"tokens": [5], "model": MODEL},
    }
    for path, body in bodies.items():
        r = post(hygiene_server, path, body)
        assert r.status_code == 200, (path, r.text)
        r.json()  # valid UTF-8 JSON
    # Bytes that are not UTF-8 are repaired the same way.
    bad_bytes = b'{"prompt": "a\xffb"}'
    assert raw_post(hygiene_server, "/tokenize", bad_bytes).json()["tokens"] == fffd
    still_serves(hygiene_client)


# -- 4: cross-origin safety -------------------------------------------------------------------


def test_json_bodies_need_the_json_content_type(hygiene_server, hygiene_client):
    body = json.dumps({**greedy(), "messages": CHAT}).encode()
    for headers in ({"Content-Type": "text/plain"}, {}, {"Content-Type": "multipart/form-data"}):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
            r = raw_post(hygiene_server, path, body, headers=headers)
            assert r.status_code == 415, (path, headers, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
    r = raw_post(
        hygiene_server,
        "/v1/chat/completions",
        body,
        {"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text
    still_serves(hygiene_client)


def test_dns_rebinding_host_is_refused(hygiene_server, hygiene_client):
    url = hygiene_server.base_url
    port = url.rsplit(":", 1)[1]
    for host in (
        "evil.example",
        f"evil.example:{port}",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
    ):
        for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/tokenize")):
            r = httpx.request(
                method, url + path, headers={"Host": host}, json={"prompt": "x"}, timeout=30
            )
            assert r.status_code in (400, 421), (host, path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_host"
    for host in (
        f"localhost:{port}",
        "LOCALHOST.",
        f"127.0.0.1:{port}",
        f"[::1]:{port}",
        "a.localhost",
    ):
        r = httpx.get(url + "/v1/models", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
    still_serves(hygiene_client)


def test_allowed_hosts_option():
    def gate(**kw) -> APIGate:
        return APIGate(lambda *a: None, ServerOptions(**kw), None)

    default = gate()
    assert default.host_allowed(b"localhost:8000") and default.host_allowed(b"10.1.2.3:80")
    assert not default.host_allowed(b"evil.example")
    named = gate(host="gpu.lan", allowed_hosts=("api.example.com", "*.corp.example"))
    for ok in (b"gpu.lan:8000", b"api.example.com", b"x.corp.example", b"localhost"):
        assert named.host_allowed(ok), ok
    for bad in (b"evil.example", b"example.com", b"corp.example.evil"):
        assert not named.host_allowed(bad), bad
    assert gate(allowed_hosts=("*",)).host_allowed(b"anything.example")


def test_cors_only_for_allowed_origins(hygiene_server, hygiene_bundle):
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    r = httpx.options(f"{hygiene_server.base_url}/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers and r.status_code >= 400
    r = httpx.get(f"{hygiene_server.base_url}/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers

    s = make_server(hygiene_bundle, allowed_origins=("https://app.example",), api_key="k")
    try:
        r = httpx.options(f"{s.base_url}/v1/chat/completions", headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        auth = {"Origin": "https://app.example", "Authorization": "Bearer k"}
        r = httpx.post(
            f"{s.base_url}/v1/chat/completions", headers=auth, json={**greedy(), "messages": CHAT}
        )
        assert (
            r.status_code == 200
            and r.headers["access-control-allow-origin"] == "https://app.example"
        )
        other = {**preflight, "Origin": "https://evil.example"}
        r = httpx.options(f"{s.base_url}/v1/chat/completions", headers=other)
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"
    finally:
        s.stop()


def test_serve_options_parse():
    args = build_parser().parse_args(
        ["serve", "x", "--allowed-hosts", "a.example, b.example", "--allowed-origins", "*"]
    )
    assert args.allowed_hosts == "a.example, b.example" and args.allowed_origins == "*"
    from tallow.cli.serve import _comma_list

    assert _comma_list(args.allowed_hosts) == ("a.example", "b.example")
    assert _comma_list("") == ()

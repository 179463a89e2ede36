"""Slow and vanishing clients: half-sent requests are closed after the request timeout, a
client leaving mid-upload is one INFO line. A few sockets, a few seconds, in-process server
over the fake runner."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from server_helpers import serve_engine
from test_engine_fake import word_tokenizer

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

TIMEOUT = 1.0
PATIENT_TIMEOUT = 10.0


def _serve(request_timeout: float):
    runner = FakeModelRunner(vocab_size=101, context_window=256, num_pages=64)
    engine = Engine(runner, tokenizer=word_tokenizer(), scheduler_config=SchedulerConfig())
    return serve_engine(engine, ServerOptions(request_timeout=request_timeout, shutdown_timeout=5))


@pytest.fixture
def server():
    s = _serve(TIMEOUT)
    yield s
    s.stop()


@pytest.fixture
def patient_server():
    """A timeout far from the slow client's pauses, whatever the machine's load."""
    s = _serve(PATIENT_TIMEOUT)
    yield s
    s.stop()


def _wait_for(condition, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _requests_in_progress(server) -> int:
    """Requests the server is running the app for (uvicorn's tasks, one per request)."""
    return len(server._server.server_state.tasks)


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _normal_request_works(base: str) -> None:
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, "temperature": 0.0},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


def test_half_sent_requests_are_closed(server):
    socks = []
    for payload in (
        b"",  # connected, silent
        b"POST /v1/compl",  # half a request line
        HEAD,  # headers never finished
        HEAD + b"Content-Length: 100\r\n\r\n" + b'{"model":',  # body never finished
    ):
        s = _connect(server.base_url)
        s.sendall(payload)
        socks.append(s)
    t0 = time.monotonic()
    try:
        for s in socks:
            # Far above the timeout: only a connection never closed fails (a loaded machine
            # may delay the close by seconds).
            assert _closed_by_server(s, within=TIMEOUT + 60), "a half-sent request stayed open"
        assert time.monotonic() - t0 < TIMEOUT + 60
    finally:
        for s in socks:
            s.close()
    _normal_request_works(server.base_url)


def test_a_slow_but_steady_request_within_the_timeout_is_served(patient_server):
    s = _connect(patient_server.base_url)
    body = b'{"model":"tiny","prompt":"w1","max_tokens":2,"temperature":0.0}'
    try:
        s.sendall(HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode())
        time.sleep(1.0)  # a pause longer than the other tests' whole timeout
        s.sendall(body)
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        s.close()


def test_client_leaving_mid_upload_is_one_info_line(server, caplog):
    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "left while sending" in r.getMessage()]

    with caplog.at_level(logging.INFO):
        s = _connect(server.base_url)
        s.sendall(HEAD + b"Content-Length: 5000\r\n\r\n" + b'{"model": "tiny", "prompt": "')
        # The app is reading the body (not a fixed sleep: on a loaded machine it may not be).
        _wait_for(lambda: _requests_in_progress(server) == 1, "the request never started")
        s.close()
        _wait_for(lambda: logged(), "the client leaving was not logged")
        _wait_for(lambda: _requests_in_progress(server) == 0, "the request never ended")
    text = caplog.text
    assert "Exception in ASGI application" not in text and "Traceback" not in text
    lines = logged()
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    _normal_request_works(server.base_url)

"""Live servers for the server tests: uvicorn in a background thread, or `tallow serve` in a
subprocess (for signals)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.server.app import ServerOptions, create_app
from tallow.server.launch import make_server

MODEL = "tiny"


def tiny_tokenizer_bundle(folder: Path, vocab: int) -> TokenizerBundle:
    """The tiny models' byte-level BPE tokenizer and chat template, as an artifact ships them
    (written to `folder`; `vocab` is the logits width, at least the tokenizer's 312)."""
    from tokenizers import Tokenizer

    from tiny_models import make_tokenizer

    make_tokenizer(folder, vocab)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return TokenizerBundle(
        tokenizer=tok,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_ids=[tok.token_to_id("</s>")],
        add_bos_token=False,
        chat_template=config["chat_template"],
        bos_token="<s>",
        eos_token="</s>",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    app: object
    engine: object
    _server: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def start_server(artifact: Path, options: ServerOptions, **engine_kw) -> LiveServer:
    return serve_engine(build_engine(artifact, EngineOptions(**engine_kw)), options)


def serve_engine(engine, options: ServerOptions) -> LiveServer:
    """Serve an already built engine (a compiled artifact's, or one over the fake runner)."""
    app = create_app(engine, MODEL, options)
    port = free_port()
    server = make_server(app, "127.0.0.1", port, options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, engine, server, thread)


def metric(base_url: str, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{base_url}/metrics", headers=headers or {}).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def start_subprocess(artifact: Path, port: int, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tallow.cli.main", "serve", str(artifact), "--port", str(port)]
    env = {**os.environ, "TALLOW_API_KEY": ""}
    proc = subprocess.Popen([*cmd, "--served-model-name", MODEL, *args], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited early"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server subprocess did not become healthy")

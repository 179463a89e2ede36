"""Live servers for the server tests: uvicorn in a background thread, or `tallow serve` in a
subprocess (for signals)."""

from __future__ import annotations

import json
import os
import queue
import re
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
    # Port 0: the kernel picks a free port as uvicorn binds it (asking for a "free" port first
    # and binding it later races with anything else that binds in between).
    server = make_server(app, "127.0.0.1", 0, options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # a loaded machine may take its time
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{server.bound_port}", app, engine, server, thread)


def metric(base_url: str, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(f"{base_url}/metrics", headers=headers or {}).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@dataclass
class ServerProcess:
    """A server in a child process, with everything it writes to stderr (relayed to ours)."""

    proc: subprocess.Popen
    base_url: str
    _lines: list[str]
    _reader: threading.Thread

    def stderr(self) -> str:
        """What it wrote so far; all of it once the process has exited."""
        if self.proc.poll() is not None:
            self._reader.join(10)
        return "".join(self._lines)


def start_process(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> ServerProcess:
    """Run a server that binds port 0 and prints `serving NAME on URL` once listening (what
    `tallow serve` and tests/fake_serve.py do); returns when it listens, with its URL."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    found: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            sys.stderr.write(line)
            m = re.search(r"^serving \S+ on (http://\S+)$", line.strip())
            if m:
                found.put(m.group(1))
        found.put(None)  # the process closed its stderr: it has exited

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        url = found.get(timeout=120)
    except queue.Empty:
        url = None
    if url is None:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"the server did not start listening: {''.join(lines)[-3000:]}")
    return ServerProcess(proc, url, lines, reader)


def start_subprocess(artifact: Path, *args: str) -> ServerProcess:
    """`tallow serve ARTIFACT` on a port the kernel picks."""
    cmd = [sys.executable, "-m", "tallow.cli.main", "serve", str(artifact), "--port", "0"]
    env = {**os.environ, "TALLOW_API_KEY": ""}
    return start_process([*cmd, "--served-model-name", MODEL, *args], env)


def wait_until_draining(base: str) -> None:
    """/health answers 503 once the server has handled its SIGTERM (no fixed sleep: a loaded
    machine may take its time); the listener stays open meanwhile, so every poll is answered."""
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/health", timeout=30).status_code != 503:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.02)


class ForwardGate:
    """Holds an engine's forwards past a count until opened, so a test knows its request is
    in flight (held at a known step) when its client leaves, however fast the model is."""

    def __init__(self, runner) -> None:
        self.runner, self.real = runner, runner.forward
        self.cond = threading.Condition()
        self.calls = 0
        self.limit: int | None = None  # None: open
        runner.forward = self._forward

    def _forward(self, items):
        with self.cond:
            self.calls += 1
            self.cond.notify_all()
            n = self.calls
            if not self.cond.wait_for(lambda: self.limit is None or n <= self.limit, 60):
                raise RuntimeError("the test never opened the forward gate")
        return self.real(items)

    def hold_after(self, n: int) -> None:
        """Let `n` more forwards through, then hold the next."""
        with self.cond:
            self.limit = self.calls + n

    def wait_held(self) -> None:
        """Until a forward waits at the gate."""
        with self.cond:
            held = self.cond.wait_for(self._holding, 30)
        assert held, "no forward reached the gate"

    def _holding(self) -> bool:
        return self.limit is not None and self.calls > self.limit

    def open(self) -> None:
        with self.cond:
            self.limit = None
            self.cond.notify_all()

    def remove(self) -> None:
        self.open()
        self.runner.forward = self.real

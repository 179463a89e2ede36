"""`python tests/fake_serve.py PORT SHUTDOWN_TIMEOUT STEP_DELAY [REQUEST_TIMEOUT]`: the real
server launcher (`tallow.server.launch.serve`, signals and all) over the fake runner, whose
every step sleeps STEP_DELAY seconds; exits with `serve`'s status. For tests that need a
process to send SIGTERM to without compiling a model. PORT 0 takes a free port; the launcher
prints `serving fake on URL` once it listens (`server_helpers.start_process` reads it)."""

from __future__ import annotations

import logging
import sys
import time

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions
from tallow.server.launch import serve

V = 101
MODEL = "fake"


def main(argv: list[str]) -> int:
    port, shutdown_timeout, delay = int(argv[0]), float(argv[1]), float(argv[2])
    request_timeout = float(argv[3]) if len(argv) > 3 else 30.0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    runner = FakeModelRunner(vocab_size=V, context_window=4096, num_pages=1024)
    forward = runner.forward

    def slow_forward(items):
        time.sleep(delay)
        return forward(items)

    runner.forward = slow_forward
    engine = Engine(
        runner,
        tokenizer=tok,
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    )
    options = ServerOptions(shutdown_timeout=shutdown_timeout, request_timeout=request_timeout)
    return serve(engine, MODEL, options, "127.0.0.1", port)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

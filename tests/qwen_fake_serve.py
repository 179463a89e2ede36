"""`python tests/qwen_fake_serve.py STEP_DELAY`: tallow's real server launcher
(`tallow.server.launch.serve`) over the fake runner with the tiny Qwen-style tokenizer (byte-level
BPE, `<|im_start|>`/`<|im_end|>` special, the Qwen2.5 tool template), so grammars, tools and
embeddings all work; every step sleeps STEP_DELAY seconds. It binds port 0 and prints `serving
tiny on URL` (`server_helpers.start_process` reads it).

For tests whose request could crash the process in native code: such a crash is then a dead
server the test sees, not a dead test worker.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scripted_server import QWEN_TOOL_TEMPLATE, make_bundle  # noqa: E402

from tallow.runtime.engine import Engine  # noqa: E402
from tallow.runtime.fake_runner import FakeModelRunner  # noqa: E402
from tallow.runtime.scheduler import SchedulerConfig  # noqa: E402
from tallow.server.app import ServerOptions  # noqa: E402
from tallow.server.launch import serve  # noqa: E402


def main(argv: list[str]) -> int:
    delay = float(argv[0])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    bundle = make_bundle(Path(tempfile.mkdtemp(prefix="qwen-tok-")), QWEN_TOOL_TEMPLATE)
    tok = bundle.tokenizer
    runner = FakeModelRunner(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), context_window=1024, num_pages=512
    )
    runner.tokenizer = bundle
    forward = runner.forward

    def slow_forward(items):
        time.sleep(delay)
        return forward(items)

    runner.forward = slow_forward
    engine = Engine(
        runner,
        tokenizer=tok,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
    )
    return serve(engine, "tiny", ServerOptions(), "127.0.0.1", 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

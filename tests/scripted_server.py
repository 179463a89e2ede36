"""The scripted server shared by the tool-calling, Responses API, hygiene and chat page tests:
a runner double that answers with a scripted text (no compile; each request takes
milliseconds), over the tiny byte-level tokenizer plus Qwen's added tokens and a Qwen2.5
tool template (plus Qwen3's thinking switch), so the Hermes format and the think block are
both picked up from the template. `qwen` and `qwen_client` are fixtures (see conftest.py).
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from server_helpers import serve_engine  # noqa: I001

from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine import Engine
from tallow.runtime.fake_runner import FakeModelRunner
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

from tiny_models import make_tokenizer

CONTEXT_WINDOW = 1024  # tokens, of the scripted server

# Qwen2.5-Instruct's tool template; the generation prompt adds Qwen3's `enable_thinking`
# switch and an `open_think` flag (a template that opens the think block in the prompt).
QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    '<|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- elif open_think is defined and open_think %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL += "\n</tool_call>"


class ScriptedRunner(FakeModelRunner):
    """Answers every prompt with `script` (token ids), then EOS: the logits put all weight on
    the next script token after the longest script prefix that the sequence ends with. With
    `resume`, a sequence pushed off the script (by a grammar) picks it up again after the
    longest run of two or more tokens it ends with that the script contains."""

    def __init__(self, eos: int, **kw) -> None:
        super().__init__(**kw)
        self.eos = eos
        self.script: list[int] = []
        self.last_prompt: list[int] = []
        self.resume = False
        self._prompts: list[list[int]] = []  # histories right after each prefill

    def forward(self, items: list[tuple[int, list[int]]]) -> np.ndarray:
        out = super().forward(items)
        for sid, tokens in items:
            if len(tokens) > 1:  # a prefill: everything the sequence holds is prompt
                self._prompts.append(self._history(self._seqs[sid]))
        return out

    def _generated(self, history: list[int]) -> list[int]:
        starts = [p for p in self._prompts if history[: len(p)] == p]
        return history[len(max(starts, key=len)) :] if starts else []

    def _resume_at(self, history: list[int]) -> int:
        """Script position after the longest suffix of the generated tokens the script holds."""
        gen = self._generated(history)
        for n in range(len(gen), 0, -1):
            tail = gen[-n:]
            for i in range(len(self.script) - n + 1):
                if self.script[i : i + n] == tail:
                    return i + n
        return 0

    def _logits(self, history: list[int]) -> np.ndarray:
        k = next(
            k for k in range(len(self.script), -1, -1) if k == 0 or history[-k:] == self.script[:k]
        )
        if k == 0:
            self.last_prompt = list(history)
            if self.resume:
                k = self._resume_at(history)
        out = np.full(self.vocab_size, -30.0, dtype=np.float32)
        out[self.script[k] if k < len(self.script) else self.eos] = 30.0
        return out


def make_bundle(folder, template: str) -> TokenizerBundle:
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(folder, 320)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    # Qwen's tool and think tags are added tokens that are not special (kept in the output).
    tok.add_tokens([AddedToken(t, special=False) for t in ("<tool_call>", "</tool_call>")])
    tok.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    eos = tok.token_to_id("<|im_end|>")
    return TokenizerBundle(
        tokenizer=tok,
        bos_token_id=None,
        eos_token_ids=[eos],
        add_bos_token=False,
        chat_template=template,
        bos_token=None,
        eos_token="<|im_end|>",
    )


def start_scripted(
    bundle: TokenizerBundle,
    options: ServerOptions | None = None,
    runner_class: type[ScriptedRunner] = ScriptedRunner,
):
    """A live server over a scripted runner; `(server, runner)`."""
    tok = bundle.tokenizer
    runner = runner_class(
        eos=bundle.eos_token_ids[0],
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        context_window=CONTEXT_WINDOW,
        num_pages=256,
    )
    runner.tokenizer = bundle
    engine = Engine(
        runner,
        tokenizer=tok,
        eos_token_ids=bundle.eos_token_ids,
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048),
    )
    return serve_engine(engine, options or ServerOptions()), runner


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    bundle = make_bundle(tmp_path_factory.mktemp("qwen"), QWEN_TOOL_TEMPLATE)
    server, runner = start_scripted(bundle)
    yield server, runner, bundle
    server.stop()


@pytest.fixture
def qwen_client(qwen):
    server, _, _ = qwen
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def say(qwen, text: str) -> None:
    _, runner, bundle = qwen
    runner.script = bundle.tokenizer.encode(text, add_special_tokens=False).ids
    assert bundle.tokenizer.decode(runner.script, skip_special_tokens=True) == text

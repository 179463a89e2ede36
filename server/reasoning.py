"""Splitting a thinking model's output into reasoning and answer.

Templates with a thinking block (Qwen3, DeepSeek-R1 and their kin) have the model write
`<think>...</think>` before its answer. The text inside goes to `reasoning_content`, the rest
to `content`. Some templates open the block in the prompt itself (generation then starts
inside it, and the output has only the closing tag); whether a prompt did is read from the
rendered prompt: its last `<think>` comes after its last `</think>`.

`ReasoningStream` splits text as it arrives, holding back only what could be the start of a
tag, so a tag split across tokens or deltas is still found; `split_reasoning` runs it over a
whole text, so streaming and non-streaming agree by construction. A think block counts only
at the start of the output; whitespace around the reasoning and before the answer is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_has_reasoning(chat_template: str | None) -> bool:
    return bool(chat_template) and THINK_OPEN in chat_template and THINK_CLOSE in chat_template


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a think block open for the model to continue."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """States: "start" (nothing but whitespace yet), "reasoning", "content"."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._state = "reasoning" if starts_inside else "start"
        self._buf = ""
        self._held_ws = ""  # trailing whitespace of the reasoning so far
        self._skip_ws = starts_inside  # drop whitespace that opens the reasoning / the answer
        self.saw_reasoning = starts_inside

    def _reason(self, text: str, out: ReasoningDelta) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        out.reasoning += body

    def _answer(self, text: str, out: ReasoningDelta) -> None:
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        out.content += text

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        while self._buf:
            if self._state == "start":
                rest = self._buf.lstrip()
                if rest.startswith(THINK_OPEN):
                    self._state, self._skip_ws, self.saw_reasoning = "reasoning", True, True
                    self._buf = rest[len(THINK_OPEN) :]
                    continue
                if THINK_OPEN.startswith(rest):  # nothing yet, or a piece of the tag
                    break
                self._state = "content"
                continue
            if self._state == "reasoning":
                at = self._buf.find(THINK_CLOSE)
                if at >= 0:
                    self._reason(self._buf[:at], out)
                    self._held_ws, self._skip_ws = "", True
                    self._state, self._buf = "content", self._buf[at + len(THINK_CLOSE) :]
                    continue
                keep = _partial(self._buf, THINK_CLOSE)
                self._reason(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._answer(self._buf, out)
            self._buf = ""
        return out

    def finish(self) -> ReasoningDelta:
        """The held text at the end: an unclosed block is all reasoning."""
        out = ReasoningDelta()
        if self._state == "reasoning":
            self._reason(self._buf, out)
        elif self._buf:
            self._answer(self._buf, out)
        self._buf, self._held_ws = "", ""
        return out


def split_reasoning(text: str, starts_inside: bool = False) -> tuple[str | None, str]:
    """`(reasoning, content)` of a whole output; reasoning is None without a think block."""
    stream = ReasoningStream(starts_inside)
    a, b = stream.feed(text), stream.finish()
    reasoning = a.reasoning + b.reasoning
    return (reasoning if stream.saw_reasoning else None), a.content + b.content

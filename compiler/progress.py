"""Progress lines on stderr: one per compile phase, and a counter for weight conversion."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass
class Progress:
    quiet: bool = False
    _start: float = field(default_factory=time.perf_counter)

    def phase(self, index: int, total: int, title: str) -> None:
        self._say(f"[{index}/{total}] {title}")

    def done(self, message: str) -> None:
        self._say(f"      {message} ({time.perf_counter() - self._start:.1f}s elapsed)")

    def counter(self, label: str, done: int, total: int) -> None:
        if self.quiet:
            return
        end = "\n" if done == total else ""
        if sys.stderr.isatty() or done == total or done % 50 == 0:
            print(f"\r      {label}: {done}/{total}", end=end, file=sys.stderr, flush=True)

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)

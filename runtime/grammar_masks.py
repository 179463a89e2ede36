"""The grammar masks of a step's constrained rows, computed while the forward runs.

Constrained decoding (`SamplingParams.grammar`, see `constraint.py`). `Engine.submit` compiles
the grammar into the request's matcher, so a bad one raises there. Each step, the masks of the
constrained rows it samples are computed in a worker thread while the forward runs (the
matchers are only touched by that thread until the forward returns; llguidance drops the
GIL); those rows are sampled on the host with disallowed tokens at -inf, and each sampled
token advances its matcher (`step_postprocess.py`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import numpy as np

from tallow.runtime.completion_stream import CompletionStream
from tallow.runtime.constraint import compute_masks


class StepMasks:
    """One step's masks: started before the forward, joined after it, then collected."""

    def __init__(
        self,
        constrained: list[CompletionStream],
        job: concurrent.futures.Future[np.ndarray] | None,
    ) -> None:
        self._constrained = constrained
        self._job = job
        self._arr: np.ndarray | None = None
        self._t0 = 0.0
        self.wait_s = 0.0  # step-thread time spent on masks after the forward

    def join(self) -> None:
        """Wait for the worker, so that it never touches matchers past this point (call it
        even when the forward failed)."""
        self._t0 = time.perf_counter()
        if self._job is not None:
            with contextlib.suppress(Exception):  # a failed batch is redone in `collect`
                self._arr = self._job.result()

    def collect(self) -> tuple[dict[int, np.ndarray], dict[str, BaseException]]:
        """The masks by seq_id, and the requests (id -> error) whose matcher raised."""
        failed: dict[str, BaseException] = {}
        masks: dict[int, np.ndarray] = {}
        if not self._constrained:
            return masks, failed
        matchers = [st.matcher for st in self._constrained]
        arr = self._arr
        if arr is None and self._job is None:
            with contextlib.suppress(Exception):
                arr = compute_masks(matchers)
        if arr is not None:
            masks = {st.seq.seq_id: arr[i] for i, st in enumerate(self._constrained)}
        else:  # the batch raised: one matcher at a time, to find whose it was
            for st in self._constrained:
                try:
                    masks[st.seq.seq_id] = compute_masks([st.matcher])[0]
                except Exception as e:  # noqa: BLE001 - fails this sequence only
                    failed.setdefault(st.seq.request.request_id, e)
        self.wait_s = time.perf_counter() - self._t0
        return masks, failed


class GrammarMasks:
    """Starts each step's mask computation; owns the worker thread (made on first use)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, constrained: list[CompletionStream], overlap: bool) -> StepMasks:
        """Begin computing the masks of `constrained` (in the worker if `overlap`, else they
        are computed in `StepMasks.collect`, on the step thread)."""
        job = None
        if constrained and overlap:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tallow-grammar"
                )
            job = self._pool.submit(compute_masks, [st.matcher for st in constrained])
        return StepMasks(constrained, job)

"""The serving engine: requests in, incremental outputs out, one batched forward per step.

Threading model. All scheduler/runner state is touched by exactly one thread at a time: the
step, which the background task runs in a worker thread (`asyncio.to_thread`) so the event
loop stays free for HTTP while the model runs. Callers on the loop never touch that state;
`add_request`/`abort` append to a lock-protected inbox that the next step drains, and outputs
travel back through per-request sinks (`loop.call_soon_threadsafe` into an asyncio.Queue).
Without a loop, `submit` + `run_step` (or `generate`) drive the same code synchronously.

Constrained decoding (`SamplingParams.grammar`, see `constraint.py`). `submit` compiles the
grammar into the request's matcher, so a bad one raises there. Each step, the masks of the
constrained rows it samples are computed in a worker thread while the forward runs (the
matchers are only touched by that thread until the forward returns; llguidance drops the
GIL); those rows are sampled on the host with disallowed tokens at -inf, and each sampled
token advances its matcher. A grammar that is complete finishes its sequence with "stop"; one
that cannot go on (no token allowed, or the matcher errored) with "grammar_error", without
sampling. An n > 1 fork clones its parent's matcher; a preempted sequence keeps its own.

Failures. What goes wrong for one sequence (its sampling parameters, its grammar matcher, its
detokenizer or stop handling, the postprocessing of its row) fails that request alone: its
sink gets the error, its KV is freed, and every other sequence of the step carries on. A
forward that raises fails the requests of that batch; waiting ones stay queued and the
engine keeps serving. Only an error outside both (a bug in the scheduler, say) fails
everything live (`_fail_all`).

Embeddings (`embed`, `submit_embedding`). An embedding request is a prompt that goes through
the scheduler and KV manager like any prefill, sharing each step's token budget with
generation. Its chunks run through `runner.forward_hidden` in the same step as the generation
items' `forward`; the engine pools the rows on the host across chunks (a running sum and
count for mean pooling, the final row for last-token pooling, restarted when a preempted
sequence prefills again from its first token), and once the last chunk ran the request
finishes: its L2-normalised vector goes to its sink and its pages are freed (never kept as
a prefix-cache entry).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tallow.runtime.completion_stream import CompletionStream
from tallow.runtime.constraint import (
    GRAMMAR_ERROR,
    GrammarMatcher,
    GrammarTokenizer,
    compute_masks,
    disallow_tokens,
    grammar_tokenizer,
)
from tallow.runtime.detokenizer import byte_level_pieces
from tallow.runtime.model_runner_protocol import ModelRunner
from tallow.runtime.request import (
    CompletionDelta,
    ContextLengthExceededError,
    EmbeddingOutput,
    EngineStats,
    FinishReason,
    Request,
    RequestOutput,
    ScheduledItem,
    SchedulerOutput,
    SequenceState,
    TokenLogprob,
    Usage,
)
from tallow.runtime.sampler import Sampler
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import Scheduler, SchedulerConfig
from tallow.runtime.served_model import ServedModel
from tallow.runtime.step_sampling import Histories, StepSampler

log = logging.getLogger(__name__)

__all__ = [
    "CompletionDelta",
    "EmbeddingOutput",
    "EmbeddingsNotSupportedError",
    "Engine",
    "EngineStats",
    "GenerationNotSupportedError",
    "RequestOutput",
    "TokenLogprob",
    "Usage",
]


Sink = Callable[["RequestOutput | EmbeddingOutput | BaseException"], None]


class EmbeddingsNotSupportedError(ValueError):
    """The model has no hidden-state function (an artifact compiled before embeddings)."""


class GenerationNotSupportedError(ValueError):
    """The model is embedding-only (`tallow compile --task embed`)."""


class EmbeddingAbortedError(RuntimeError):
    """An embedding request was aborted before its vector was ready."""


@dataclass
class _Pool:
    """Host-side pooling of one embedding request's hidden states, chunk by chunk."""

    pooling: str  # "mean" or "last"
    total: np.ndarray | None = None  # float64 sum of the rows so far (mean)
    count: int = 0
    last: np.ndarray | None = None

    def add(self, rows: np.ndarray, restart: bool) -> None:
        if restart:  # the prompt prefills from its first token (again, after a preemption)
            self.total, self.count = None, 0
        part = rows.sum(axis=0, dtype=np.float64)
        self.total = part if self.total is None else self.total + part
        self.count += len(rows)
        self.last = rows[-1]

    def vector(self) -> np.ndarray:
        assert self.total is not None and self.last is not None
        v = self.total / self.count if self.pooling == "mean" else self.last.astype(np.float64)
        norm = float(np.linalg.norm(v))
        return (v / norm if norm > 0 else v).astype(np.float32)


@dataclass
class _ReqState:
    request: Request
    sink: Sink
    seqs: dict[int, CompletionStream] = field(default_factory=dict)  # by completion index
    completion_tokens: int = 0
    cached_tokens: int | None = None  # fixed at the first sample
    num_finished: int = 0


class _QueueSink:
    """Hands outputs from the step thread to an asyncio.Queue owned by the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __call__(self, item: RequestOutput | BaseException) -> None:
        # A closed loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class _FutureSink:
    """Resolves an asyncio future (owned by the caller's loop) with an embedding."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[np.ndarray]) -> None:
        self.loop, self.fut = loop, fut

    def _set(self, item: RequestOutput | EmbeddingOutput | BaseException) -> None:
        if self.fut.done():
            return
        if isinstance(item, BaseException):
            self.fut.set_exception(item)
        elif isinstance(item, EmbeddingOutput):
            self.fut.set_result(item.embedding)
        else:
            self.fut.set_exception(EmbeddingAbortedError("the embedding request was aborted"))

    def __call__(self, item: RequestOutput | EmbeddingOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._set, item)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        tokenizer: Any | None = None,
        eos_token_ids: Sequence[int] = (),
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        # byte-level tokenizers: one table for every stream's fast detokenizing
        self._byte_pieces = byte_level_pieces(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.scheduler = Scheduler(runner, scheduler_config)
        self.sampling = StepSampler(runner, Sampler())
        self._requests: dict[str, _ReqState] = {}  # step-thread only
        self._by_seq: dict[int, CompletionStream] = {}  # seq_id -> state, step-thread only
        self._pools: dict[int, _Pool] = {}  # embedding seq_id -> its pooling, step-thread only
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_lock = threading.Lock()
        self._live_ids: set[str] = set()  # guarded by _inbox_lock; rejects duplicate ids
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._num_steps = 0
        self._last_latency = 0.0
        self._total_latency = 0.0
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._snapshot: EngineStats | None = None
        # Compute constrained rows' masks in a worker thread during the forward (False: after
        # it, on the step thread; for benchmarks).
        self.overlap_masks = True
        self._mask_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.mask_wait_s = 0.0  # step-thread time spent on masks after the forward

    @functools.cached_property
    def model(self) -> ServedModel:
        """The served model's tokenizer, chat template, EOS ids and limits, for front ends
        (the server, the CLI), so they never reach into the runner. Built once, on first use."""
        return ServedModel.from_runner(self.runner, self.tokenizer, self.eos_token_ids)

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's view of the tokenizer, built on the first constrained request."""
        if self.tokenizer is None:
            raise ValueError("constrained decoding (a grammar) needs the model's tokenizer")
        return grammar_tokenizer(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)

    # -- submitting ----------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; outputs go to `sink` from the step thread.

        Raises at once (nothing queued) for invalid parameters, a grammar that does not
        compile (`constraint.GrammarError`) or a request that can never fit
        (`ContextLengthExceededError`).
        """
        if not getattr(self.runner, "supports_generation", True):
            raise GenerationNotSupportedError(
                "this model was compiled for embeddings only (tallow compile --task embed): "
                "it serves /v1/embeddings, not text generation"
            )
        params.validate(self.runner.vocab_size)
        if any(not 0 <= int(t) < self.runner.vocab_size for t in prompt_token_ids):
            raise ValueError("prompt token id outside the vocabulary")
        self.scheduler.check_request(len(prompt_token_ids), params.max_tokens, params.n)
        matcher = None
        if params.grammar is not None:
            matcher = self.grammar_tokenizer.matcher(params.grammar)
        rid = request_id or uuid.uuid4().hex
        with self._inbox_lock:
            if rid in self._live_ids:
                raise ValueError(f"request id {rid!r} is already in use")
            self._live_ids.add(rid)
            prompt = [int(t) for t in prompt_token_ids]
            self._inbox.append(("add", (rid, prompt, params, sink, matcher)))
        self._wake()
        return rid

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of incremental outputs (call from a loop).

        Validation errors raise here, before any output, so a server can answer 400. Closing
        the iterator early (client gone) aborts the request.
        """
        sink = _QueueSink(asyncio.get_running_loop())
        rid = self.submit(prompt_token_ids, params, sink, request_id)
        self.start()
        return self._stream(rid, sink)

    async def _stream(self, rid: str, sink: _QueueSink) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(rid)

    def fail_all_requests(self, error: BaseException) -> None:
        """End every live request with `error` (e.g. the server's drain ran out of time); the
        engine goes on serving. Thread-safe; takes effect at the next step boundary."""
        with self._inbox_lock:
            self._inbox.append(("fail", error))
        self._wake()

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output carries finish_reason "abort". Thread-safe."""
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))
        self._wake()

    # -- embeddings ----------------------------------------------------------------------------

    @property
    def supports_embeddings(self) -> bool:
        return getattr(self.runner, "embedding_pooling", None) is not None

    @property
    def supports_generation(self) -> bool:
        return bool(getattr(self.runner, "supports_generation", True))

    @property
    def embedding_dimensions(self) -> int:
        """The width of an embedding (the model's hidden size)."""
        return int(self.runner.hidden_size)

    def check_embedding_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise what `submit_embedding` would for this prompt (nothing is queued)."""
        if not self.supports_embeddings:
            raise EmbeddingsNotSupportedError(
                "this artifact has no hidden-state function (compiled before embeddings were "
                "supported); recompile it with this tallow to serve embeddings"
            )
        if any(not 0 <= int(t) < self.runner.vocab_size for t in prompt_token_ids):
            raise ValueError("prompt token id outside the vocabulary")
        n, window = len(prompt_token_ids), self.scheduler.context_window
        if n > window:
            raise ContextLengthExceededError(
                f"this model's context window is {window} tokens; the input has {n}"
            )
        self.scheduler.check_request(n, 0, 1)

    def submit_embedding(
        self, prompt_token_ids: list[int], sink: Sink, request_id: str | None = None
    ) -> str:
        """Validate and queue one embedding request; its `EmbeddingOutput` (or an error, or a
        `RequestOutput` with finish_reason "abort") goes to `sink` from the step thread."""
        self.check_embedding_prompt(prompt_token_ids)
        rid = request_id or uuid.uuid4().hex
        with self._inbox_lock:
            if rid in self._live_ids:
                raise ValueError(f"request id {rid!r} is already in use")
            self._live_ids.add(rid)
            prompt = [int(t) for t in prompt_token_ids]
            self._inbox.append(("embed", (rid, prompt, sink)))
        self._wake()
        return rid

    async def embed(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Pooled, L2-normalised float32 embeddings of `prompts` (call from a loop).

        Every prompt is validated before any is queued, so a bad one raises with nothing
        running; cancelling the call aborts what is still in flight.
        """
        for p in prompts:
            self.check_embedding_prompt(p)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[np.ndarray]] = []
        rids: list[str] = []
        try:
            for p in prompts:
                fut: asyncio.Future[np.ndarray] = loop.create_future()
                rids.append(self.submit_embedding(p, _FutureSink(loop, fut)))
                futures.append(fut)
            self.start()
            return list(await asyncio.gather(*futures))
        except BaseException:
            for rid, fut in zip(rids, futures, strict=False):
                if not fut.done():
                    self.abort(rid)
            raise

    def embed_sync(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """`embed` without an event loop: runs steps until every prompt is embedded."""
        for p in prompts:
            self.check_embedding_prompt(p)
        results: list[list[Any]] = [[] for _ in prompts]
        for p, sink in zip(prompts, results, strict=True):
            self.submit_embedding(p, sink.append)
        while self._has_work():
            self.run_step()
        out = []
        for items in results:
            item = items[-1]
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, EmbeddingOutput):
                raise EmbeddingAbortedError("the embedding request was aborted")
            out.append(item.embedding)
        return out

    # -- background loop ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._task is not None and not self._task.done():
            return
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task = self._loop.create_task(self._run_loop())

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the loop."""
        with self._inbox_lock:
            ids = list(self._live_ids)
        for rid in ids:
            self.abort(rid)
        if self._task is None:
            return
        while self._has_work() and not self._task.done():
            await asyncio.sleep(0.001)
        self._stopping = True
        self._wake()
        await self._task
        self._task = None

    def _wake(self) -> None:
        loop, ev = self._loop, self._wakeup
        if loop is None or ev is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            ev.set()
        else:
            loop.call_soon_threadsafe(ev.set)

    def _has_work(self) -> bool:
        with self._inbox_lock:
            if self._inbox:
                return True
        return self.scheduler.has_work()

    async def _run_loop(self) -> None:
        assert self._wakeup is not None
        while not self._stopping:
            if not self._has_work():
                self._wakeup.clear()
                if not self._has_work():
                    await self._wakeup.wait()
                continue
            try:
                await asyncio.to_thread(self.run_step)
            except Exception as e:  # noqa: BLE001 - a failed step must not kill the server
                self._fail_all(e)

    # -- the step ----------------------------------------------------------------------------

    def run_step(self) -> None:
        """Apply queued adds/aborts, then run one step if anything is schedulable."""
        self._drain_inbox()
        if self.scheduler.has_work():
            t0 = time.perf_counter()
            self.step()
            self._last_latency = time.perf_counter() - t0
            self._total_latency += self._last_latency
            self._num_steps += 1
        self._snapshot = self._collect_stats()

    def step(self) -> None:
        """The scheduler decides, the runner executes, the engine samples and streams."""
        out = self.scheduler.schedule()
        embeds = [it for it in out.items if it.seq.request.embed]
        if embeds:
            # Embedding chunks run through the hidden-state function, the rest as usual.
            hidden = self.runner.forward_hidden([(it.seq.seq_id, it.token_ids) for it in embeds])
            self._pool(embeds, hidden)
            out = dataclasses.replace(
                out, items=[it for it in out.items if not it.seq.request.embed]
            )
        constrained = [
            st
            for item in out.items
            if item.sample and (st := self._by_seq[item.seq.seq_id]).matcher is not None
        ]
        matchers = [st.matcher for st in constrained]
        job = None
        if matchers and self.overlap_masks:
            if self._mask_pool is None:
                self._mask_pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tallow-grammar"
                )
            job = self._mask_pool.submit(compute_masks, matchers)
        arr = None
        try:
            logits = self.runner.forward(out.forward_items) if out.items else None
        except Exception as e:  # noqa: BLE001 - the batch fails; the engine serves on
            self._fail_batch(out, e)
            return
        finally:
            # Never leave the worker touching matchers past this point, even on failure.
            t0 = time.perf_counter()
            if job is not None:
                with contextlib.suppress(Exception):  # a failed batch is redone below
                    arr = job.result()
        failed: dict[str, BaseException] = {}
        masks: dict[int, np.ndarray] = {}
        if matchers:
            if arr is None and job is None:
                with contextlib.suppress(Exception):
                    arr = compute_masks(matchers)
            if arr is not None:
                masks = {st.seq.seq_id: arr[i] for i, st in enumerate(constrained)}
            else:  # the batch raised: one matcher at a time, to find whose it was
                for st in constrained:
                    try:
                        masks[st.seq.seq_id] = compute_masks([st.matcher])[0]
                    except Exception as e:  # noqa: BLE001 - fails this sequence only
                        failed.setdefault(st.seq.request.request_id, e)
            self.mask_wait_s += time.perf_counter() - t0
        self._postprocess(out, logits, masks, failed)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                self._add(*payload)
            elif kind == "fail":
                for rid in list(self._requests):
                    self._fail_request(rid, payload, log_it=False)
            elif kind == "embed":
                self._add_embedding(*payload)
            else:
                self._abort(payload)

    def _add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        matcher: GrammarMatcher | None = None,
    ) -> None:
        req = Request(rid, prompt, params, self.scheduler.next_arrival_index())
        seq = self.scheduler.add_request(req)
        state = _ReqState(request=req, sink=sink)
        self._requests[rid] = state
        self._track(state, seq, matcher)
        self._prompt_tokens += len(prompt)

    def _add_embedding(self, rid: str, prompt: list[int], sink: Sink) -> None:
        params = SamplingParams(max_tokens=1)  # unused: an embedding samples nothing
        req = Request(rid, prompt, params, self.scheduler.next_arrival_index(), embed=True)
        seq = self.scheduler.add_request(req)
        self._requests[rid] = _ReqState(request=req, sink=sink)
        pooling = self.runner.embedding_pooling
        assert pooling is not None
        self._pools[seq.seq_id] = _Pool(pooling)
        self._prompt_tokens += len(prompt)

    def _pool(self, items: list[ScheduledItem], hidden: list[np.ndarray]) -> None:
        """Pool each embedding chunk's rows; finish the requests whose prompt is done."""
        for item, rows in zip(items, hidden, strict=True):
            seq = item.seq
            pool = self._pools[seq.seq_id]
            pool.add(np.asarray(rows), restart=seq.num_computed_tokens == len(item.token_ids))
            if not item.sample:
                continue  # more of the prompt to come
            self.scheduler.finish(seq, "stop")
            del self._pools[seq.seq_id]
            rid = seq.request.request_id
            state = self._requests.pop(rid)
            with self._inbox_lock:
                self._live_ids.discard(rid)
            state.sink(EmbeddingOutput(rid, pool.vector(), seq.prompt_len))

    def _track(
        self, state: _ReqState, seq: SequenceState, matcher: GrammarMatcher | None = None
    ) -> CompletionStream:
        st = CompletionStream.open(seq, self.tokenizer, self._byte_pieces, matcher)
        state.seqs[seq.index] = st
        self._by_seq[seq.seq_id] = st
        return st

    def _abort(self, rid: str) -> None:
        state = self._requests.get(rid)
        if state is None:
            return  # already finished (or never existed): aborting is idempotent
        deltas = []
        for seq in self.scheduler.abort_request(rid):
            deltas.append(CompletionDelta(index=seq.index, finish_reason="abort"))
            self._by_seq.pop(seq.seq_id, None)
            self._pools.pop(seq.seq_id, None)
        # Completions not forked yet (n > 1 aborted before its prefill ended) abort too.
        n = state.request.params.n
        deltas += [
            CompletionDelta(index=i, finish_reason="abort") for i in range(n) if i not in state.seqs
        ]
        state.num_finished = n
        self._emit(state, deltas)

    def _postprocess(
        self,
        out: SchedulerOutput,
        logits: np.ndarray | None,
        masks: dict[int, np.ndarray] | None = None,
        failed: dict[str, BaseException] | None = None,
    ) -> None:
        """Sample the rows that need it and stream the results. `failed` (request id ->
        error) collects the requests something went wrong for; they fail at the end, alone."""
        masks = masks or {}
        failed = {} if failed is None else failed
        rows: list[int] = []
        states: list[CompletionStream] = []
        row_masks: list[np.ndarray | None] = []
        per_request: dict[str, list[CompletionDelta]] = {}
        for row, item in enumerate(out.items):
            if not item.sample:
                continue  # a prefill chunk short of the prompt's end: its logits are unused
            seq = item.seq
            rid = seq.request.request_id
            if rid in failed:
                continue
            try:
                group = self._sampling_group(seq)
                mask = masks.get(seq.seq_id)
                for st in group:
                    if st.matcher is not None:
                        ended = self._grammar_end(st, mask)
                        if ended is not None:
                            delta = self._retire(st, st.finish(ended))
                            per_request.setdefault(rid, []).append(delta)
                            continue
                    rows.append(row)
                    states.append(st)
                    row_masks.append(mask if st.matcher is not None else None)
            except Exception as e:  # noqa: BLE001 - this request fails, the step goes on
                failed[rid] = e
        for st, token, lp in self._sample(logits, rows, states, row_masks, failed):
            rid = st.seq.request.request_id
            if rid in failed:
                continue
            try:
                delta = self._accept(st, token, lp)
            except Exception as e:  # noqa: BLE001 - e.g. its detokenizer or stop strings
                failed[rid] = e
                continue
            per_request.setdefault(rid, []).append(delta)
        for rid, deltas in per_request.items():
            if rid not in failed:
                self._emit(self._requests[rid], deltas)
        for rid, error in failed.items():
            self._fail_request(rid, error)

    def _sampling_group(self, seq: SequenceState) -> list[CompletionStream]:
        """The streams that sample from `seq`'s row: itself, plus its n > 1 siblings at the
        end of the prompt's prefill (they fork off it here)."""
        group = [self._by_seq[seq.seq_id]]
        if seq.pending_forks:
            # n > 1: the prompt was prefilled once; the siblings share its KV and sample
            # their first token from the same logits row (and mask: a fork's matcher is a
            # copy of its parent's, which has consumed nothing yet).
            req_state = self._requests[seq.request.request_id]
            parent = group[0].matcher
            for child in self.scheduler.fork_children(seq):
                matcher = parent.clone() if parent is not None else None
                group.append(self._track(req_state, child, matcher))
        return group

    def _sample(
        self,
        logits: np.ndarray | None,
        rows: list[int],
        states: list[CompletionStream],
        row_masks: list[np.ndarray | None],
        failed: dict[str, BaseException],
    ) -> list[tuple[CompletionStream, int, TokenLogprob | None]]:
        """One token per stream. If the batched call raises, each stream is sampled on its
        own, so only the request whose row cannot be sampled fails (into `failed`)."""
        if not states:
            return []
        assert logits is not None

        def run(idx: list[int]) -> list[tuple[CompletionStream, int, TokenLogprob | None]]:
            sts = [states[i] for i in idx]
            ms = [row_masks[i] for i in idx]
            sampled = self.sampling.sample(
                logits,
                [rows[i] for i in idx],
                [st.seq.request.params for st in sts],
                [st.generator for st in sts],
                Histories([st.seq for st in sts], prompt=True),
                Histories([st.seq for st in sts], prompt=False),
                ms if any(m is not None for m in ms) else None,
            )
            result = []
            for j, st in enumerate(sts):
                token, logprob = int(sampled.token_ids[j]), sampled.logprobs[j]
                lp = (
                    None
                    if logprob is None
                    else TokenLogprob(token, logprob, sampled.top_logprobs[j])
                )
                result.append((st, token, lp))
            return result

        try:
            return run(list(range(len(states))))
        except Exception:  # noqa: BLE001 - find the row(s) that raise
            log.warning("batched sampling failed; sampling each sequence on its own")
        result = []
        for i, st in enumerate(states):
            rid = st.seq.request.request_id
            if rid in failed:
                continue
            try:
                result += run([i])
            except Exception as e:  # noqa: BLE001 - fails this request only
                failed[rid] = e
        return result

    def _grammar_end(self, st: CompletionStream, mask: np.ndarray | None) -> FinishReason | None:
        """Why a constrained sequence ends before sampling (None: it samples from `mask`)."""
        matcher = st.matcher
        assert matcher is not None
        if matcher.is_dead_end:
            return GRAMMAR_ERROR
        if matcher.is_finished:
            return "stop"  # e.g. a grammar whose only sentence is empty
        if mask is None:
            raise RuntimeError(f"no grammar mask was computed for sequence {st.seq.seq_id}")
        if st.seq.request.params.ignore_eos:
            disallow_tokens(mask, matcher.tokenizer.eos_token_ids)
        if not mask.any():
            return GRAMMAR_ERROR
        return None

    def _accept(self, st: CompletionStream, token: int, lp: TokenLogprob | None) -> CompletionDelta:
        """Append a sampled token, count it, and retire its sequence if it finished."""
        state = self._requests[st.seq.request.request_id]
        state.completion_tokens += 1
        self._generated_tokens += 1
        return self._retire(st, st.accept(token, lp, self.eos_token_ids))

    def _retire(self, st: CompletionStream, delta: CompletionDelta) -> CompletionDelta:
        """Bookkeeping after a sequence's step; frees it if `delta` finishes it."""
        state = self._requests[st.seq.request.request_id]
        if state.cached_tokens is None:
            state.cached_tokens = st.seq.num_cached_tokens
        if delta.finish_reason is not None:
            self.scheduler.finish(st.seq, delta.finish_reason)
            self._by_seq.pop(st.seq.seq_id, None)
            state.num_finished += 1
        return delta

    def _emit(self, state: _ReqState, deltas: list[CompletionDelta]) -> None:
        req = state.request
        finished = state.num_finished >= req.params.n
        usage = Usage(len(req.prompt_token_ids), state.completion_tokens, state.cached_tokens or 0)
        if finished:
            self._requests.pop(req.request_id, None)
            with self._inbox_lock:
                self._live_ids.discard(req.request_id)
        state.sink(RequestOutput(req.request_id, deltas, finished, usage))

    def _fail_request(self, rid: str, error: BaseException, log_it: bool = True) -> None:
        """Something went wrong for this request alone: it gets the error, its KV is freed."""
        if log_it:
            name = type(error).__name__
            log.error("request %s failed: %s: %s", rid, name, error, exc_info=error)
        state = self._requests.pop(rid, None)
        if state is None:
            return
        for seq in self.scheduler.abort_request(rid):
            self._by_seq.pop(seq.seq_id, None)
        for st in state.seqs.values():
            self._by_seq.pop(st.seq.seq_id, None)
        with self._inbox_lock:
            self._live_ids.discard(rid)
        state.sink(error)

    def _fail_batch(self, out: SchedulerOutput, error: BaseException) -> None:
        """The forward raised: the requests it ran fail; the rest stay queued."""
        log.error("the forward failed: %s: %s", type(error).__name__, error, exc_info=error)
        for rid in dict.fromkeys(item.seq.request.request_id for item in out.items):
            self._fail_request(rid, error)

    def _fail_all(self, error: BaseException) -> None:
        """A step raised outside any one request's work: every live request gets the error
        and its KV is freed; the engine then serves new requests."""
        log.error("engine step failed: %s: %s", type(error).__name__, error, exc_info=error)
        self.scheduler.abort_all()
        for rid, state in list(self._requests.items()):
            with self._inbox_lock:
                self._live_ids.discard(rid)
            state.sink(error)
        self._requests.clear()
        self._by_seq.clear()
        self._pools.clear()

    # -- sync convenience and stats ------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[RequestOutput]]:
        """Run requests to completion without an event loop; returns each one's outputs."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: list[list[RequestOutput]] = [[] for _ in prompts]
        for prompt, p, sink in zip(prompts, plist, results, strict=True):
            self.submit(prompt, p, sink.append)
        while self._has_work():
            self.run_step()
        for outs in results:
            for o in outs:
                if isinstance(o, BaseException):
                    raise o
        return results

    def stats(self) -> EngineStats:
        """Counters; while the loop runs, as of the end of the last step (never mid-step)."""
        if self._task is not None and self._snapshot is not None:
            return self._snapshot
        return self._collect_stats()

    def _collect_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_preemptions=s.num_preemptions,
            kv_pages_used=s.kv_pages_used,
            kv_pages_total=s.kv_pages_total,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated_tokens,
            num_steps=self._num_steps,
            last_step_latency_s=self._last_latency,
            avg_step_latency_s=self._total_latency / self._num_steps if self._num_steps else 0.0,
        )

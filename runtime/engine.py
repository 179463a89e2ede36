"""The serving engine: requests in, incremental outputs out, one batched forward per step.

Threading model. All scheduler/runner state is touched by exactly one thread at a time: the
step, which the background task (`engine_loop.StepLoop`) runs in a worker thread so the event
loop stays free for HTTP while the model runs. Callers on the loop never touch that state;
`add_request`/`abort` post to a lock-protected inbox (`request_table.Inbox`) that the next step
drains, and outputs travel back through per-request sinks (`loop.call_soon_threadsafe` into an
asyncio.Queue). Without a loop, `submit` + `run_step` (or `generate`) drive the same code
synchronously.

The step reads schedule -> run -> postprocess: the scheduler decides; embedding chunks run
through the hidden-state function (`embedding_requests.py`), the rest through `forward` while
the grammar masks of its constrained rows are computed alongside (`grammar_masks.py`); then
`step_postprocess.py` samples, advances grammars and streams the deltas.

Failures. What goes wrong for one sequence fails that request alone (`step_postprocess.py`).
A forward that raises fails the requests of that batch; waiting ones stay queued and the
engine keeps serving. Only an error outside both (a bug in the scheduler, say) fails
everything live (`_fail_all`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

from tallow.runtime.completion_stream import CompletionStream
from tallow.runtime.constraint import GrammarMatcher, GrammarTokenizer, grammar_tokenizer
from tallow.runtime.detokenizer import byte_level_pieces
from tallow.runtime.embedding_requests import (
    EmbeddingAbortedError,
    EmbeddingRequests,
    EmbeddingsNotSupportedError,
    GenerationNotSupportedError,
)
from tallow.runtime.engine_loop import EmbeddingFutureSink, QueueSink, StepLoop
from tallow.runtime.grammar_masks import GrammarMasks
from tallow.runtime.model_runner_protocol import ModelRunner
from tallow.runtime.prompt_logprobs import PromptScoring
from tallow.runtime.request import (
    CompletionDelta,
    EmbeddingOutput,
    EngineStats,
    Request,
    RequestOutput,
    ScheduledItem,
    TokenLogprob,
    Usage,
)
from tallow.runtime.request_table import Inbox, RequestState, RequestTable, Sink
from tallow.runtime.sampler import Sampler
from tallow.runtime.sampling_params import SamplingParams
from tallow.runtime.scheduler import Scheduler, SchedulerConfig
from tallow.runtime.served_model import ServedModel
from tallow.runtime.step_postprocess import StepPostprocessor
from tallow.runtime.step_sampling import StepSampler

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
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.scheduler = Scheduler(runner, scheduler_config)
        self.sampling = StepSampler(runner, Sampler())
        self._inbox = Inbox()
        # byte-level tokenizers: one table for every stream's fast detokenizing
        byte_pieces = byte_level_pieces(tokenizer) if tokenizer is not None else None
        self._table = RequestTable(self.scheduler, self._inbox, tokenizer, byte_pieces)
        self._embeddings = EmbeddingRequests(runner, self.scheduler)
        self._postprocess = StepPostprocessor(
            self._table, self.scheduler, self.sampling, self.eos_token_ids
        )
        self._masks = GrammarMasks()
        self.scheduler.grammar_prefix = self._grammar_prefix
        self._scoring = PromptScoring(runner, self._table)
        self._step_loop = StepLoop(
            lambda: self.run_step(), lambda: self._has_work(), lambda e: self._fail_all(e)
        )
        self._prompt_tokens = 0
        self._num_steps = 0
        self._last_latency = 0.0
        self._total_latency = 0.0
        self._snapshot: EngineStats | None = None
        # Compute constrained rows' masks in a worker thread during the forward (False: after
        # it, on the step thread; for benchmarks).
        self.overlap_masks = True
        self.mask_wait_s = 0.0  # step-thread time spent on masks after the forward

    @property
    def _requests(self) -> dict[str, RequestState]:
        return self._table.requests  # step-thread only

    @property
    def _by_seq(self) -> dict[int, CompletionStream]:
        return self._table.by_seq  # seq_id -> state, step-thread only

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
        group: str | None = None,
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
        prompt = [int(t) for t in prompt_token_ids]
        self._inbox.add_request(
            rid, functools.partial(self._add, rid, prompt, params, sink, matcher, group)
        )
        self._step_loop.wake()
        return rid

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        group: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of incremental outputs (call from a loop).

        Validation errors raise here, before any output, so a server can answer 400. Closing
        the iterator early (client gone) aborts the request. Requests of one `group` (one API
        request's prompts) take one turn together when prefill is shared (`fairness`).
        """
        sink = QueueSink(asyncio.get_running_loop())
        rid = self.submit(prompt_token_ids, params, sink, request_id, group)
        self.start()
        return sink.stream(functools.partial(self.abort, rid))

    def fail_all_requests(self, error: BaseException) -> None:
        """End every live request with `error` (e.g. the server's drain ran out of time); the
        engine goes on serving. Thread-safe; takes effect at the next step boundary."""
        self._inbox.post(functools.partial(self._fail_live, error))
        self._step_loop.wake()

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output carries finish_reason "abort". Thread-safe."""
        self._inbox.post(functools.partial(self._abort, request_id))
        self._step_loop.wake()

    # -- embeddings ----------------------------------------------------------------------------

    @property
    def supports_embeddings(self) -> bool:
        return self._embeddings.supported

    @property
    def supports_generation(self) -> bool:
        return bool(getattr(self.runner, "supports_generation", True))

    @property
    def max_num_seqs(self) -> int:
        """The most sequences one step runs."""
        return self.scheduler.config.max_num_seqs

    @property
    def embedding_dimensions(self) -> int:
        """The width of an embedding (the model's hidden size)."""
        return int(self.runner.hidden_size)

    def check_embedding_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise what `submit_embedding` would for this prompt (nothing is queued)."""
        self._embeddings.check_prompt(prompt_token_ids)

    def submit_embedding(
        self,
        prompt_token_ids: list[int],
        sink: Sink,
        request_id: str | None = None,
        group: str | None = None,
    ) -> str:
        """Validate and queue one embedding request; its `EmbeddingOutput` (or an error, or a
        `RequestOutput` with finish_reason "abort") goes to `sink` from the step thread.
        Requests of one `group` take one prefill turn together (`fairness`)."""
        self.check_embedding_prompt(prompt_token_ids)
        rid = request_id or uuid.uuid4().hex
        prompt = [int(t) for t in prompt_token_ids]
        add = functools.partial(self._add_embedding, rid, prompt, sink, group)
        self._inbox.add_request(rid, add)
        self._step_loop.wake()
        return rid

    async def embed(
        self, prompts: list[list[int]], max_in_flight: int | None = None
    ) -> list[np.ndarray]:
        """Pooled, L2-normalised float32 embeddings of `prompts` (call from a loop).

        Every prompt is validated before any is queued, so a bad one raises with nothing
        running. At most `max_in_flight` prompts are in the engine at once (all by default),
        the next queued as each finishes: a 2,048-input request then holds a window of the
        queue, not all of it, and requests arriving behind it are admitted (issue 33: 22 of
        23 chat requests got 429 while one such request ran). The prompts take their prefill
        turns as one group. The first error ends the call; cancelling it, or an error, aborts
        what is still in flight.
        """
        for p in prompts:
            self.check_embedding_prompt(p)
        loop = asyncio.get_running_loop()
        window = max(1, max_in_flight or len(prompts))
        group = uuid.uuid4().hex
        results: list[np.ndarray | None] = [None] * len(prompts)
        in_flight: dict[asyncio.Future[np.ndarray], tuple[int, str]] = {}
        queued = 0
        try:
            while queued < len(prompts) or in_flight:
                while queued < len(prompts) and len(in_flight) < window:
                    fut: asyncio.Future[np.ndarray] = loop.create_future()
                    sink = EmbeddingFutureSink(loop, fut)
                    rid = self.submit_embedding(prompts[queued], sink, group=group)
                    in_flight[fut] = (queued, rid)
                    queued += 1
                self.start()
                done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    index, _ = in_flight.pop(fut)
                    results[index] = fut.result()
            return results  # type: ignore[return-value]
        finally:
            for fut, (_, rid) in in_flight.items():
                if not fut.done():
                    self.abort(rid)
                    fut.cancel()  # nobody waits for it any more (nor for the abort's error)
                elif not fut.cancelled():
                    fut.exception()  # read: asyncio would log it as "never retrieved"

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
        self._step_loop.start()

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the loop."""
        for rid in self._inbox.live_ids():
            self.abort(rid)
        await self._step_loop.stop()

    def _has_work(self) -> bool:
        return self._inbox.has_pending() or self.scheduler.has_work()

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
            self._embeddings.run(embeds, self._table.finish_embedding)
            out = dataclasses.replace(
                out, items=[it for it in out.items if not it.seq.request.embed]
            )
        constrained = [
            st
            for item in out.items
            if item.sample and (st := self._table.by_seq[item.seq.seq_id]).matcher is not None
        ]
        masks = self._masks.start(constrained, self.overlap_masks)
        # Prompt-scoring chunks need every position's logits: their own forward, first (the
        # device sampler reads the last `forward`'s logits).
        scored, out = self._scoring.split(out)
        try:
            scored_logits = self._scoring.run(scored) if scored else None
            logits = None
            if out.items:  # every verified token's logits when speculating
                rows = out.num_logits
                args = (out.forward_items,) if rows is None else (out.forward_items, rows)
                logits = self.runner.forward(*args)
        except Exception as e:  # noqa: BLE001 - the batch fails; the engine serves on
            self._fail_batch([*scored, *out.items], e)
            return
        finally:
            masks.join()  # never leave the worker touching matchers past here, even on failure
        row_masks, failed = masks.collect()
        self.mask_wait_s += masks.wait_s
        more = [(scored, scored_logits)] if scored else []
        self._postprocess.run(out.items, logits, row_masks, failed, more)

    def _grammar_prefix(self, seq, tokens: list[int]) -> int:
        """How many of `tokens` (speculative proposals) `seq`'s grammar allows next."""
        matcher = self._table.by_seq[seq.seq_id].matcher
        return len(tokens) if matcher is None else matcher.valid_prefix(tokens)

    def _drain_inbox(self) -> None:
        for apply in self._inbox.take():
            apply()

    def _add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        matcher: GrammarMatcher | None = None,
        group: str | None = None,
    ) -> None:
        req = Request(rid, prompt, params, self.scheduler.next_arrival_index(), group=group)
        state = RequestState(request=req, sink=sink)
        self._table.requests[rid] = state
        if params.max_tokens == 0 and params.prompt_logprobs is None:
            # Nothing to generate and nothing to score (`echo` with max_tokens 0 returns the
            # prompt alone): finished at once, without a forward.
            state.num_finished = params.n
            ends = [CompletionDelta(index=i, finish_reason="length") for i in range(params.n)]
            self._table.emit(state, ends)
            return
        seq = self.scheduler.add_request(req)
        self._table.track(state, seq, matcher)
        self._prompt_tokens += len(prompt)

    def _add_embedding(
        self, rid: str, prompt: list[int], sink: Sink, group: str | None = None
    ) -> None:
        req = self._embeddings.add(rid, prompt, group)
        self._table.requests[rid] = RequestState(request=req, sink=sink)
        self._prompt_tokens += len(prompt)

    def _abort(self, rid: str) -> None:
        for seq in self._table.abort(rid):
            self._embeddings.forget(seq.seq_id)

    def _fail_live(self, error: BaseException) -> None:
        """`fail_all_requests`, on the step thread."""
        for rid in list(self._table.requests):
            self._table.fail(rid, error, log_it=False)

    def _fail_batch(self, items: list[ScheduledItem], error: BaseException) -> None:
        """The forward raised: the requests it ran fail; the rest stay queued."""
        log.error("the forward failed: %s: %s", type(error).__name__, error, exc_info=error)
        for rid in dict.fromkeys(item.seq.request.request_id for item in items):
            self._table.fail(rid, error)

    def _fail_all(self, error: BaseException) -> None:
        """A step raised outside any one request's work: every live request gets the error
        and its KV is freed; the engine then serves new requests."""
        log.error("engine step failed: %s: %s", type(error).__name__, error, exc_info=error)
        self._table.fail_all(error)
        self._embeddings.clear()
        self._scoring.clear()

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
        if self._step_loop.started and self._snapshot is not None:
            return self._snapshot
        return self._collect_stats()

    def _collect_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        policy = self.scheduler.speculation
        spec = policy.stats if policy is not None else None
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_preemptions=s.num_preemptions,
            kv_pages_used=s.kv_pages_used,
            kv_pages_total=s.kv_pages_total,
            prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._postprocess.generated_tokens,
            num_steps=self._num_steps,
            last_step_latency_s=self._last_latency,
            avg_step_latency_s=self._total_latency / self._num_steps if self._num_steps else 0.0,
            spec_proposed_tokens=spec.proposed if spec else 0,
            spec_accepted_tokens=spec.accepted if spec else 0,
        )

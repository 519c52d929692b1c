"""The serving engine's loop: requests in, results out, one model step at a time. A step takes
the requests and aborts that arrived since the last, schedules (scheduler.py: continuous
batching over the paged KV cache, chunked prefill, preemption), runs the model (runner.py, or
tp.py's executor), turns the logits into each sequence's results (outputs.py) and hands them to
its sink, or to `dispatch`; a finished or aborted sequence leaves the batch, its blocks back in
the pool, within that step. `submit` and `abort` may be called from any thread; `step` runs on
one thread only: the engine's (`start`), or the caller's (`generate`, remote.py's loop).
"""
from __future__ import annotations

import itertools
import threading
import time

from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.detokenize import TextStream, special_token_ids
from bloomtrain.serve.interface import EngineClosed, QueueFull, SeqOutput, check_request
from bloomtrain.serve.outputs import process_step, sampling_batch
from bloomtrain.serve.sampling import SamplingParams
from bloomtrain.serve.scheduler import Scheduler, Sequence

__all__ = ["Engine", "generate_offline"]


class Engine:
    """`execute(StepBatch, SamplingBatch) -> SamplerOutput` runs the model and samples where
    its logits are (a ModelRunner's forward, or the tensor-parallel executor). `vocab_limit`
    masks the padded embedding rows beyond the tokenizer; `eos_token_id` ends a sequence;
    `tokenizer` (optional) gives text and stop strings; `device`: where the logits are, so
    where a seeded request's generator draws."""

    def __init__(self, execute, config: EngineConfig, *, vocab_size: int,
                 vocab_limit: int | None = None, eos_token_id: int | None = None,
                 tokenizer=None, metrics=None, device="cpu"):
        config.check()
        self.execute, self.device = execute, device
        self.config, self.vocab_size = config, vocab_size
        self.vocab_limit = vocab_limit if vocab_limit is not None else vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer) if tokenizer is not None else frozenset()
        self.metrics = metrics
        self.scheduler = Scheduler(config, on_admit=self._admitted, on_preempt=self._preempted)
        self.pool = self.scheduler.pool
        self.blocks_total = self.pool.num_blocks
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._aborts: set[int] = set()
        self._queued = 0            # submitted, not yet admitted once (--max-queue counts these)
        self._requeued = 0          # preempted, waiting to be admitted again
        self._live: set[int] = set()
        self._closed = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # When set, called once per step with that step's [(sink, SeqOutput)] instead of each
        # sink being called on the engine thread: the HTTP server hands them to its event loop
        # in one wake-up rather than one per sequence.
        self.dispatch = None
        self._pending: list = []
        if metrics is not None:
            metrics.engine = self

    # ---- gauges (read from any thread; approximate while a step runs) ------------------------

    @property
    def num_waiting(self) -> int:  # new and preempted ones, as vLLM's num_requests_waiting
        return self._queued + self._requeued

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def running(self) -> tuple[Sequence, ...]:
        """The sequences of the running batch (a copy: the scheduler owns its queues)."""
        return tuple(self.scheduler.running)

    @property
    def blocks_used(self) -> int:
        return self.pool.num_used

    @property
    def num_live(self) -> int:
        """Sequences submitted and not finished."""
        with self._lock:
            return len(self._live)

    # ---- requests ------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError saying why this engine cannot serve the request."""
        check_request(self.config, prompt_ids, params, self.vocab_limit,
                      self.tokenizer is not None)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink) -> int:
        """Queue a sequence; `sink(SeqOutput)` receives its results. Returns its id. Raises
        RequestError, QueueFull or EngineClosed."""
        self.check_request(prompt_ids, params)
        text = (TextStream(self.tokenizer, params.stop, self.special_ids)
                if self.tokenizer is not None else None)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is shutting down" if self.error is None
                                   else f"the engine failed: {self.error!r}")
            if self._queued >= self.config.max_queue:
                raise QueueFull(f"{self._queued} requests are waiting "
                                f"(--max-queue {self.config.max_queue})")
            seq = Sequence(next(self._ids), prompt_ids, params, sink, text, self.device)
            self._inbox.append(seq)
            self._queued += 1
            self._live.add(seq.id)
            self._wake.notify()
        return seq.id

    def abort(self, seq_id: int) -> None:
        """Drop a sequence (its client went away): it leaves the batch at the next step and
        its blocks go back to the pool."""
        with self._lock:
            if seq_id in self._live:
                self._aborts.add(seq_id)
                self._wake.notify()

    # ---- the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bloomtrain-engine", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, stop the loop after its current step, abort what is left."""
        with self._lock:
            self._closed = True
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._finish_all("abort")

    def stop_accepting(self) -> None:
        with self._lock:
            self._closed = True

    async def metrics_snapshot(self) -> dict | None:
        return None  # in this process, the server's metrics are the engine's

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not (self._inbox or self._aborts
                                                  or self.scheduler.has_work):
                        self._wake.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as e:
            self.fail(e)

    def fail(self, e: BaseException) -> None:
        """A step failed: fail every request, take no more."""
        self.error = e
        self.stop_accepting()
        self._finish_all("error", repr(e))

    def _finish_all(self, reason: str, error: str | None = None) -> None:
        with self._lock:
            seqs = list(self._inbox)
            self._inbox.clear()
        seqs += self.scheduler.clear()
        for seq in seqs:
            self._finish(seq, reason, error=error, release=False)
        self._flush()

    def step(self) -> bool:
        """Run one iteration. Returns False when there was nothing to do."""
        self._take_inbox()
        entries, batch = self.scheduler.schedule()
        if entries:
            result = self.execute(batch, sampling_batch(entries, self.vocab_limit,
                                                        self.eos_token_id))
            if self.metrics is not None:
                self.metrics.step_done()
            process_step(entries, result, self.eos_token_id, self.metrics, self._emit)
        self._flush()
        return bool(entries)

    def generate(self, prompts: list[list[int]], params, arrival_steps=None) -> list[dict]:
        """Serve `prompts` to completion on this thread (see `generate_offline`)."""
        return generate_offline(self, prompts, params, arrival_steps)

    # ---- scheduling ----------------------------------------------------------------------------

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for seq in new:
            if seq.params.max_tokens == 0 and seq.prompt_logprobs is None:
                self._admitted(seq)
                self._finish(seq, "length", release=False)  # nothing to compute
            else:
                self.scheduler.add(seq)
        if aborts:
            for seq in self.scheduler.abort(aborts):
                self._finish(seq, "abort", release=False)

    def _preempted(self, seq: Sequence) -> None:
        with self._lock:
            seq.requeued, self._requeued = True, self._requeued + 1
        if self.metrics is not None:
            self.metrics.preempted()

    def _admitted(self, seq: Sequence) -> None:
        self._not_requeued(seq)
        if not seq.admitted:
            seq.admitted = True
            with self._lock:
                self._queued -= 1
            if self.metrics is not None:
                self.metrics.admitted(seq.num_prompt)

    def _not_requeued(self, seq: Sequence) -> None:
        with self._lock:
            self._requeued, seq.requeued = self._requeued - seq.requeued, False

    # ---- results -------------------------------------------------------------------------------

    def _emit(self, seq: Sequence, out: SeqOutput, finish: str | None = None) -> None:
        if finish is not None:
            self._finish(seq, _finish_text(seq, out, finish), out=out)
            return
        self._deliver(seq, out)

    def _deliver(self, seq: Sequence, out: SeqOutput) -> None:
        if self.dispatch is not None:
            self._pending.append((seq.sink, out))
            return
        try:
            seq.sink(out)
        except Exception:  # a broken sink (its client gone) must not take the engine down
            if out.finish_reason is None:
                self.abort(seq.id)

    def _flush(self) -> None:
        if self.dispatch is None or not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            self.dispatch(pending)
        except Exception:  # the receiving loop is gone (shutdown): so are its requests
            pass

    def _finish(self, seq: Sequence, reason: str, out: SeqOutput | None = None,
                error: str | None = None, release: bool = True) -> None:
        if release:
            self.scheduler.release(seq)
        with self._lock:
            if seq.id not in self._live:
                return
            self._live.discard(seq.id)
            if not seq.admitted:
                self._queued -= 1
        self._not_requeued(seq)  # a preempted sequence aborted (or failed) while waiting
        out = out or SeqOutput(seq.id, [], "")
        out.finish_reason, out.error = reason, error
        if self.metrics is not None:
            self.metrics.finished(reason, time.monotonic() - seq.arrival)
        self._deliver(seq, out)


def _finish_text(seq: Sequence, out: SeqOutput, finish: str) -> str:
    """Add to `out` the text `seq` held back (for stop strings, or bytes of a character not
    yet whole); returns the reason it ends with: "stop" where a stop string was found in it."""
    if seq.text is None:
        return finish
    out.text += seq.text.finish()
    return "stop" if seq.text.stopped else finish


def generate_offline(engine: "Engine", prompts: list[list[int]],
                     params: SamplingParams | list[SamplingParams],
                     arrival_steps: list[int] | None = None) -> list[dict]:
    """Serve `prompts` to completion on this thread, prompt i joining at step
    `arrival_steps[i]` (default: all at once). Returns, per prompt, {"token_ids", "text",
    "finish_reason", "logprobs", "prompt_logprobs"}. For offline use and tests; not
    together with `Engine.start`."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    arrival_steps = arrival_steps or [0] * len(prompts)
    results = [{"token_ids": [], "text": "", "finish_reason": None, "logprobs": [],
                "prompt_logprobs": None} for _ in prompts]
    ids = {}

    def sink_for(i):
        def sink(out: SeqOutput):
            r = results[i]
            r["token_ids"] += out.token_ids
            r["text"] += out.text
            r["logprobs"] += out.logprobs
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"] = out.prompt_logprobs
            if out.finish_reason is not None:
                r["finish_reason"] = out.finish_reason
        return sink

    order = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    step = 0
    while order or engine.num_live:
        while order and arrival_steps[order[0]] <= step:
            i = order.pop(0)
            ids[i] = engine.submit(prompts[i], params[i], sink_for(i))
        engine.step()
        step += 1
    return results

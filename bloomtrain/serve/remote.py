"""The HTTP front end and the engine in two processes, as `bloomtrain serve` runs them (vLLM's
API server and engine core split the same way). The engine process is the launching one (under
tensor parallelism rank 0, which schedules and broadcasts); it starts the front end as a
spawned child and runs `serve_engine` on its main thread. They talk over one Pipe:
- front end -> engine: ("submit", id, prompt ids, SamplingParams), ("abort", id),
  ("metrics", token), ("stop_accepting",), ("bye",);
- engine -> front end: ("out", [(id, SeqOutput)], gauges) once per step, ("metrics", token,
  snapshot), ("error", text) when a step failed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import threading

from bloomtrain.serve.interface import (EngineClosed, QueueFull, RequestError, SeqOutput,
                                        check_request)
from bloomtrain.serve.metrics import ServeMetrics


FRONTEND_BIND_FAILED = 3  # the front end's exit code when it cannot listen


def frontend_failure(exitcode: int | None) -> str | None:
    """Why the front end stopped, when it did not stop cleanly (None when it did)."""
    if exitcode in (0, None):
        return None
    if exitcode == FRONTEND_BIND_FAILED:
        return "the HTTP server could not listen (see the error above)"
    if exitcode < 0:
        return f"the HTTP front end was killed by {signal.Signals(-exitcode).name}"
    return f"the HTTP front end failed with exit code {exitcode} (see the error above)"


def _gauges(engine) -> tuple[int, int, int]:
    return engine.num_waiting, engine.num_running, engine.blocks_used


# ---- the engine process ---------------------------------------------------------------------

@contextlib.contextmanager
def _forwarded_signals(frontend, received: list):
    """The SIGTERM and SIGINT this process receives go to `frontend` (a Process) as well, and
    into `received`."""
    previous = {}
    if frontend is not None:
        def forward(signum, frame):
            received.append(signum)
            if frontend.pid is not None and frontend.is_alive():
                os.kill(frontend.pid, signum)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _handle(engine, msg, ids: dict[int, int], send) -> bool:
    """One message of the front end; True when it said bye."""
    kind = msg[0]
    if kind == "submit":
        _, cid, prompt_ids, params = msg
        try:
            ids[cid] = engine.submit(prompt_ids, params, cid)
        except (QueueFull, EngineClosed, RequestError) as e:
            reason = "error" if isinstance(e, RequestError) else "abort"
            send(("out", [(cid, SeqOutput(-1, [], "", finish_reason=reason, error=str(e)))],
                  _gauges(engine)))
    elif kind == "abort":
        if msg[1] in ids:
            engine.abort(ids[msg[1]])
    elif kind == "metrics":
        send(("metrics", msg[1], engine.metrics.snapshot()
              if engine.metrics is not None else {}))
    elif kind == "stop_accepting":
        engine.stop_accepting()
    return kind == "bye"


def serve_engine(engine, conn, frontend=None, log=print) -> list[int]:
    """Run `engine` for the front end at the other end of `conn` until it says bye or goes
    away. `frontend` (a multiprocessing Process) gets the SIGTERM/SIGINT this process
    receives: it drains (stops listening, lets the requests in flight finish, the engine still
    stepping), says "bye" and exits, and this process then stops. If either process dies, the
    other sees the pipe close: this one stops, the front end fails what is in flight and drains
    out. Call on the main thread (signal handlers); `engine` must not be started. Returns the
    stop signals received (the front end's end is then what was asked for, however it went:
    one still starting has no handlers yet and dies of the signal)."""
    ids: dict[int, int] = {}  # front-end id -> engine sequence id
    received: list[int] = []

    def send(msg) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass  # the front end is gone: the loop sees the pipe close and stops

    def dispatch(pairs) -> None:
        for cid, out in pairs:
            if out.finish_reason is not None:
                ids.pop(cid, None)
        send(("out", pairs, _gauges(engine)))

    engine.dispatch = dispatch
    try:
        with _forwarded_signals(frontend, received):
            while True:
                timeout = 0 if engine.num_live > 0 else None
                while conn.poll(timeout):
                    timeout = 0
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        if not received:
                            log("[serve] the HTTP front end exited; stopping the engine",
                                flush=True)
                        return received
                    if _handle(engine, msg, ids, send):
                        return received
                if engine.num_live > 0 and engine.error is None:
                    try:
                        engine.step()
                    except Exception as e:
                        engine.fail(e)
                        send(("error", repr(e)))
    finally:
        engine.dispatch = None


def start_frontend(opts: dict, info: dict):
    """Start the HTTP front end (a spawned process); returns (process, connection)."""
    # Two processes, because in one the engine's thread and the event loop share the GIL: every
    # torch op of a step hands it over and takes it back, and while the loop writes a step's
    # server-sent events (one per sequence per token) the engine waits at each op, so the two
    # serialize, and worse, convoy. Split, the engine only schedules and runs steps while the
    # front end parses, tokenizes and writes events on another core.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=frontend_main, args=(there, opts, info),
                       name="bloomtrain-serve-http", daemon=False)
    proc.start()
    there.close()
    return proc, here


# ---- the front-end process ------------------------------------------------------------------

class RemoteEngine:
    """The engine as the HTTP handlers see it, in the front-end process: requests go down the
    pipe, and each step's outputs come back on a reader thread, which hands them to
    `dispatch` (set by the server: onto its event loop) with each id's sink. Like the Engine it
    is an EngineClient (bloomtrain.serve.interface), so the handlers, and the tests that drive
    the in-process engine, see both alike. Requests are checked here (the same `check_request`)
    so a bad one never crosses; the queue limit is checked against the engine's last reported
    depth plus what was sent since, and the engine still enforces it exactly (a request it
    refuses after all ends with an overload error, a 503)."""

    def __init__(self, conn, config, *, vocab_limit: int, has_tokenizer: bool):
        self.conn, self.config = conn, config
        self.vocab_limit, self.has_tokenizer = vocab_limit, has_tokenizer
        self.error: BaseException | None = None
        self.dispatch = None
        self.num_waiting = self.num_running = self.blocks_used = 0
        self.blocks_total = config.num_blocks
        self._lock = threading.Lock()        # the bookkeeping below
        self._send_lock = threading.Lock()   # the pipe's sending end
        self._sinks: dict[int, object] = {}
        self._ids = itertools.count()
        self._sent_since = 0        # submits sent since the last gauges arrived
        self._closed = False
        self._bye = False
        self._waiters: dict[int, tuple] = {}
        self._reader = threading.Thread(target=self._read, name="bloomtrain-engine-client",
                                        daemon=True)
        self._reader.start()

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._sinks)

    def check_request(self, prompt_ids, params) -> None:
        check_request(self.config, prompt_ids, params, self.vocab_limit, self.has_tokenizer)

    def submit(self, prompt_ids, params, sink) -> int:
        self.check_request(prompt_ids, params)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is shutting down" if self.error is None
                                   else f"the engine failed: {self.error!r}")
            waiting = self.num_waiting + self._sent_since
            if waiting >= self.config.max_queue:
                raise QueueFull(f"{waiting} requests are waiting "
                                f"(--max-queue {self.config.max_queue})")
            cid = next(self._ids)
            self._sinks[cid] = sink
            self._sent_since += 1
        self._send(("submit", cid, list(prompt_ids), params))
        return cid

    def abort(self, cid: int) -> None:
        with self._lock:
            live = cid in self._sinks
        if live:
            self._send(("abort", cid))

    def stop_accepting(self) -> None:
        with self._lock:
            self._closed = True
        self._send(("stop_accepting",))

    async def metrics_snapshot(self, timeout: float = 30.0) -> dict | None:
        """The engine's counters and histograms (ServeMetrics.snapshot), or None when it does
        not answer within `timeout` (a step is running long) or is gone."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            token = next(self._ids)
            self._waiters[token] = (loop, future)
        self._send(("metrics", token))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            with self._lock:
                self._waiters.pop(token, None)

    def close(self) -> None:
        """Tell the engine this front end is done (after the drain)."""
        with self._lock:
            self._closed = True
            self._bye = True
        self._send(("bye",))

    def _send(self, msg) -> None:
        # Never with self._lock held: a send blocks while the pipe is full (the engine reads
        # between steps), and the reader thread, which must keep draining the engine's outputs
        # meanwhile, takes self._lock.
        try:
            with self._send_lock:  # one writer at a time
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass  # the reader sees the pipe close and fails what is in flight

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            kind = msg[0]
            if kind == "out":
                pairs = []
                with self._lock:
                    for cid, out in msg[1]:
                        sink = (self._sinks.pop(cid, None) if out.finish_reason is not None
                                else self._sinks.get(cid))
                        if sink is not None:
                            pairs.append((sink, out))
                    self.num_waiting, self.num_running, self.blocks_used = msg[2]
                    self._sent_since = 0
                self._deliver(pairs)
            elif kind == "metrics":
                with self._lock:
                    waiter = self._waiters.get(msg[1])
                if waiter is not None:
                    loop, future = waiter
                    loop.call_soon_threadsafe(
                        lambda f=future, v=msg[2]: f.done() or f.set_result(v))
            elif kind == "error":
                with self._lock:
                    self.error = RuntimeError(msg[1])
                    self._closed = True

    def _deliver(self, pairs) -> None:
        if pairs and self.dispatch is not None:
            try:
                self.dispatch(pairs)
            except Exception:  # the event loop is gone (shutdown)
                pass

    def _lost(self) -> None:
        """The engine process is gone: fail what is in flight, and stop this front end."""
        with self._lock:
            bye = self._bye
            self._closed = True
            if not bye and self.error is None:
                self.error = EngineClosed("the engine process exited")
            sinks, self._sinks = list(self._sinks.values()), {}
        self._deliver([(s, SeqOutput(-1, [], "", finish_reason="error",
                                     error="the engine process exited")) for s in sinks])
        if not bye:
            os.kill(os.getpid(), signal.SIGTERM)  # run_server drains (nothing left) and exits


def frontend_main(conn, opts: dict, info: dict) -> None:
    """The front-end process: load the tokenizer, serve HTTP until SIGTERM, drain, say bye."""
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.serve.server import create_app, run_server

    tokenizer = load_tokenizer(opts["tokenizer"])
    metrics = ServeMetrics()
    client = RemoteEngine(conn, info["config"], vocab_limit=info["vocab_limit"],
                          has_tokenizer=True)
    metrics.engine = client
    app = create_app(client, tokenizer, metrics, served_names=info["served_names"],
                     chat_template=info["chat_template"], strict_fields=info["strict_fields"],
                     api_key=opts["api_key"])
    try:
        asyncio.run(run_server(app, opts["host"], opts["port"], opts["drain_timeout"]))
    except OSError as e:  # the address is taken, or not ours to bind
        print(f"[serve] error: cannot listen on {opts['host']}:{opts['port']}: {e}; pick "
              f"another --port or --host", file=sys.stderr, flush=True)
        raise SystemExit(FRONTEND_BIND_FAILED) from None
    finally:
        client.close()

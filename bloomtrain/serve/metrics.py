"""The server's metrics in Prometheus' text exposition format (version 0.0.4): counters, gauges
read when scraped, and cumulative histograms. Written by hand (a few dozen lines) rather than
with prometheus_client, which would be a dependency for this alone; the tests parse the output
with prometheus_client's own parser.

Updated from two threads (the engine's and the HTTP event loop's) through the recording methods,
each of which takes the lock. When the engine runs in its own process (bloomtrain.serve.remote),
the front end's /metrics asks it for a `snapshot` of the engine-side metrics and `absorb`s it
before rendering.
"""
from __future__ import annotations

import math
import threading

# Seconds: time to first token spans a decode step to a long queue; inter-token latency is a
# step of a batch, milliseconds to a fraction of a second.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    body = ",".join(f'{n}="{_escape(str(v))}"' for n, v in zip(names, values))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help_text, labelnames
        self.values: dict[tuple, float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, *labelvalues) -> None:
        key = tuple(labelvalues)
        self.values[key] = self.values.get(key, 0.0) + amount

    def samples(self):
        # Exposition names a counter's sample <name>_total; our names already end so.
        for key, v in sorted(self.values.items()):
            yield self.name, self.labelnames, key, v


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, help_text: str, read):
        self.name, self.help, self.read = name, help_text, read

    def samples(self):
        yield self.name, (), (), float(self.read())


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help = name, help_text
        self.bounds = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        for i, bound in enumerate(self.bounds):
            if v <= bound:
                self.counts[i] += 1
                break
        self.sum += v

    @property
    def count(self) -> int:
        return sum(self.counts)

    def samples(self):
        running = 0
        for bound, c in zip(self.bounds, self.counts):
            running += c
            yield f"{self.name}_bucket", ("le",), (_number(bound),), running
        yield f"{self.name}_sum", (), (), self.sum
        yield f"{self.name}_count", (), (), running


class ServeMetrics:
    """Every metric of `bloomtrain serve`. `engine` (set once the engine exists) provides the
    live gauges: queue depth, running sequences, KV-cache blocks."""

    def __init__(self):
        self.lock = threading.Lock()
        self.engine = None
        self.requests = Counter("bloomtrain_requests_total",
                                "Finished sequences (one per prompt) by finish reason",
                                ("finish_reason",))
        self.http = Counter("bloomtrain_http_responses_total",
                            "HTTP responses by endpoint and status code", ("endpoint", "code"))
        self.prompt_tokens = Counter("bloomtrain_prompt_tokens_total",
                                     "Prompt tokens of admitted sequences")
        self.generation_tokens = Counter("bloomtrain_generation_tokens_total",
                                         "Generated tokens")
        self.preemptions = Counter("bloomtrain_preemptions_total",
                                   "Sequences preempted (blocks freed, recomputed later) when "
                                   "the KV cache ran out")
        self.steps = Counter("bloomtrain_engine_steps_total", "Engine iterations run")
        self.ttft = Histogram("bloomtrain_time_to_first_token_seconds",
                              "From a sequence's arrival to its first generated token",
                              TTFT_BUCKETS)
        self.itl = Histogram("bloomtrain_inter_token_latency_seconds",
                             "Between consecutive generated tokens of a sequence", ITL_BUCKETS)
        self.latency = Histogram("bloomtrain_request_latency_seconds",
                                 "From a sequence's arrival to its end", LATENCY_BUCKETS)

    # ---- recording: each takes the lock itself (the engine's thread and the event loop's) --

    def step_done(self) -> None:
        with self.lock:
            self.steps.inc()

    def preempted(self) -> None:
        with self.lock:
            self.preemptions.inc()

    def admitted(self, num_prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens.inc(num_prompt_tokens)

    def token(self, since_arrival: float | None, since_last: float | None) -> None:
        """A generated token: the first of its sequence (`since_arrival`, time to first
        token) or a later one (`since_last`, inter-token latency)."""
        with self.lock:
            if since_last is None:
                self.ttft.observe(since_arrival)
            else:
                self.itl.observe(since_last)
            self.generation_tokens.inc()

    def finished(self, reason: str, latency: float) -> None:
        with self.lock:
            self.requests.inc(1, reason)
            self.latency.observe(latency)

    def http_response(self, endpoint: str, code: int) -> None:
        with self.lock:
            self.http.inc(1, endpoint, str(code))

    # What the engine updates; under `bloomtrain serve` it runs in another process than the
    # HTTP front end (bloomtrain.serve.remote), which copies these in when scraped.
    ENGINE_SIDE = ("requests", "prompt_tokens", "generation_tokens", "preemptions", "steps",
                   "ttft", "itl", "latency")

    def snapshot(self) -> dict:
        """Copies of the engine-side metrics, to send to another process."""
        import copy
        with self.lock:
            return {name: copy.deepcopy(getattr(self, name)) for name in self.ENGINE_SIDE}

    def absorb(self, snapshot: dict) -> None:
        """Take the engine-side metrics of `snapshot` (another process's `snapshot()`)."""
        with self.lock:
            for name in self.ENGINE_SIDE:
                if name in snapshot:
                    setattr(self, name, snapshot[name])

    def _engine_value(self, attr: str) -> float:
        return 0.0 if self.engine is None else float(getattr(self.engine, attr))

    def _gauges(self) -> list[Gauge]:
        e = self._engine_value
        return [
            Gauge("bloomtrain_queue_depth", "Sequences waiting to be admitted",
                  lambda: e("num_waiting")),
            Gauge("bloomtrain_running_sequences", "Sequences in the running batch",
                  lambda: e("num_running")),
            Gauge("bloomtrain_kv_cache_blocks_used", "KV-cache blocks held by sequences",
                  lambda: e("blocks_used")),
            Gauge("bloomtrain_kv_cache_blocks_total", "KV-cache blocks in the pool",
                  lambda: e("blocks_total")),
            Gauge("bloomtrain_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                  lambda: e("blocks_used") / max(e("blocks_total"), 1.0)),
        ]

    def render(self) -> str:
        lines = []
        with self.lock:
            metrics = [self.requests, self.http, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.steps, self.ttft, self.itl, self.latency]
            for m in metrics + self._gauges():
                # A counter's family is named without _total in the HELP/TYPE lines.
                family = m.name[:-len("_total")] if m.kind == "counter" else m.name
                lines.append(f"# HELP {family} {m.help}")
                lines.append(f"# TYPE {family} {m.kind}")
                for name, names, values, v in m.samples():
                    lines.append(f"{name}{_labels(names, values)} {_number(v)}")
        return "\n".join(lines) + "\n"

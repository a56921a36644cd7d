"""What an operator needs around minillm's server: API keys, per-key limits, Prometheus metrics,
a JSON access log and a graceful shutdown.

A plain module (no notebook): nothing here is about inference. Notebook 18 shows each piece at
work and minillm/serve/server.py composes them; docs/server.md ("Running the server for others") lists the flags.

- `APIKeys`: `Authorization: Bearer KEY` against the configured keys, compared in constant time;
  logs and metrics name a key by `key_id` (a hash prefix), never by the key. With keys,
  `schema_pages` turns FastAPI's /docs, /redoc and /openapi.json off.
- `KeyLimits`: per key, requests at once and tokens per minute (a token bucket); past either, 429
  with `Retry-After`.
- `Metrics`: a prometheus-client registry per app: counters and histograms the request path
  updates, and gauges read from the engine at scrape time.
- `RequestRecord`: one request from arrival to end; `end` releases its limits, counts it and writes
  its access-log line. `Gate` admits a request (503, 401, 429) and returns its record.
- `GracefulServer`: uvicorn that, on SIGTERM or Ctrl-C, stops accepting, drains, and exits 0.

References: OpenAI's API reference (authentication, rate limits and `Retry-After`); Prometheus'
metric naming guide; vLLM's /metrics (the metric set); the token bucket (Turner, "New directions
in communications", 1986).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import uvicorn
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from minillm.utils.validate import is_number, is_positive_int

KEY_ENV = "MINILLM_API_KEY"
ACCESS_LOG = logging.getLogger("minillm.access")


class Refusal(Exception):
    """A request refused before it starts: its HTTP status, message, OpenAI error code and headers
    (the server answers it as OpenAI error JSON, through openai_protocol.APIError)."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


# ---------------------------------------------------------------- API keys


def key_id(key: str) -> str:
    """How logs and metrics name a key: "key-" and 8 hex digits of its SHA-256 (the key never appears)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_keys(keys: Iterable[str] = (), key_file: str | Path | None = None,
              environ: Mapping[str, str] = os.environ) -> list[str]:
    """The API keys: --api-key values, a file (one key per line; blank lines and # comments skipped)
    and the MINILLM_API_KEY variable. ValueError for a key a header cannot carry (naming where it came from)."""
    found = [(k, "--api-key") for k in keys]
    if key_file is not None:
        lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        found += [(line.strip(), f"{key_file}:{n}") for n, line in enumerate(lines, 1)
                  if line.strip() and not line.strip().startswith("#")]
    if environ.get(KEY_ENV):
        found.append((environ[KEY_ENV], KEY_ENV))
    for key, where in found:
        if not key.isascii() or not key.isprintable() or " " in key or len(key) < 8:
            raise ValueError(f"the API key from {where} must be at least 8 printable ASCII characters without "
                             f"spaces (got {len(key)} characters)")
    return [key for key, _ in found]


class APIKeys:
    """The server's keys. No keys: every request is "anonymous" and allowed."""

    def __init__(self, keys: Iterable[str] = ()):
        self.digests = {hashlib.sha256(k.encode()).digest(): key_id(k) for k in keys}

    def identify(self, authorization: str | None) -> str:
        """The key id of `Authorization: Bearer KEY`; 401 without a valid key. Every known key is
        compared, in constant time, whether or not an earlier one matched: the answer's timing says
        nothing about how close a guess was."""
        if not self.digests:
            return "anonymous"
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refusal(401, "no API key: send the header `Authorization: Bearer YOUR_KEY`", "invalid_api_key")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, name in self.digests.items():
            if hmac.compare_digest(digest, known):
                found = name
        if found is None:
            raise Refusal(401, "incorrect API key provided", "invalid_api_key")
        return found


# ---------------------------------------------------------------- per-key limits


def too_many(message: str, retry_after: float) -> Refusal:
    """A 429 that tells the client when to come back (Retry-After, whole seconds, at least 1)."""
    return Refusal(429, message, "rate_limit_exceeded", {"Retry-After": str(max(1, math.ceil(retry_after)))})


class TokenBucket:
    """`per_minute` tokens a minute, refilled continuously, holding at most a minute's worth. A request
    may start while the key is not in debt (level >= 0) and pays for its tokens as it uses them, so
    the level may go below zero: that debt delays the key's next request."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.capacity, self.rate, self.clock = float(per_minute), per_minute / 60.0, clock
        self.level, self.stamp = self.capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self) -> float:
        """Seconds until a request may start: 0 unless the level is below zero."""
        self._refill()
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def charge(self, tokens: int) -> None:
        self._refill()
        self.level -= tokens


def _validate_limit(name: str, value) -> None:
    if value is not None and not is_positive_int(value):
        raise ValueError(f"{name} must be an int >= 1 or None (no limit), got {value!r}")


class KeyLimits:
    """Per key: at most `max_concurrent` requests at once and `tokens_per_minute` tokens (prompt and
    completion); None is no limit. Each key's state is created on its first request."""

    def __init__(self, max_concurrent: int | None = None, tokens_per_minute: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        _validate_limit("max_concurrent_per_key", max_concurrent)
        _validate_limit("tokens_per_minute", tokens_per_minute)
        self.max_concurrent, self.tokens_per_minute, self.clock = max_concurrent, tokens_per_minute, clock
        self.running: dict[str, int] = {}
        self.buckets: dict[str, TokenBucket] = {}
        self.lock = threading.Lock()  # a release may come from a finalizer on another thread

    def _bucket(self, key: str) -> TokenBucket | None:
        if self.tokens_per_minute is None:
            return None
        if key not in self.buckets:
            self.buckets[key] = TokenBucket(self.tokens_per_minute, self.clock)
        return self.buckets[key]

    def enter(self, key: str) -> Callable[[], None]:
        """Count a request of `key` (429 past a limit); returns its release, safe to call more than once."""
        with self.lock:
            running = self.running.get(key, 0)
            if self.max_concurrent is not None and running >= self.max_concurrent:
                raise too_many(f"this API key has {running} requests in flight, its limit; retry when one ends", 1)
            bucket = self._bucket(key)
            wait = bucket.wait() if bucket else 0.0
            if wait > 0:
                raise too_many(f"this API key used its {self.tokens_per_minute} tokens per minute; "
                               f"retry in {math.ceil(wait)} s", wait)
            self.running[key] = running + 1
        released = []

        def release() -> None:
            with self.lock:
                if not released:
                    released.append(True)
                    self.running[key] -= 1
                    if not self.running[key]:
                        del self.running[key]
        return release

    def charge(self, key: str, tokens: int) -> None:
        """Take `tokens` from the key's bucket (no-op without a token limit)."""
        with self.lock:
            bucket = self._bucket(key)
            if bucket:
                bucket.charge(tokens)


# ---------------------------------------------------------------- metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector:
    """Gauges and counters read from the engine when /metrics is scraped (plain reads of ints and lengths,
    safe while the engine thread steps). The prefix cache is two counters since the start, hits and queries
    (in full prompt blocks), as vLLM's: a hit rate over any window is PromQL's `rate(hits) / rate(queries)`,
    where a ratio since the start, exported as a gauge, would say less and less about the present."""

    def __init__(self, engine, in_flight):
        self.engine, self.in_flight = engine, in_flight

    def collect(self):
        sched, manager = self.engine.scheduler, self.engine.manager
        used = manager.num_blocks - manager.num_free_blocks
        for name, doc, value in (
                ("minillm_running_sequences", "Sequences in the running batch", len(sched.running)),
                ("minillm_waiting_sequences", "Sequences waiting for KV blocks or a batch slot", len(sched.waiting)),
                ("minillm_kv_blocks_used", "KV cache blocks in use", used),
                ("minillm_kv_blocks_free", "KV cache blocks free", manager.num_free_blocks),
                ("minillm_kv_cache_usage_ratio", "KV cache blocks in use, of all blocks (0 to 1)",
                 used / manager.num_blocks),
                ("minillm_requests_in_flight", "HTTP requests between arrival and end", self.in_flight.count)):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("minillm_preemptions", "Sequences preempted for lack of KV blocks",
                                  value=sched.num_preemptions)
        yield CounterMetricFamily("minillm_prefix_cache_hits", "Full prompt blocks found in the prefix cache",
                                  value=manager.hits)
        yield CounterMetricFamily("minillm_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache",
                                  value=manager.queries)


class WithoutCreated:
    """A registry's metric families less their `_created` samples. prometheus-client adds to every counter
    and histogram the time it was created, which the text format writes as a second family (`..._created`,
    a gauge) per metric; Prometheus does not read it. Filtered per registry: the library's own switch,
    disable_created_metrics(), is one for the whole process."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():  # fresh objects on each scrape: safe to trim
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (two apps in one process do not mix).
    The histograms count generation requests only (chat and text completions that passed their checks):
    GET /v1/models or a 400 would otherwise pull the latencies down."""

    def __init__(self, engine, in_flight):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("minillm_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=r)
        self.finished = Counter("minillm_choices_finished", "Choices ended, by the finish_reason the client got",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("minillm_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("minillm_generation_tokens", "Tokens generated", registry=r)
        self.queue_time = Histogram("minillm_queue_time_seconds", "From a generation request's arrival to the "
                                    "start of its prefill (waiting for a batch slot and KV blocks)",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minillm_inter_token_latency_seconds", "Between two tokens of one choice",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("minillm_request_latency_seconds", "From a generation request's arrival to its end",
                                 buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(engine, in_flight))

    def response(self) -> Response:
        """The body of GET /metrics: Prometheus' text format, without the `_created` series."""
        return Response(generate_latest(WithoutCreated(self.registry)), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------- one request, its record


class RequestRecord:
    """One request from arrival to end: its key id, tokens, latencies and finish reasons.

    `output` notes each engine Output of choice `index`; `started` the start of its prefill (from the
    engine thread); `end` (the first call counts, later ones change nothing) runs the releases, charges
    the completion to the key, updates the metrics and writes the access-log line. The status is 499
    (client closed) until the handler sets another. `finish` holds the finish_reason each choice got:
    the engine's, which the server overwrites where the client saw another ("tool_calls")."""

    def __init__(self, path: str, metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic):
        self.path, self.metrics, self.clock = path, metrics, clock
        self.id, self.key, self.status, self.generating = "req-" + uuid.uuid4().hex[:24], "-", 499, False
        self.start, self.first, self.last = clock(), None, {}
        self.prompt_tokens = self.completion_tokens = 0
        self.finish: dict[int, str] = {}
        self.releases: list[Callable[[], None]] = []
        self.charge: Callable[[int], None] = lambda tokens: None
        self.lock, self.ended = threading.Lock(), False

    def begin(self, answer_id: str, prompt_tokens: int) -> None:
        """The request was parsed: its answer's id, and its prompt, charged to the key now."""
        self.id, self.prompt_tokens, self.generating = answer_id, prompt_tokens, True
        self.charge(prompt_tokens)

    def started(self, when: float) -> None:
        """Its prefill began at `when` (this record's clock): the end of its queue time."""
        if self.metrics:
            self.metrics.queue_time.observe(max(0.0, when - self.start))

    def output(self, index: int, out) -> None:
        now = self.clock()
        if out.token_id is not None:
            self.completion_tokens += 1
            if self.metrics and self.first is None:
                self.metrics.ttft.observe(now - self.start)
            elif self.metrics and index in self.last:
                self.metrics.itl.observe(now - self.last[index])
            self.first = self.first or now
            self.last[index] = now
        if out.finished:
            self.finish[index] = out.finish_reason

    def end(self, status: int | None = None) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
        self.status = status if status is not None else self.status
        for release in self.releases:
            release()
        self.charge(self.completion_tokens)
        now = self.clock()
        if self.metrics:
            self._count(now)
        ACCESS_LOG.info(json.dumps(self.log_line(now)))

    def _count(self, now: float) -> None:
        m = self.metrics
        m.requests.labels(self.path, str(self.status)).inc()
        if self.generating:  # not GET /v1/models, /tokenize, or a request refused before it began
            m.latency.observe(now - self.start)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.completion_tokens)
        for reason in self.finish.values():
            m.finished.labels(reason).inc()

    def log_line(self, now: float) -> dict:
        """The access-log entry: what happened, never the key or the text."""
        ms = lambda t: None if t is None else round((t - self.start) * 1000, 1)
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "id": self.id, "key": self.key,
                "path": self.path, "status": self.status, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "finish_reasons": [self.finish.get(i) for i in range(max(self.finish, default=-1) + 1)],
                "ttft_ms": ms(self.first), "latency_ms": ms(now)}


class Gate:
    """Who may start a request, in this order: not while the server drains (503), a valid key (401),
    the key's own limits (429), the server's in-flight limit (429). `admit` returns the request's
    record, holding the releases its `end` will run."""

    def __init__(self, keys: APIKeys, limits: KeyLimits, in_flight, metrics: Metrics | None = None):
        self.keys, self.limits, self.in_flight, self.metrics = keys, limits, in_flight, metrics
        self.draining = False

    def admit(self, request: Request, limited: bool = True) -> RequestRecord:
        record = RequestRecord(request.url.path, self.metrics)
        try:
            if self.draining:
                raise Refusal(503, "the server is shutting down; send the request again (to another replica)",
                              "shutting_down", {"Retry-After": "1"})
            record.key = key = self.keys.identify(request.headers.get("authorization"))
            if limited:
                record.releases.append(self.limits.enter(key))
                record.charge = lambda tokens: self.limits.charge(key, tokens)
                record.releases.append(self.in_flight.enter())
        except Exception as exc:  # a refusal (or the in-flight count's 429): counted and logged, then answered
            record.end(getattr(exc, "status", 500))
            raise
        return record


def schema_pages(keys: APIKeys) -> dict:
    """FastAPI's keywords for its schema pages (/docs, /redoc, /openapi.json): on without keys, off (404)
    with keys, so that only /health and /metrics answer without one. Off rather than behind the key:
    Swagger UI's page fetches /openapi.json without an Authorization header, so it could not work anyway."""
    return {"docs_url": None, "redoc_url": None, "openapi_url": None} if keys.digests else {}


# ---------------------------------------------------------------- the process


def validate_seconds(name: str, value, none_ok: bool = False) -> float | None:
    """A duration setting: a finite number of seconds >= 0 (or None, where that means no limit)."""
    if value is None and none_ok:
        return None
    if not is_number(value) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a number of seconds >= 0{' or None' if none_ok else ''}, got {value!r}")
    return float(value)


def configure_access_log(path: str | None = "-") -> None:
    """Send the access log (one JSON line per request) to `path`: "-" is stderr, None turns it off."""
    ACCESS_LOG.handlers.clear()
    ACCESS_LOG.propagate = False
    if path is None:
        ACCESS_LOG.disabled = True
        return
    ACCESS_LOG.disabled = False
    handler = logging.StreamHandler() if path == "-" else logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.setLevel(logging.INFO)


class GracefulServer(uvicorn.Server):
    """uvicorn with a drain. On SIGTERM or Ctrl-C (or `should_exit`): close the listening socket (new
    connections are refused), run `drain` (the app's: 503 for new requests on open connections, the
    running ones get their grace period, the rest end), then uvicorn's own shutdown. A second
    Ctrl-C skips the rest of the grace period. The process then exits normally, status 0."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], object]):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting
        task = asyncio.ensure_future(self.drain())
        while not task.done() and not self.force_exit:
            await asyncio.sleep(0.05)
        if not task.done():
            task.cancel()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled by the drain: do not re-raise it (that would exit 143)


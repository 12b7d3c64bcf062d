"""A vLLM server's own ``/metrics``, read beside its KV events (``--attach-metrics URL``).

Why read it at all: a KV-event stream says what a server cached, never how often a prompt hit it or how full the
pool is. The server's Prometheus figures say exactly that, so the explorer shows both and notices when they cannot
both be true (:mod:`kvstream.metrics.compare`).

What comes over the wire is checked for meaning before anything shows it, and the reader is bounded: a connect and
read timeout, a whole-answer deadline, a size limit, at most :data:`MAX_ENGINES` engines. A server that answers
garbage, the wrong content, impossible numbers or nothing at all becomes one line in :meth:`MetricsReader.status`;
the thread never dies of it and keeps the last good reading. Parsing is prometheus_client's own parser.
"""
from __future__ import annotations

import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import kvstream.metrics.names as names

MAX_BYTES = 8 << 20  # a vLLM server's /metrics is about 60 KB idle, a few hundred with many adapters and engines
TIMEOUT_S = 3.0  # connect and each read; the whole answer gets as long again at most (see fetch_text)
INTERVAL_S = 1.0  # one reading a second: the dock and --json's lines come about once a second
MAX_ENGINES = 256  # data-parallel engines one server reports (a label from outside must not grow without bound)
_ACCEPTED_TYPES = ("text/plain", "application/openmetrics-text")
_USAGE_SLACK = 1e-6  # a usage a float's rounding put a hair past 1


class MetricsError(ValueError):
    """A /metrics answer that cannot be used; the message is the one line the user sees."""


def check_url(url: str) -> str:
    """``http(s)://host[:port][/path]``; a bare server address gets vLLM's ``/metrics`` path. MetricsError else."""
    if not isinstance(url, str) or not url.strip():
        raise MetricsError("--attach-metrics needs a URL such as http://localhost:8000/metrics")
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MetricsError(f"--attach-metrics {url}: give an http:// or https:// URL with a host, such as "
                           "http://localhost:8000/metrics")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise MetricsError(f"--attach-metrics {url}: the port must be 1-65535")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


@dataclass(frozen=True)
class EngineReading:
    """One engine's figures in one reading (vLLM labels every series with its engine index)."""

    engine: str  # the "engine" label ("0" for one engine)
    model_name: str  # the served model's name ("" when the server does not say)
    usage: float | None  # vllm:kv_cache_usage_perc, 0..1: blocks held by requests over the pool
    running: int | None  # vllm:num_requests_running
    waiting: int | None  # vllm:num_requests_waiting
    queries: float | None  # vllm:prefix_cache_queries_total: prompt tokens looked up, since the server started
    hits: float | None  # vllm:prefix_cache_hits_total: of those, tokens found in the device prefix cache
    num_gpu_blocks: int | None  # cache_config_info's label: blocks in the pool (vLLM's null block included)
    block_size: int | None  # cache_config_info's label: tokens per block
    prefix_caching: bool | None  # cache_config_info's enable_prefix_caching

    @property
    def hit_rate(self) -> float | None:
        """Share of queried prompt tokens that hit, since the server started (None before any query)."""
        if self.queries is None or self.hits is None or self.queries <= 0:
            return None
        return self.hits / self.queries

    @property
    def used_blocks(self) -> float | None:
        """Blocks held by requests, from the usage: vLLM divides by the pool less its null block."""
        if self.usage is None or not self.num_gpu_blocks:
            return None
        return self.usage * max(1, self.num_gpu_blocks - 1)


@dataclass(frozen=True)
class ServerReading:
    """Everything one answer of a server's /metrics said that the explorer uses."""

    url: str
    at: float  # time.monotonic() when it was read
    engines: tuple[EngineReading, ...]  # by engine label

    def engine(self, label: str) -> EngineReading | None:
        return next((e for e in self.engines if e.engine == label), None)


@dataclass(frozen=True)
class ReaderStatus:
    """How the reader is doing, for the status line and --json."""

    state: str  # "connecting" (nothing read yet), "ok", "error" (the last try failed; the last good reading stays)
    text: str  # one line: what it read, or what went wrong
    num_readings: int = 0  # good readings so far
    num_failures: int = 0  # tries that failed
    num_restarts: int = 0  # times the server's counters went back (it restarted)
    last_error: str | None = None


def parse_metrics(text: str, url: str = "", at: float | None = None) -> ServerReading:
    """The figures of one /metrics answer; MetricsError when it is not Prometheus text, holds none of vLLM's
    cache figures, or says something impossible (a usage past 100%, more hits than queries, a negative count)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on a line it cannot read
        raise MetricsError(f"not Prometheus' text format ({_short(exc)})") from None
    wanted = {names.KV_CACHE_USAGE: "usage", names.NUM_REQUESTS_RUNNING: "running",
              names.NUM_REQUESTS_WAITING: "waiting", names.PREFIX_CACHE_QUERIES: "queries",
              names.PREFIX_CACHE_HITS: "hits", names.CACHE_CONFIG_INFO: "config"}
    found: dict[str, dict[str, object]] = {}  # engine -> field -> value
    models: dict[str, str] = {}
    seen = set()
    for family in families:
        key = wanted.get(family.name)
        if key is None:
            continue
        seen.add(key)
        for sample in family.samples:
            if key in ("queries", "hits") and not sample.name.endswith("_total"):
                continue  # a counter's _created sample
            engine = sample.labels.get("engine", "")
            if engine not in found and len(found) >= MAX_ENGINES:
                raise MetricsError(f"more than {MAX_ENGINES} engines in one answer")
            values = found.setdefault(engine, {})
            if key == "config":
                values["config"] = sample.labels
            else:
                values[key] = _checked(key, sample.value, engine)
                if "model_name" in sample.labels:
                    models.setdefault(engine, sample.labels["model_name"])
    if not {"usage", "queries", "hits"} <= seen:
        missing = ", ".join(n for n, k in wanted.items() if k in ("usage", "queries", "hits") and k not in seen)
        raise MetricsError(f"no vLLM cache metrics ({missing} missing): is this a vLLM server's /metrics?")
    engines = []
    for engine, values in sorted(found.items()):
        config = values.get("config") or {}
        queries, hits = values.get("queries"), values.get("hits")
        if queries is not None and hits is not None and hits > queries:
            raise MetricsError(f"engine {engine}: {hits:g} prefix-cache hits of {queries:g} queries")
        engines.append(EngineReading(
            engine=engine, model_name=models.get(engine, ""), usage=values.get("usage"),
            running=_count(values.get("running")), waiting=_count(values.get("waiting")), queries=queries, hits=hits,
            num_gpu_blocks=_label_int(config, "num_gpu_blocks", engine),
            block_size=_label_int(config, "block_size", engine),
            prefix_caching={"True": True, "False": False}.get(config.get("enable_prefix_caching"))))
    if not any(e.usage is not None for e in engines):
        raise MetricsError(f"{names.KV_CACHE_USAGE} has no value")
    return ServerReading(url=url, at=time.monotonic() if at is None else at, engines=tuple(engines))


def _checked(key: str, value: float, engine: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise MetricsError(f"engine {engine}: {key} is {float(value):g}")
    if key == "usage" and value > 1 + _USAGE_SLACK:
        raise MetricsError(f"engine {engine}: {names.KV_CACHE_USAGE} is {value:g}, past 1 (100%)")
    if key in ("running", "waiting") and value != int(value):
        raise MetricsError(f"engine {engine}: {key} requests is {value:g}, not a whole number")
    return min(value, 1.0) if key == "usage" else value


def _count(value) -> int | None:
    return None if value is None else int(value)


def _label_int(labels: dict, name: str, engine: str) -> int | None:
    text = labels.get(name)
    if text in (None, "None", ""):
        return None
    try:
        value = int(text)
    except ValueError:
        raise MetricsError(f"engine {engine}: cache_config_info {name}={text[:40]!r} is not a number") from None
    if value <= 0 or value > 1 << 40:
        raise MetricsError(f"engine {engine}: cache_config_info {name}={value} is out of range")
    return value


def _short(exc: BaseException, limit: int = 120) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def fetch_text(url: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> str:
    """The body of ``url`` as text, or MetricsError. Each socket operation waits at most ``timeout_s``, and the
    body is read in pieces until a deadline ``timeout_s`` after the answer began: a server that trickles its answer
    takes at most about twice ``timeout_s`` in all. Past ``max_bytes`` the answer is refused, not read on."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
                                                   "User-Agent": "paged-kv-explorer"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            deadline = time.monotonic() + timeout_s
            kind = answer.headers.get_content_type()
            if kind not in _ACCEPTED_TYPES:
                raise MetricsError(f"answered {kind}, not Prometheus text")
            length = answer.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise MetricsError(f"answer of {int(length):,} bytes, over the {max_bytes:,}-byte limit")
            pieces, size = [], 0
            while True:
                piece = answer.read1(64 << 10)
                if not piece:
                    break
                size += len(piece)
                if size > max_bytes:
                    raise MetricsError(f"answer over the {max_bytes:,}-byte limit")
                pieces.append(piece)
                if time.monotonic() > deadline:
                    raise MetricsError(f"answer not complete after {timeout_s:g} s")
            charset = answer.headers.get_content_charset() or "utf-8"
    except MetricsError:
        raise
    except urllib.error.HTTPError as exc:
        raise MetricsError(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise MetricsError(f"no answer within {timeout_s:g} s") from None
        raise MetricsError(f"cannot connect ({_short(exc.reason)})") from None
    except TimeoutError:
        raise MetricsError(f"no answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise MetricsError(f"connection failed ({_short(exc)})") from None
    except Exception as exc:  # http.client's own (a malformed status line, bad chunking, ...)
        raise MetricsError(f"not a usable HTTP answer ({_short(exc)})") from None
    try:
        return b"".join(pieces).decode(charset)
    except (UnicodeDecodeError, LookupError) as exc:
        raise MetricsError(f"answer is not {charset} text ({_short(exc)})") from None


@dataclass
class _State:
    latest: ServerReading | None = None
    previous: ServerReading | None = None
    status: ReaderStatus = field(default_factory=lambda: ReaderStatus("connecting", "connecting"))


class MetricsReader:
    """Reads a server's /metrics every ``interval_s`` on a thread of its own; :attr:`latest` and
    :attr:`previous` are the two newest good readings (the interval between them gives rates), :meth:`status`
    says how it goes in one line. A counter that went back means the server restarted: the older reading is
    dropped, so no rate spans two lives of the server."""

    def __init__(self, url: str, interval_s: float = INTERVAL_S, timeout_s: float = TIMEOUT_S,
                 max_bytes: int = MAX_BYTES):
        self.url = check_url(url)
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._state = _State()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_reading = None  # called as on_reading(latest, previous) on the reader's thread after a good reading
        self.version = 0  # bumped by every try, good or not (readers redraw when it moves)

    def start(self) -> "MetricsReader":
        self._thread = threading.Thread(target=self._run, name=f"metrics reader {self.url}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Stop reading; waits at most ``timeout`` for the thread (closing the window must not wait on a server
        that does not answer: a daemon thread in a fetch ends by itself within its timeouts)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def latest(self) -> ServerReading | None:
        with self._lock:
            return self._state.latest

    @property
    def previous(self) -> ServerReading | None:
        with self._lock:
            return self._state.previous

    def readings(self) -> tuple[ServerReading | None, ServerReading | None]:
        """(latest, previous), taken together."""
        with self._lock:
            return self._state.latest, self._state.previous

    def status(self) -> ReaderStatus:
        with self._lock:
            return self._state.status

    def read_once(self) -> None:
        """One try: fetch, parse, check, keep (or say why not). Never raises."""
        try:
            reading = parse_metrics(fetch_text(self.url, self.timeout_s, self.max_bytes), self.url)
        except MetricsError as exc:
            self._failed(str(exc))
        except Exception as exc:  # anything else is a defect of ours, said the same way: the thread goes on
            self._failed(f"unexpected {_short(exc)}")
        else:
            latest, previous = self._keep(reading)
            if self.on_reading is not None:
                try:
                    self.on_reading(latest, previous)
                except Exception as exc:  # a defect of the comparison must not stop the reading
                    self._failed(f"comparing the reading failed: {_short(exc)}")
        self.version += 1

    def _keep(self, reading: ServerReading) -> tuple[ServerReading, ServerReading | None]:
        with self._lock:
            state, old = self._state, self._state.status
            restarted = state.latest is not None and _went_back(state.latest, reading)
            state.previous = None if restarted else state.latest
            state.latest = reading
            restarts = old.num_restarts + restarted
            text = _describe(reading) + (" (the server restarted: its counters went back)" if restarted else "")
            state.status = ReaderStatus("ok", text, old.num_readings + 1, old.num_failures, restarts, None)
            return state.latest, state.previous

    def _failed(self, message: str) -> None:
        with self._lock:
            old = self._state.status
            kept = " (showing the last good reading)" if self._state.latest is not None else ""
            self._state.status = ReaderStatus("error", f"{self.url}: {message}{kept}", old.num_readings,
                                              old.num_failures + 1, old.num_restarts, message)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read_once()
            self._stop.wait(self.interval_s)


def _went_back(before: ServerReading, after: ServerReading) -> bool:
    for engine in after.engines:
        old = before.engine(engine.engine)
        if old is None:
            continue
        for a, b in ((old.queries, engine.queries), (old.hits, engine.hits)):
            if a is not None and b is not None and b < a:
                return True
    return False


def _describe(reading: ServerReading) -> str:
    parts = []
    for e in reading.engines:
        rate = "no prompt yet" if e.hit_rate is None else f"prefix-cache hit rate {100 * e.hit_rate:.1f}%"
        usage = "usage unknown" if e.usage is None else f"KV usage {100 * e.usage:.1f}%"
        parts.append((f"engine {e.engine}: " if len(reading.engines) > 1 else "") + f"{usage}, {rate}")
    return "server metrics: " + "; ".join(parts)

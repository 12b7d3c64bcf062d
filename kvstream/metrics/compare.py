"""A server's own figures beside what its KV events say, and where the two cannot both be true.

The two sources answer different questions. The server's /metrics says how often prompts hit its prefix cache and
how many blocks its requests hold; its KV events say which blocks hold cached content. Neither gives the other's
figure, so they are shown side by side; but some combinations are impossible, and those are said, because each
means the explorer's picture of the server is wrong (events lost or missing, another server's stream):

- the events' block size is not the server's;
- the events hold more GPU blocks than the server's pool has;
- the server's requests hold more blocks than the events' cached blocks plus one partial block per running request
  (with prefix caching on, vLLM hashes every full block of a running request when it allocates it, and every
  hashed block is a BlockStored);
- prompts hit the prefix cache while the events held no GPU block at the reading before and at this one.

Each is judged at the moment a reading arrives, on the reader's thread, against the index as it is then; the
third must hold at two readings in a row (a reading may fall between a step's metrics and its events).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Sequence

from .reader import EngineReading, MetricsReader, ServerReading

_SLACK_BLOCKS = 2  # blocks the usage check forgives besides a partial block per running request
_MISSING = "events are missing (the explorer joined without a replay, events were lost, or they come from another " \
           "server)"


@dataclass(frozen=True)
class EngineComparison:
    """One engine's own figures next to its KV events' (None where a side cannot say)."""

    engine: str  # the server's engine label
    instance: str  # the KV-event instance it was paired with ("" if none)
    hit_rate: float | None  # the server's prefix-cache hit rate since it started, 0..1
    recent_hit_rate: float | None  # the same over the interval since the reading before
    recent_queries: float | None  # prompt tokens looked up in that interval
    recent_hits: float | None  # of those, tokens that hit
    usage: float | None  # the server's KV usage, 0..1
    used_blocks: float | None  # blocks its requests hold (usage times the pool)
    num_gpu_blocks: int | None  # its pool, from cache_config_info
    running: int | None  # its running requests
    events_gpu_blocks: int | None  # GPU blocks holding cached content, by the KV events
    events_cached_share: float | None  # those over the server's pool, 0..1
    events_stored: int | None  # new blocks the events stored in the interval (computed there, so not hits)
    events_removed: int | None  # blocks the events removed in the interval
    disagreements: tuple[str, ...] = ()  # what cannot be true of both, in words

    def lines(self) -> list[str]:
        """The dock's words: the server's figure, then the events'."""
        def pct(value):
            return "-" if value is None else f"{100 * value:.1f}%"
        hit = f"server: {pct(self.hit_rate)} of prompt tokens hit the prefix cache"
        if self.recent_hit_rate is not None:
            hit += f" ({pct(self.recent_hit_rate)} of {self.recent_queries:,.0f} in the last reading's interval)"
        usage = f"server: KV usage {pct(self.usage)}"
        if self.used_blocks is not None:
            usage += f" ({self.used_blocks:,.0f} of {self.num_gpu_blocks:,} blocks held by requests)"
        if self.events_gpu_blocks is None:
            events = "KV events: none paired with this engine"
        else:
            share = f", {pct(self.events_cached_share)} of the pool" if self.events_cached_share is not None else ""
            events = f"KV events: {self.events_gpu_blocks:,} GPU blocks hold cached prefixes{share}"
            if self.events_stored is not None:
                events += f"; {self.events_stored:,} stored (computed), {self.events_removed:,} removed since"
        return [hit, usage, events] + [f"disagree: {d}" for d in self.disagreements]

    def as_json(self) -> dict:
        out = asdict(self)
        out["disagreements"] = list(self.disagreements)
        return out


class _Seen:
    """What one engine's comparison remembers from the reading before."""

    def __init__(self):
        self.stored_total: int | None = None
        self.removed_total: int | None = None
        self.events_gpu: int | None = None
        self.over_usage = 0  # readings in a row where the usage check failed


class ServerWatch:
    """A :class:`MetricsReader` on a server's /metrics, paired with the KV-event indexes of the same server
    (index i with engine "i"; one index and one engine are paired whatever the label). Each good reading is
    compared on the reader's thread; :meth:`comparisons` is the newest result."""

    def __init__(self, url: str, indexes: Sequence = (), **reader_options):
        self.indexes = list(indexes)  # kvstream.kv_events.KVCacheIndex per instance (thread-safe)
        self.reader = MetricsReader(url, **reader_options)
        self.reader.on_reading = self._compare
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._comparisons: tuple[EngineComparison, ...] = ()

    @property
    def url(self) -> str:
        return self.reader.url

    def start(self) -> "ServerWatch":
        self.reader.start()
        return self

    def stop(self) -> None:
        self.reader.stop()

    def status(self):
        return self.reader.status()

    def comparisons(self) -> tuple[EngineComparison, ...]:
        with self._lock:
            return self._comparisons

    def _index_for(self, reading: ServerReading, engine: EngineReading):
        if len(reading.engines) == 1 and len(self.indexes) == 1:
            return self.indexes[0]
        if engine.engine.isdigit() and int(engine.engine) < len(self.indexes):
            return self.indexes[int(engine.engine)]
        return None

    def _compare(self, reading: ServerReading, previous: ServerReading | None) -> None:
        out = []
        for engine in reading.engines:
            seen = self._seen.setdefault(engine.engine, _Seen())
            before = previous.engine(engine.engine) if previous is not None else None
            out.append(compare_engine(engine, before, self._index_for(reading, engine), seen))
        with self._lock:
            self._comparisons = tuple(out)


def _delta(now, before):
    if now is None or before is None:
        return None
    return now - before


def compare_engine(engine: EngineReading, before: EngineReading | None, index, seen: _Seen) -> EngineComparison:
    """One engine's comparison; ``seen`` carries what the reading before left (updated here)."""
    recent_queries = _delta(engine.queries, before.queries if before else None)
    recent_hits = _delta(engine.hits, before.hits if before else None)
    recent_rate = recent_hits / recent_queries if recent_queries and recent_hits is not None else None
    gpu = share = stored = removed = None
    disagree = []
    if index is not None:
        with index._lock:  # one moment of the index for every figure taken from it
            by_medium = index.stored_hashes_by_medium()
            gpu = int(by_medium.get("GPU", 0))
            groups = max(1, len(index.stored_hashes_by_group()))
            stored_total, removed_total = index.num_stored_total, index.num_removed_total
            events_block_size = index.block_size
            instance = index.name
        stored = _delta(stored_total, seen.stored_total)
        removed = _delta(removed_total, seen.removed_total)
        if engine.num_gpu_blocks:
            share = min(1.0, gpu / max(1, engine.num_gpu_blocks - 1))
        if events_block_size and engine.block_size and events_block_size != engine.block_size:
            disagree.append(f"the KV events' blocks hold {events_block_size} tokens, the server's "
                            f"{engine.block_size}: the events come from another server")
        if engine.num_gpu_blocks and gpu > engine.num_gpu_blocks:
            disagree.append(f"the KV events hold {gpu:,} blocks on the GPU, more than the server's pool of "
                            f"{engine.num_gpu_blocks:,}: removals were lost")
        used = engine.used_blocks
        caching = engine.prefix_caching is not False
        bound = (gpu + (engine.running or 0) + _SLACK_BLOCKS) * groups
        if caching and used is not None and used > bound + 0.5:
            seen.over_usage += 1
        else:
            seen.over_usage = 0
        if seen.over_usage >= 2:
            disagree.append(f"the server's requests hold about {used:,.0f} blocks, but its KV events show only "
                            f"{gpu:,} cached on the GPU: {_MISSING}")
        if caching and recent_hits and gpu == 0 and seen.events_gpu == 0:
            disagree.append(f"prompts hit {recent_hits:,.0f} cached tokens since the reading before, but the KV "
                            f"events held no block on the GPU: {_MISSING}")
        seen.stored_total, seen.removed_total, seen.events_gpu = stored_total, removed_total, gpu
    else:
        instance = ""
    return EngineComparison(
        engine=engine.engine, instance=instance, hit_rate=engine.hit_rate, recent_hit_rate=recent_rate,
        recent_queries=recent_queries, recent_hits=recent_hits, usage=engine.usage, used_blocks=engine.used_blocks,
        num_gpu_blocks=engine.num_gpu_blocks, running=engine.running, events_gpu_blocks=gpu,
        events_cached_share=share, events_stored=stored, events_removed=removed, disagreements=tuple(disagree))


def server_json(watch: ServerWatch, index=None) -> dict:
    """The ``server_metrics`` object a KV-event source's ``--json`` line carries with ``--attach-metrics``: the
    reader's state and line, and the comparison of the engine paired with ``index`` (its figures null until one
    was read)."""
    status = watch.status()
    out = {"url": watch.url, "state": status.state, "status": status.text, "readings": status.num_readings,
           "failures": status.num_failures, "restarts": status.num_restarts}
    name = getattr(index, "name", None)
    comparisons = watch.comparisons()
    match = next((c for c in comparisons if c.instance == name), None) if name is not None else None
    if match is None and len(comparisons) == 1 and index is None:
        match = comparisons[0]
    fields = [f for f in EngineComparison.__dataclass_fields__ if f != "instance"]
    out.update(match.as_json() if match is not None else dict.fromkeys(fields))
    out.pop("instance", None)
    if match is None:
        out["disagreements"] = []
    return out

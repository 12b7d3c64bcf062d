"""A vLLM/SGLang KV-event stream as a feed (``--attach-kv-events``): content, not a physical pool.

The stream names block hashes, their parents and tokens, never physical block ids, so this feed has no pool view
(``has_physical_pool`` False: the pane shows the content view instead of a grid, and says why). One kvstream
KVEventSubscriber follows every endpoint given (one KVCacheIndex per instance). Qt-free; the window builds the
ContentView from :attr:`KVEventFeed.subscriber`.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

from .feed import Capabilities, Feed, Problem, done_future

KV_EVENTS_READ_ONLY = "a KV-event stream only reports what a server cached; it takes no commands"


class KVEventFeed(Feed):
    """Follows KV-event endpoints; its views are the content indexes, its summaries one per instance."""

    kind = "kv-events"
    capabilities = Capabilities.watched(KV_EVENTS_READ_ONLY, "a KV-event stream carries no K/V values", history=False,
                                        pool=False)

    def __init__(self, subscriber, tokenizer=None, server=None):
        self.subscriber = subscriber  # the KVEventSubscriber (started), owner of the sockets
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer for token text, or None
        self.server = server  # kvstream.metrics.ServerWatch on the same server's /metrics (--attach-metrics), or None
        self._reported_failure = False
        self._lost: dict[str, int] = {}  # instance label -> batches lost already reported

    @classmethod
    def connect(cls, endpoints: Sequence[str], tokenizer=None, metrics_url: str | None = None) -> "KVEventFeed":
        """Follow ``endpoints``; with ``metrics_url``, read that server's /metrics beside them."""
        from kvstream.kv_events import KVEventSubscriber
        subscriber = KVEventSubscriber(list(endpoints)).start()
        server = None
        if metrics_url:
            from kvstream.metrics import ServerWatch
            server = ServerWatch(metrics_url, subscriber.indexes).start()
        return cls(subscriber, tokenizer, server)

    @property
    def title(self) -> str:
        labels = [ep.label for ep in self.subscriber.endpoints]
        return "KV events: " + ", ".join(labels)

    @property
    def indexes(self):
        return self.subscriber.indexes

    def take_problems(self) -> list[Problem]:
        problems = []
        if self.subscriber.failure and not self._reported_failure:
            self._reported_failure = True
            problems.append(Problem("KV-event reader stopped", "The thread that follows the KV-event endpoints "
                                    "stopped; the view keeps what it had.", self.subscriber.failure))
        for status in self.subscriber.status():
            seen = self._lost.get(status.label, 0)
            if status.num_lost > seen:
                self._lost[status.label] = status.num_lost
                problems.append(Problem("KV events lost", f"{status.label}: {status.num_lost - seen} event "
                                        "batch(es) were lost beyond the publisher's replay buffer; the content view "
                                        "may miss blocks stored or removed then."))
        return problems

    def status_text(self) -> str:
        text = " · ".join(f"{s.label}: {s.text}" for s in self.subscriber.status())
        if self.server is not None:  # how the server's /metrics reads, in one line
            text += " · " + self.server.status().text
        return text

    def stream_counts(self) -> dict[str, int]:
        totals = {"instances": 0, "batches": 0, "cached": 0, "stored": 0, "removed": 0}
        for data in self.summaries():
            totals["instances"] += 1
            totals["batches"] += data["batches"]
            totals["cached"] += data["stored_hashes"]
            totals["stored"] += data["stored_total"]
            totals["removed"] += data["removed_total"]
        return totals

    def summaries(self, final: bool = False) -> list[dict]:
        from kvstream.kv_events import json_summary
        statuses = self.subscriber.status()  # malformed, lost, odd events and the last error go into --json too
        out = [json_summary(index, statuses[i] if i < len(statuses) else None)
               for i, index in enumerate(self.subscriber.indexes)]
        if self.server is not None:
            from kvstream.metrics.compare import server_json
            for data, index in zip(out, self.subscriber.indexes):
                data["server_metrics"] = server_json(self.server, index)
        return out

    def summary(self, final: bool = False) -> dict:
        return self.summaries(final)[0]

    def check_prompt(self, token_ids) -> Future:
        """Per instance: its blocks matched by the tokens the stream's BlockStored events carried."""
        try:
            return done_future([index.check_prompt(token_ids) for index in self.subscriber.indexes])
        except ValueError as exc:
            return done_future(error=exc)

    def prompt_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.subscriber.stop()

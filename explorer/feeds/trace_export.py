"""``--export-trace FILE``: the traffic a run saw, written as a Mooncake JSONL trace that ``engine.read_trace`` reads
back, so what a user recorded (their vLLM through the plugin, or the local engine) can be replayed at other pool
sizes and swept in the Capacity dock.

A request is one admission of a prompt: a conversation's first prompt, and each reply's longer one. Its line carries
when it was first seen (milliseconds from the first request), its prompt and output lengths in tokens, and one hash
id per 512 prompt tokens (the format's grain; the last id names a partial chunk, as in Mooncake's own traces). An id
names a chunk *with everything before it*, as the engine's chained block hashes do: two prompts share an id at a
position exactly when they share every token up to the end of that chunk. Ids are small integers handed out in the
order their prefixes first appear.

Where the time comes from: a live run reads the wall clock when its runner publishes a step (the observer runs on
the engine thread); a recording, which keeps no wall clock, adds up its steps' measured durations.

Qt-free; the exporter holds one 16-byte digest per distinct prefix chunk and one line per request, nothing else.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np

MOONCAKE_TOKENS_PER_ID = 512  # Mooncake's format: one hash id per 512 prompt tokens (engine.read_trace reads it so)


@dataclass
class ExportedRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)

    def line(self, start_s: float) -> str:
        return json.dumps({"timestamp": int(round(1000 * max(0.0, self.arrival_s - start_s))),
                           "input_length": self.input_length, "output_length": self.output_length,
                           "hash_ids": self.hash_ids}, separators=(", ", ": "))


class TraceExport:
    """Requests seen in pool views, in the order they first appeared; :meth:`write` makes the trace file.

    Feed it views with :meth:`see` (a recording's, with its own clock), or hand :meth:`observer` to an engine's
    runner. Each observer is one source: conversation ids of two engines (the window's engine after a restart) never
    mix. Thread-safe: the engine thread sees, another thread may write."""

    def __init__(self, tokens_per_id: int = MOONCAKE_TOKENS_PER_ID):
        self.tokens_per_id = tokens_per_id
        self.requests: list[ExportedRequest] = []
        self.skipped = 0  # admissions seen without their prompt's tokens (a KV-event source has none): not exported
        self._open: dict[tuple, ExportedRequest] = {}  # (source, conversation id, prompt length) -> its request
        self._ids: dict[bytes, int] = {}  # prefix chunk digest -> its small id
        self._lock = threading.Lock()
        self._sources = 0

    # ---- what a run sees ----------------------------------------------------------------------------------------
    def see(self, snapshot, now_s: float, source: int = 0) -> None:
        """Note the requests of one pool view taken at ``now_s`` seconds (any clock, the same for every view)."""
        with self._lock:
            for info in snapshot.conversations:
                prompt = info.prompt_token_ids
                key = (source, info.conversation_id, len(prompt))
                request = self._open.get(key)
                if request is None:
                    if not prompt:
                        self.skipped += 1
                        self._open[key] = ExportedRequest(now_s, 0, 0)  # said once, never written
                        continue
                    request = ExportedRequest(now_s, len(prompt), 0, self._hash_ids(prompt))
                    self._open[key] = request
                    self.requests.append(request)
                request.output_length = max(request.output_length, len(info.output_token_ids))

    def observer(self, clock=time.monotonic):
        """A runner observer (``update.snapshot`` on the engine thread) that sees every step of one engine."""
        with self._lock:
            self._sources += 1
            source = self._sources

        def observe(update) -> None:
            self.see(update.snapshot, clock(), source)
        return observe

    def see_recording(self, path: str) -> None:
        """Every frame of a recording (kvstream.recording, checked as it is read), on the clock of its steps'
        measured durations."""
        from kvstream.recording import read_snapshots
        elapsed, last_step = 0.0, None
        with self._lock:
            self._sources += 1
            source = self._sources
        for _seq, snapshot, _events in read_snapshots(path, truncated_ok=True):  # a cut file: what it holds
            step = snapshot.step_id
            if last_step is not None and step > last_step:
                elapsed += max(0.0, float(snapshot.metrics.last_step_seconds)) * (step - last_step)
            last_step = step
            self.see(snapshot, elapsed, source)

    def _hash_ids(self, prompt) -> list[int]:
        tokens = np.asarray(prompt, dtype=np.int64)
        parent = b""
        ids = []
        for start in range(0, len(tokens), self.tokens_per_id):
            digest = hashlib.blake2b(parent + tokens[start:start + self.tokens_per_id].tobytes(),
                                     digest_size=16).digest()
            ids.append(self._ids.setdefault(digest, len(self._ids)))
            parent = digest
        return ids

    # ---- the file -----------------------------------------------------------------------------------------------
    def lines(self) -> list[str]:
        with self._lock:
            requests = sorted(self.requests, key=lambda r: r.arrival_s)  # stable: same-frame requests keep id order
        start = requests[0].arrival_s if requests else 0.0
        return [r.line(start) for r in requests]

    def write(self, path: str) -> int:
        """Write the trace (whole, or not at all: a temporary file renamed over ``path``); returns its requests.
        Raises OSError when it cannot be written."""
        lines = self.lines()
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".jsonl", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write("".join(line + "\n" for line in lines))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return len(lines)

    def summary(self, path: str, written: int) -> str:
        text = f"exported {written:,} requests to {path} (Mooncake JSONL)"
        if self.skipped:
            text += f"; {self.skipped:,} without their prompt's tokens left out"
        if not written:
            text += "; the run saw no request with a prompt, so the file is empty"
        return text


# ---- the end of a run with --export-trace (headless and the window) ---------------------------------------------
def write_for(exported: TraceExport, path: str, recording: str | None = None) -> bool:
    """Write ``path`` at the end of a run: the local engine's requests, or a recording's (``recording``: read from
    its file, every frame, whatever the run showed of it). One line on stderr either way; False when it could not
    be written."""
    from kvstream.recording import RecordingError
    try:
        if recording:
            exported.see_recording(recording)
        written = exported.write(path)
    except (OSError, RecordingError) as exc:
        print(f"error: --export-trace {path}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return False
    print(exported.summary(path, written), file=sys.stderr, flush=True)
    return True

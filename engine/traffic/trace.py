"""Public request traces: real traffic's shape as block hash ids, read and checked for meaning.

Two formats, told apart by content (never by the file name):

- Mooncake JSONL (kvcache-ai/Mooncake's FAST'25 traces): one request a line, ``timestamp`` (milliseconds from the
  trace's start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block of the
  prompt, the last usually partial).
- kv-cache-tester JSON (one agentic session a file): ``block_size``, and ``requests`` whose entries have ``t``
  (seconds), ``in``, ``out`` and ``hash_ids`` (one id per full block); an entry of ``type`` "subagent" has its own
  ``requests``, whose ``t`` counts from the sub-agent's start (its entry's ``t``) and which run beside the parent's.
  Sub-agents are flattened by absolute time, each request keeping the agent it came from.

Equal ids at the same position mean the same prefix up to and including that block (the traces' convention), so a
replay that turns each id into its own tokens reproduces the trace's sharing through ordinary chained prefix hashing.

Every reader failure is one :class:`TraceError` line that says where and what (an empty file, a cut line, text where
ids belong, negative lengths, ids that do not cover the prompt, a directory, a binary file), and nothing is read past
:data:`MAX_TRACE_BYTES`, so a hostile file cannot make the reader hang or grow without bound.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

import msgspec
import numpy as np

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces (its README)
MAX_TRACE_BYTES = 1 << 30  # larger files are refused (the shipped hour of Kimi is 3 MB)
MAX_REQUESTS = 10_000_000
MAX_BLOCK_SIZE = 1 << 20
MAX_ID = (1 << 63) - 1


class TraceError(ValueError):
    """A trace that cannot be read; the message is the one line the user sees."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds from the trace's start
    input_length: int  # prompt tokens
    output_length: int  # tokens the server generated
    hash_ids: tuple[int, ...]  # one id per block of the prompt (the last may be partial)
    agent: str = ""  # the kv-cache-tester sub-agent it came from ("" for the main session and Mooncake)

    def block_tokens(self, block_size: int) -> list[int]:
        """Prompt tokens each id stands for: ``block_size``, less for a partial last block."""
        return [max(1, min(block_size, self.input_length - i * block_size)) for i in range(len(self.hash_ids))]


@dataclass(frozen=True)
class Trace:
    """A whole trace: its requests in the order a replay admits them (Mooncake: file order; kv-cache-tester: the
    flattened session by arrival, file order for ties)."""

    path: str
    format: str  # "mooncake" | "kv-cache-tester"
    block_size: int  # tokens each hash id stands for
    requests: tuple[TraceRequest, ...]
    name: str = ""  # what the source calls itself (kv-cache-tester's "id"), else the file's name
    notes: tuple[str, ...] = field(default=())  # what the reader noticed and the user may want to know

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @cached_property
    def num_blocks(self) -> int:
        """Prompt blocks in all (ids, counted once per request that names them)."""
        return sum(len(r.hash_ids) for r in self.requests)

    @cached_property
    def num_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @cached_property
    def duration_s(self) -> float:
        return max((r.arrival_s for r in self.requests), default=0.0)

    @cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """(every request's ids end to end, int64; offsets: request i's ids are ids[offsets[i]:offsets[i + 1]])."""
        lengths = np.fromiter((len(r.hash_ids) for r in self.requests), np.int64, len(self.requests))
        offsets = np.zeros(len(self.requests) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((h for r in self.requests for h in r.hash_ids), np.int64, int(offsets[-1]))
        return ids, offsets

    @cached_property
    def nodes(self) -> tuple[np.ndarray, int]:
        """(a prefix-node id per block, the number of nodes): blocks share a node exactly when their ids and every
        id before them in their requests are equal, which is when a replay's chained hashes are equal."""
        ids, offsets = self.flat
        out = np.empty(len(ids), np.int64)
        table: dict[tuple[int, int], int] = {}
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            parent = -1
            for i in range(start, end):
                key = (parent, int(ids[i]))
                node = table.get(key)
                if node is None:
                    node = table[key] = len(table)
                out[i] = parent = node
        return out, len(table)

    def slice(self, start: int, stop: int | None = None) -> "Trace":
        """The requests from ``start`` to ``stop`` as a trace of their own (arrivals kept)."""
        return Trace(self.path, self.format, self.block_size, self.requests[start:stop], self.name, self.notes)


# ---- reading -----------------------------------------------------------------------------------------------------
class _Mooncake(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_trace(path: str) -> Trace:
    """Read a Mooncake JSONL or kv-cache-tester JSON trace, whichever the content is."""
    data = _read_bytes(path)
    head = data.lstrip()[:1]
    if head != b"{":
        raise TraceError(f"{path} is not a trace: a trace starts with a JSON object "
                         f"({'it is empty' if not data.strip() else 'this file does not'})")
    first_line = data.lstrip().split(b"\n", 1)[0]
    try:
        first = msgspec.json.decode(first_line)
    except msgspec.DecodeError:
        first = None
    if isinstance(first, dict) and "hash_ids" in first:
        return _read_mooncake(path, data)
    try:
        document = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path} is neither Mooncake JSONL (one request with hash_ids per line) nor a "
                         f"kv-cache-tester JSON document: {exc}") from None
    if isinstance(document, dict) and "requests" in document:
        return _read_tester(path, document)
    raise TraceError(f"{path} is neither Mooncake JSONL (each line a request with hash_ids) nor a kv-cache-tester "
                     f"session (an object with block_size and requests)")


def _read_bytes(path: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise TraceError("a trace file must be named")
    if os.path.isdir(path):
        raise TraceError(f"{path} is a folder; give a trace file (Mooncake .jsonl or kv-cache-tester .json)")
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise TraceError(f"{path} is not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TRACE_BYTES + 1)
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_TRACE_BYTES:
        raise TraceError(f"{path} is larger than {MAX_TRACE_BYTES >> 20} MiB; split it")
    if b"\x00" in data[:65536]:
        raise TraceError(f"{path} is a binary file, not a trace (traces are JSON text)")
    if not data.strip():
        raise TraceError(f"{path} is empty")
    return data


def _check_request(where: str, arrival: float, input_length, output_length, ids, block_size: int,
                   typed: bool = False) -> tuple[int, ...]:
    """The request's meaning: lengths, ids in range and covering the prompt (``typed``: msgspec already checked
    every field's type)."""
    if not np.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: the arrival time must be a number of 0 or more, got {arrival!r}")
    if not typed:
        for name, value in (("input length", input_length), ("output length", output_length)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TraceError(f"{where}: the {name} must be a whole number of 0 or more, got {value!r}")
        if not isinstance(ids, list):
            raise TraceError(f"{where}: hash_ids must be a list of whole numbers, got {type(ids).__name__}")
        if not all(type(h) is int for h in ids):  # JSON gives int, float, str, bool, None, list or dict
            bad = next(h for h in ids if type(h) is not int)
            raise TraceError(f"{where}: hash_ids must hold whole numbers, got {bad!r}")
    for name, value in (("input length", input_length), ("output length", output_length)):
        if value < 0:
            raise TraceError(f"{where}: the {name} must be a whole number of 0 or more, got {value!r}")
    if input_length < 1:
        raise TraceError(f"{where}: a request needs a prompt (input length 0)")
    if ids and not (0 <= min(ids) and max(ids) <= MAX_ID):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise TraceError(f"{where}: hash id {bad} is out of range (0 to 2^63 - 1)")
    full, covered = input_length // block_size, -(-input_length // block_size)
    if not full <= len(ids) <= covered:
        want = f"{full}" if full == covered else f"{full} or {covered}"
        raise TraceError(f"{where}: {len(ids)} hash ids for {input_length} prompt tokens; at {block_size} tokens per "
                         f"id that is {want} ids")
    if not ids:
        raise TraceError(f"{where}: the prompt ({input_length} tokens) is shorter than one {block_size}-token block, "
                         f"so it names no block")
    return tuple(ids)


def _read_mooncake(path: str, data: bytes) -> Trace:
    lines = data.split(b"\n")
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if len(numbered) > MAX_REQUESTS:
        raise TraceError(f"{path} has more than {MAX_REQUESTS:,} requests")
    try:  # every line at once (fast); on any error, line by line to say which line is wrong
        records = msgspec.json.decode(b"[" + b",".join(line for _, line in numbered) + b"]", type=list[_Mooncake])
    except (msgspec.ValidationError, msgspec.DecodeError):
        records = None
    decoder = msgspec.json.Decoder(_Mooncake)
    requests = []
    for i, (number, line) in enumerate(numbered):
        where = f"{path}, line {number}"
        if records is not None:
            record = records[i]
        else:
            try:
                record = decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise TraceError(f"{where}: {exc}") from None
            except msgspec.DecodeError as exc:
                cut = " (the line is cut short)" if number >= len(lines) - 1 else ""
                raise TraceError(f"{where} is not a JSON request{cut}: {exc}") from None
        ids = _check_request(where, float(record.timestamp), record.input_length, record.output_length,
                             record.hash_ids, MOONCAKE_BLOCK_SIZE, typed=True)
        requests.append(TraceRequest(record.timestamp / 1000.0, record.input_length, record.output_length, ids))
    if not requests:
        raise TraceError(f"{path} holds no requests")
    return _ordered(path, "mooncake", MOONCAKE_BLOCK_SIZE, requests, os.path.basename(path))


def _read_tester(path: str, document: dict) -> Trace:
    block_size = document.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise TraceError(f"{path}: block_size must be a whole number of tokens from 1 to {MAX_BLOCK_SIZE:,}, got "
                         f"{block_size!r}")
    requests: list[TraceRequest] = []
    notes = []
    scope = document.get("hash_id_scope")
    if scope not in (None, "local"):
        notes.append(f"hash_id_scope {scope!r}: ids are matched within this file only")
    _walk_tester(path, document.get("requests"), 0.0, "", "requests", block_size, requests, depth=0)
    if not requests:
        raise TraceError(f"{path} holds no requests")
    name = document.get("id") if isinstance(document.get("id"), str) else os.path.basename(path)
    return _ordered(path, "kv-cache-tester", block_size, requests, name, tuple(notes))


def _walk_tester(path: str, entries, start: float, agent: str, where: str, block_size: int,
                 out: list[TraceRequest], depth: int) -> None:
    if depth > 32:
        raise TraceError(f"{path}: sub-agents nested more than 32 deep")
    if not isinstance(entries, list):
        raise TraceError(f"{path}: {where} must be a list of requests")
    for i, entry in enumerate(entries):
        here = f"{path}, {where}[{i}]"
        if not isinstance(entry, dict):
            raise TraceError(f"{here} is not a request object")
        t = entry.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TraceError(f"{here}: t must be a number of seconds, got {t!r}")
        arrival = start + float(t)
        if entry.get("type") == "subagent":
            name = entry.get("agent_id") if isinstance(entry.get("agent_id"), str) else f"{where}[{i}]"
            _walk_tester(path, entry.get("requests"), arrival, name, f"{where}[{i}].requests", block_size, out,
                         depth + 1)
            continue
        if len(out) >= MAX_REQUESTS:
            raise TraceError(f"{path} has more than {MAX_REQUESTS:,} requests")
        ids = _check_request(here, arrival, entry.get("in"), entry.get("out"), entry.get("hash_ids"), block_size)
        out.append(TraceRequest(arrival, entry["in"], entry["out"], ids, agent))


def _ordered(path: str, fmt: str, block_size: int, requests: list[TraceRequest], name: str,
             notes: tuple[str, ...] = ()) -> Trace:
    """Mooncake's requests stay in file order (an instant replay's order; a timed replay dispatches by arrival);
    a kv-cache-tester session's flattened sub-agents are put in arrival order (a stable sort)."""
    if fmt == "mooncake":
        if any(a.arrival_s > b.arrival_s for a, b in zip(requests, requests[1:])):
            notes = notes + ("arrivals are not in file order: an instant replay keeps file order, a timed replay "
                             "sends them by arrival time",)
        return Trace(path, fmt, block_size, tuple(requests), name, notes)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    return Trace(path, fmt, block_size, tuple(requests[i] for i in order), name, notes)

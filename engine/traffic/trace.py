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
from itertools import chain
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


@dataclass(frozen=True, eq=False)
class Trace:
    """A whole trace as columns, its requests in the order a replay admits them (Mooncake: file order;
    kv-cache-tester: the flattened session by arrival, file order for ties). Request i's ids are
    ``ids[offsets[i]:offsets[i + 1]]``."""

    path: str
    format: str  # "mooncake" | "kv-cache-tester"
    block_size: int  # tokens each hash id stands for
    arrival_s: np.ndarray  # float64 [requests]: seconds from the trace's start
    input_length: np.ndarray  # int64 [requests]: prompt tokens
    output_length: np.ndarray  # int64 [requests]: tokens the server generated
    ids: np.ndarray  # int64 [blocks]: every request's hash ids, end to end
    offsets: np.ndarray  # int64 [requests + 1]
    agents: tuple[str, ...] = ()  # each request's kv-cache-tester sub-agent ("" for the main session); () for none
    name: str = ""  # what the source calls itself (kv-cache-tester's "id"), else the file's name
    notes: tuple[str, ...] = field(default=())  # what the reader noticed and the user may want to know

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def num_blocks(self) -> int:
        """Prompt blocks in all (ids, counted once per request that names them)."""
        return len(self.ids)

    @cached_property
    def num_tokens(self) -> int:
        return int(self.input_length.sum())

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s.max(initial=0.0))

    @property
    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids, self.offsets

    def request(self, i: int) -> TraceRequest:
        return TraceRequest(float(self.arrival_s[i]), int(self.input_length[i]), int(self.output_length[i]),
                            tuple(self.ids[self.offsets[i]:self.offsets[i + 1]].tolist()),
                            self.agents[i] if self.agents else "")

    @cached_property
    def requests(self) -> tuple[TraceRequest, ...]:
        return tuple(self.request(i) for i in range(self.num_requests))

    def block_tokens(self, i: int) -> np.ndarray:
        """Prompt tokens each of request ``i``'s ids stands for: ``block_size``, less for a partial last block."""
        n = int(self.offsets[i + 1] - self.offsets[i])
        return np.clip(int(self.input_length[i]) - np.arange(n) * self.block_size, 1, self.block_size)

    @cached_property
    def nodes(self) -> tuple[np.ndarray, int]:
        """(a prefix-node id per block, the number of nodes): blocks share a node exactly when their ids and every
        id before them in their requests are equal, which is when a replay's chained hashes are equal. Numbered
        position by position, so a node's parent has a smaller number."""
        ids, offsets = self.ids, self.offsets
        lengths = np.diff(offsets)
        out = np.empty(len(ids), np.int64)
        parent = np.full(len(lengths), -1, np.int64)  # the node of each request's previous block
        alive = np.arange(len(lengths))
        count = 0
        for j in range(int(lengths.max(initial=0))):
            alive = alive[lengths[alive] > j]
            at = offsets[alive] + j
            keys_parent, keys_id = parent[alive], ids[at]
            order = np.lexsort((keys_id, keys_parent))
            sp, si = keys_parent[order], keys_id[order]
            new = np.ones(len(order), bool)
            new[1:] = (sp[1:] != sp[:-1]) | (si[1:] != si[:-1])
            numbers = np.cumsum(new) - 1 + count
            node = np.empty(len(order), np.int64)
            node[order] = numbers
            out[at] = node
            parent[alive] = node
            count += int(new.sum())
        return out, count

    def slice(self, start: int, stop: int | None = None) -> "Trace":
        """The requests from ``start`` to ``stop`` as a trace of their own (arrivals kept)."""
        stop = self.num_requests if stop is None else min(stop, self.num_requests)
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Trace(self.path, self.format, self.block_size, self.arrival_s[start:stop],
                     self.input_length[start:stop], self.output_length[start:stop], self.ids[lo:hi],
                     self.offsets[start:stop + 1] - lo, self.agents[start:stop] if self.agents else (), self.name,
                     self.notes)


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
        decoder = msgspec.json.Decoder(_Mooncake)
        for number, line in numbered:
            try:
                decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise TraceError(f"{path}, line {number}: {exc}") from None
            except msgspec.DecodeError as exc:
                cut = " (the line is cut short)" if number >= len(lines) - 1 else ""
                raise TraceError(f"{path}, line {number} is not a JSON request{cut}: {exc}") from None
        raise TraceError(f"{path} could not be read as JSON lines") from None
    if not records:
        raise TraceError(f"{path} holds no requests")
    where = [f"{path}, line {n}" for n, _ in numbered]
    arrival = np.fromiter((r.timestamp for r in records), np.float64, len(records)) / 1000.0
    return _columns(path, "mooncake", MOONCAKE_BLOCK_SIZE, arrival, [r.input_length for r in records],
                    [r.output_length for r in records], [r.hash_ids for r in records], where, (),
                    os.path.basename(path))


def _columns(path: str, fmt: str, block_size: int, arrival: np.ndarray, inputs: list, outputs: list,
             id_lists: list, where: list[str], agents: tuple, name: str, notes: tuple = ()) -> Trace:
    """The trace's columns, each request checked for meaning (``where[i]`` names request i in errors)."""
    n = len(id_lists)
    lengths = np.fromiter((len(ids) for ids in id_lists), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    try:
        inputs_a = np.asarray(inputs, np.int64)
        outputs_a = np.asarray(outputs, np.int64)
        ids = np.fromiter(chain.from_iterable(id_lists), np.int64, int(offsets[-1]))
    except (OverflowError, ValueError):  # a number beyond 64 bits: find it, and say where
        for i in range(n):
            _check_request(where[i], float(arrival[i]), inputs[i], outputs[i], id_lists[i], block_size)
        raise TraceError(f"{path} holds a number that does not fit 64 bits") from None
    bad = ~np.isfinite(arrival) | (arrival < 0) | (inputs_a < 1) | (outputs_a < 0)
    bad |= (lengths < inputs_a // block_size) | (lengths > -(-inputs_a // block_size)) | (lengths == 0)
    if len(ids):
        low = np.minimum.reduceat(ids, offsets[:-1][lengths > 0]) if (lengths > 0).any() else ids[:0]
        bad[np.flatnonzero(lengths > 0)[low < 0]] = True
    if bad.any():
        i = int(np.argmax(bad))
        _check_request(where[i], float(arrival[i]), inputs[i], outputs[i], id_lists[i], block_size)
    return _ordered(path, fmt, block_size, arrival, inputs_a, outputs_a, ids, offsets, agents, name, notes)


def _read_tester(path: str, document: dict) -> Trace:
    block_size = document.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise TraceError(f"{path}: block_size must be a whole number of tokens from 1 to {MAX_BLOCK_SIZE:,}, got "
                         f"{block_size!r}")
    notes = []
    scope = document.get("hash_id_scope")
    if scope not in (None, "local"):
        notes.append(f"hash_id_scope {scope!r}: ids are matched within this file only")
    found: list[tuple] = []  # (arrival, in, out, ids, agent, where)
    _walk_tester(path, document.get("requests"), 0.0, "", "requests", block_size, found, depth=0)
    if not found:
        raise TraceError(f"{path} holds no requests")
    name = document.get("id") if isinstance(document.get("id"), str) else os.path.basename(path)
    order = sorted(range(len(found)), key=lambda i: found[i][0])  # by arrival; file order among equal times
    found = [found[i] for i in order]
    agents = tuple(f[4] for f in found)
    return _columns(path, "kv-cache-tester", block_size, np.array([f[0] for f in found], np.float64),
                    [f[1] for f in found], [f[2] for f in found], [f[3] for f in found], [f[5] for f in found],
                    agents if any(agents) else (), name, tuple(notes))


def _walk_tester(path: str, entries, start: float, agent: str, where: str, block_size: int, out: list,
                 depth: int) -> None:
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
        out.append((arrival, entry["in"], entry["out"], ids, agent, here))


def _ordered(path: str, fmt: str, block_size: int, arrival, inputs, outputs, ids, offsets, agents, name,
             notes=()) -> Trace:
    """The columns as a Trace. Mooncake's requests stay in file order (an instant replay's order; a timed replay
    dispatches by arrival)."""
    if fmt == "mooncake" and (np.diff(arrival) < 0).any():
        notes = tuple(notes) + ("arrivals are not in file order: an instant replay keeps file order, a timed "
                                "replay sends them by arrival time",)
    return Trace(path, fmt, block_size, arrival, inputs, outputs, ids, offsets, agents, name, tuple(notes))

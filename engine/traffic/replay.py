"""Replaying a trace through the engine: its requests become conversations of synthesised tokens.

Two clocks:

- **Instant**: requests in the trace's order, one at a time; each is admitted (its longest leading run of held
  blocks are hits, all of them even when the whole prompt is held: it generates nothing, so nothing is recomputed),
  holds all its blocks while its prompt is computed, then finishes, before the next arrives. Hit counts depend only
  on the eviction policy and the pool's size, which is what a capacity sweep measures (engine.traffic.sweep computes
  the same figures without an engine, and a test holds the two to the same evictions).
- **Timed**: requests arrive at their timestamps divided by ``speed`` (on the engine's step clock when
  ``step_seconds`` is given, else the wall clock), each decodes its output (``output_length * scale`` tokens,
  whatever the model says: end-of-sequence does not stop it) and holds its blocks meanwhile, as in a server: running
  requests compete with the cache for blocks.

Prompts longer than the model's context are cut to it (counted in ``num_cut``), and the pool must hold the longest
prompt (checked before anything runs). The driver calls only the engine's public methods, on the engine's thread.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np

from kvstream.views import HIT_MEDIA, MISS_CAUSES

from ..kv.policies import NEVER, POLICIES
from ..kv.pool import hash_block_tokens
from .tokens import TokenSynth
from .trace import Trace

STRIDE = 1 << 20  # lookups are numbered request * STRIDE + block position (a request has fewer than 2^20 blocks)
MODES = ("instant", "timed")


class ReplayError(ValueError):
    """A replay that cannot run as asked (the message is for the user)."""


def token_range(engine) -> tuple[int, int]:
    """The token ids a replay's synthesised prompts use: the model's vocabulary without its special tokens where
    they sit at either end (a byte model's 256 bytes; all of --model none's)."""
    vocab = engine.vocab_size
    special = set(engine.eos_token_ids) | {engine.model_config.bos_token_id or 0}
    if engine.model_name == "none":
        return 1, vocab
    if engine.model_name == "builtin":
        return 0, min(vocab, 256)
    lo = max((s + 1 for s in special if s < 64), default=0)
    hi = min([vocab] + [s for s in special if s >= vocab - 64])
    return lo, hi


class TraceFuture:
    """What a replay knows of the requests to come: for each prefix hash, when it is next looked up after the
    request admitted last (Belady's rule needs it: engine.kv.policies.belady)."""

    def __init__(self, keys: dict[int, int], starts: np.ndarray, positions: np.ndarray):
        self._keys = keys  # the engine's prefix hash -> its prefix node
        self._starts = starts  # node n's lookups are positions[starts[n]:starts[n + 1]], ascending
        self._positions = positions
        self.now = -1  # the request admitted last (its lookups are past)

    def next_use(self, block_hash: int) -> int:
        node = self._keys.get(block_hash)
        if node is None:
            return NEVER
        lo, hi = int(self._starts[node]), int(self._starts[node + 1])
        at = bisect.bisect_left(self._positions, (self.now + 1) * STRIDE, lo, hi)
        return int(self._positions[at]) if at < hi else NEVER


@dataclass
class RequestOutcome:
    """One replayed request: its blocks and how many were hits, by where they came from."""

    index: int  # in the trace
    conversation_id: int
    num_blocks: int  # blocks of its prompt (trace ids, after any cut)
    hit_blocks: int = 0  # leading blocks taken from a pool instead of computed
    hits_by_medium: dict = field(default_factory=dict)  # {"GPU": n, "CPU": n, "STORAGE": n}
    hit_tokens: int = 0  # the trace's tokens those blocks stand for
    cut: bool = False  # its prompt was cut to the model's context
    block_outcomes: tuple[str, ...] = ()  # each block's outcome at admission: a hit medium or a miss cause


class TraceReplay:
    """Feeds ``trace`` to ``engine`` (made with :func:`replay_config`'s config, and :meth:`future` when its eviction
    policy needs it). Call :meth:`advance` until :attr:`done`; :meth:`totals` says what it measured."""

    def __init__(self, trace: Trace, engine, mode: str = "instant", speed: float = 1.0, scale: float = 1.0,
                 step_seconds: float | None = None, future: TraceFuture | None = None):
        if mode not in MODES:
            raise ReplayError(f"replay must be instant or timed, got {mode!r}")
        if not speed > 0 or not np.isfinite(speed):
            raise ReplayError(f"--trace-speed must be a positive number, got {speed!r}")
        if not scale >= 0 or not np.isfinite(scale):
            raise ReplayError(f"--trace-scale must be 0 or more, got {scale!r}")
        self.trace, self.engine, self.mode = trace, engine, mode
        self.speed, self.scale, self.step_seconds = float(speed), float(scale), step_seconds
        self.future = future
        bs = engine.cfg.block_size
        # a prompt longer than the context is cut to it; a timed request also needs a position for its first output
        self.max_blocks = (engine.max_model_len - (mode == "timed")) // bs
        ids, offsets = trace.flat
        self._ids, self._offsets = ids, offsets
        self._dense = np.unique(ids, return_inverse=True)[1].astype(np.int64)
        lo, hi = token_range(engine)
        self.synth = TokenSynth(bs, lo, hi, int(self._dense.max(initial=0)) + 1)
        longest = min(int(np.diff(offsets).max(initial=0)), self.max_blocks)
        if longest > engine.cfg.num_blocks:
            raise ReplayError(f"the trace's longest prompt needs {longest} blocks but the pool has "
                              f"{engine.cfg.num_blocks}; give the pool at least {longest} blocks")
        self.next_index = 0  # the next request to send
        self.outcomes: list[RequestOutcome] = []
        self._live: dict[int, RequestOutcome] = {}  # conversation id -> its outcome, until it finished
        self.num_cut = 0
        self._start_clock: float | None = None
        self._totals = {"requests_done": 0, "hit_blocks": 0, "total_blocks": 0, "hit_tokens": 0, "total_tokens": 0,
                        "hit_blocks_by_medium": {"GPU": 0, "CPU": 0, "STORAGE": 0},
                        "misses": dict.fromkeys(MISS_CAUSES[:3], 0)}
        self.latest = self.totals()  # replaced whole after each request: other threads read it

    # ---- what the engine is fed -------------------------------------------------------------------------------
    def prompt(self, index: int) -> tuple[list[int], int, bool]:
        """(token ids, blocks, cut?) of request ``index``'s prompt: its ids' tokens end to end."""
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        cut = end - start > self.max_blocks
        end = min(end, start + self.max_blocks)
        return self.synth.tokens(self._dense[start:end]).tolist(), end - start, cut

    def _send(self, index: int) -> RequestOutcome:
        tokens, blocks, cut = self.prompt(index)
        output_length = int(self.trace.output_length[index])
        if self.future is not None:
            self.future.now = index
        if self.mode == "instant":
            cid = self.engine.add_prefill(tokens)
        else:
            room = max(1, self.engine.max_model_len - len(tokens))
            new = max(1, min(room, round(output_length * self.scale)))
            cid = self.engine.add_conversation(prompt_token_ids=tokens, max_new_tokens=new, ignore_eos=True)
        outcome = RequestOutcome(index, cid, blocks, cut=cut)
        self.num_cut += cut
        self._live[cid] = outcome
        self.outcomes.append(outcome)
        return outcome

    # ---- running ----------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.next_index >= self.trace.num_requests and not self._live

    def feed(self) -> int:
        """On the engine's thread, between steps: note what finished, then send what is due (instant: the next
        request once the engine is idle; timed: every request that has arrived). Returns the requests sent."""
        self._collect()
        sent = 0
        if self.mode == "instant":
            if not self.engine.has_work() and self.next_index < self.trace.num_requests:
                self._send(self.next_index)
                self.next_index += 1
                sent = 1
            return sent
        now = self._clock()
        while self.next_index < self.trace.num_requests and \
                self.trace.arrival_s[self.next_index] / self.speed <= now:
            self._send(self.next_index)
            self.next_index += 1
            sent += 1
        return sent

    def advance(self, max_requests: int = 1) -> int:
        """Drive the engine directly (no runner): instant: up to ``max_requests`` requests, each run to its end;
        timed: what has arrived, then one engine step. Returns the requests finished."""
        before = len(self.outcomes) - len(self._live)
        if self.mode == "instant":
            for _ in range(max_requests):
                if self.engine.has_work():  # another caller's conversations: instant replay waits for an idle pool
                    self.engine.run_until_idle()
                if not self.feed():
                    break
                self.engine.run_until_idle()
        else:
            self.feed()
            if self.engine.has_work():
                self.engine.step()
        self._collect()
        return len(self.outcomes) - len(self._live) - before

    def run(self) -> None:
        """To the end (a timed replay on the step clock only: the wall clock would wait)."""
        if self.mode == "timed" and self.step_seconds is None:
            raise ReplayError("a timed replay on the wall clock runs on the engine thread; give step_seconds to "
                              "run it to the end at once")
        while not self.done:
            self.advance(1 << 30)

    def _clock(self) -> float:
        if self.step_seconds is not None:
            return self.engine.step_id * self.step_seconds
        if self._start_clock is None:
            self._start_clock = time.monotonic()
        return time.monotonic() - self._start_clock

    def seconds_to_next(self) -> float | None:
        """Trace seconds (after ``speed``) until the next request arrives; None when none is left."""
        if self.next_index >= self.trace.num_requests:
            return None
        return max(0.0, float(self.trace.arrival_s[self.next_index]) / self.speed - self._clock())

    def _collect(self) -> None:
        """Outcomes of the requests that finished since the last call (what their admission found)."""
        for cid in [c for c in self._live if self.engine.is_finished(c)]:
            outcome = self._live.pop(cid)
            outcomes = self.engine.prompt_block_outcomes(cid)
            outcome.block_outcomes = tuple(o.outcome for o in outcomes)
            media = {"device": "GPU", "host": "CPU", "disk": "STORAGE"}
            outcome.hits_by_medium = {"GPU": 0, "CPU": 0, "STORAGE": 0}
            for o in outcomes:
                if o.hit:
                    outcome.hits_by_medium[media[o.outcome]] += 1
            outcome.hit_blocks = sum(outcome.hits_by_medium.values())
            outcome.hit_tokens = int(self.trace.block_tokens(outcome.index)[:outcome.hit_blocks].sum())
            self._add_totals(outcome)

    def _add_totals(self, o: RequestOutcome) -> None:
        t = self._totals
        t["requests_done"] += 1
        t["hit_blocks"] += o.hit_blocks
        t["total_blocks"] += o.num_blocks
        t["hit_tokens"] += o.hit_tokens
        t["total_tokens"] += int(self.trace.input_length[o.index])
        for medium, n in o.hits_by_medium.items():
            t["hit_blocks_by_medium"][medium] += n
        for cause in o.block_outcomes:
            if cause not in HIT_MEDIA:
                t["misses"][cause] = t["misses"].get(cause, 0) + 1
        self.latest = self.totals()

    def totals(self) -> dict:
        """What the replay measured so far: requests done (of all), hit and total blocks and tokens, hits by
        medium, misses by cause, prompts cut to the context."""
        t = self._totals
        return {**t, "requests": self.trace.num_requests, "hit_blocks_by_medium": dict(t["hit_blocks_by_medium"]),
                "misses": dict(t["misses"]), "cut": self.num_cut}


def trace_future(trace: Trace, synth: TokenSynth, dense: np.ndarray, max_blocks: int) -> TraceFuture:
    """Every prefix node's lookups, keyed by the hash the engine gives that node's block (chained over the
    synthesised tokens, as Sequence.full_block_hashes chains them)."""
    nodes, count = trace.nodes
    ids, offsets = trace.flat
    parent = np.full(count, -1, np.int64)
    first_at = np.full(count, -1, np.int64)  # a block where each node appears (its id's tokens)
    positions = np.empty(len(nodes), np.int64)
    kept = np.ones(len(nodes), bool)
    for r in range(trace.num_requests):
        start, end = int(offsets[r]), int(offsets[r + 1])
        j = np.arange(end - start)
        positions[start:end] = r * STRIDE + j
        kept[start:end] = j < max_blocks
        seg = nodes[start:end]
        parent[seg[1:]] = seg[:-1]
        new = first_at[seg] < 0
        first_at[seg[new]] = np.arange(start, end)[new]
    tokens = synth.tokens(dense[first_at]).reshape(count, synth.block_size)
    keys: dict[int, int] = {}
    hashes = [0] * count
    for node in range(count):  # parents are numbered before their children
        p = int(parent[node])
        h = hash_block_tokens(hashes[p] if p >= 0 else None, tokens[node].tolist())
        hashes[node] = h
        keys[h] = node
    order = np.lexsort((positions[kept], nodes[kept]))
    by_node, pos = nodes[kept][order], positions[kept][order]
    starts = np.searchsorted(by_node, np.arange(count + 1))
    return TraceFuture(keys, starts, pos.tolist())


def replay_config(cfg, trace: Trace, mode: str):
    """The engine config a replay runs under: an instant replay allocates each prompt whole (no chunks: a request
    holds all its blocks at once, as its semantics say), a timed one keeps the user's budget."""
    from dataclasses import replace
    if mode == "instant":
        longest = int(np.diff(trace.flat[1]).max(initial=0)) * cfg.block_size
        return replace(cfg, enable_chunked_prefill=False,
                       max_num_batched_tokens=max(cfg.max_num_batched_tokens, longest + 1))
    return cfg


def make_replay(cfg, trace: Trace, mode: str = "instant", speed: float = 1.0, scale: float = 1.0,
                step_seconds: float | None = None, progress=None) -> TraceReplay:
    """An engine for ``cfg`` (adjusted by :func:`replay_config`) and the replay of ``trace`` through it; Belady's
    policy gets the trace's future."""
    from .. import Engine
    cfg = replay_config(cfg, trace, mode)
    future = None
    if POLICIES[cfg.eviction_policy].needs_future:
        future = _Pending()
        engine = Engine(cfg, progress, future=future)
        replay = TraceReplay(trace, engine, mode, speed, scale, step_seconds)
        future.target = trace_future(trace, replay.synth, replay._dense, replay.max_blocks)
        replay.future = future.target
        return replay
    return TraceReplay(trace, Engine(cfg, progress), mode, speed, scale, step_seconds)


class _Pending:
    """A future whose answers arrive once the replay (which needs the engine's block size and vocabulary) exists."""

    target: TraceFuture | None = None

    def next_use(self, block_hash: int) -> int:
        return self.target.next_use(block_hash) if self.target is not None else NEVER

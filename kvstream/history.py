"""History: the frames of one pool stream kept in memory (or on disk, for a recording), with random access.

Why a class of its own: the timeline scrubs back while the engine keeps running, so frames arrive on the engine (or
subscriber) thread while the GUI asks for any kept frame at 30 Hz. Frames are kept encoded (a delta of a decode
step is a few kilobytes even at 65,536 blocks); a frame is rebuilt by decoding from the keyframe before it, and a
small decode cache makes scrubbing and playing forward cost one delta per frame. The memory budget drops the
oldest frames first and re-keys the oldest kept frame (a keyframe made from its decoded state), so the history
always starts with a keyframe. Block events stay decoded beside the frames for markers, the event log and the
tokens of cached blocks.

Thread-safe for one writer thread and any number of readers.
"""
from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from typing import Callable, Iterable, Iterator

import numpy as np

from .events import BlockEvent, EventKind
from .poolstream import Frame, StreamDecoder, StreamError, check_frame, encode_keyframe, read_head
from .views import PoolSnapshot

DEFAULT_BUDGET = 256 << 20  # bytes of frames a History keeps by default (issue 10: about 256 MiB)
FRAME_OVERHEAD = 200  # bytes a kept frame costs beyond its payload (the Frame object, index entries)
EVENT_OVERHEAD = 250  # bytes a decoded BlockEvent costs in memory beyond the payload that also carries it
_TRIM_TO = 7 / 8  # a trim brings the history down to this share of the budget (a trim re-keys, so not per frame)
_SNAPSHOT_CACHE = 4  # rebuilt snapshots kept (the view and the frames next to it)
_CHECKPOINT_EVERY = 8  # scrubbing back through a run of deltas, keep the decoder state every this many frames
KEYFRAME_COST = 40  # decoding a keyframe costs about as much as this many deltas fast-forwarding (figures:
# docs/performance.md, "History decoding"). So a decoder up to this many frames before a bridged keyframe goes on
# through the bridge rather than decoding the keyframe, and decode_cost counts a keyframe as this many frames
_FORWARD_EVERY = 16  # a long decode (a jump) keeps the decoder state every this many frames on its way: the step
# back that usually follows a jump then decodes at most this many frames, not the whole run from its keyframe again
# (a state copy costs about one delta; figures: docs/performance.md, "History decoding")
_SCRUB_BACK = 64  # a move back of at most this many frames counts as scrubbing (checkpoints are kept on the way)
_CHECKPOINTS = 16  # decoder states kept for jumps back (each holds one copy of the per-block arrays: 2 MB at 65,536
# blocks); a step back decodes 4 deltas on average after a copy (figures: docs/performance.md, "History decoding")
BUSY_COST = 10 ** 9  # decode_cost while another thread decodes
_ENDS_CONTENT = frozenset({EventKind.ALLOCATED, EventKind.FREED, EventKind.EVICTED})  # the block's KV is gone


class Cancelled(Exception):
    """A decode stopped because its caller said so (History.snapshot_at's ``stop``)."""


def _cost(frame) -> int:
    return frame.nbytes + FRAME_OVERHEAD + EVENT_OVERHEAD * len(frame.events)


class History:
    """A bounded, randomly accessible run of pool-stream frames (a sink: ``write(frame)``)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET):
        self._write_lock = threading.RLock()  # one mutation at a time (write, trim, clear, budget change)
        self._lock = threading.Lock()  # guards the lists below for readers (held briefly)
        self._read_lock = threading.Lock()  # guards the decode cache
        self._frames: list = []  # Frame (or a recording's frame read from disk on demand), by seq
        self._seqs: list[int] = []  # seq of each frame, ascending
        self._steps: list[int] = []  # step_id of each frame, non-decreasing
        self._keys: list[int] = []  # seqs of the keyframes among them, ascending
        self._bridged: set[int] = set()  # seqs of the keyframes that carry a bridge from the frame before
        self._nbytes = 0  # cost of the kept frames (payloads + FRAME_OVERHEAD + EVENT_OVERHEAD per event)
        # (block id, seq) of every block a kept frame's events name, in seq order: two flat lists of ints, not one
        # list per block, so that the garbage collector has two objects to walk, not 65,536
        self._touch_blocks: list[int] = []
        self._touch_seqs: list[int] = []
        self._touch_np: tuple[np.ndarray, np.ndarray] | None = None  # the same as arrays, for lookups (None: stale)
        self._cleared: list[int] = []  # seqs of frames with a CLEARED event
        self._relocated: list[int] = []  # seqs of frames with a RELOCATED event
        self._budget = 0
        self.read_only = False  # a recording opened from disk takes no frames
        self.budget_bytes = budget_bytes
        self._decoder: StreamDecoder | None = None  # decode cache: a decoder left at some kept frame
        self._checkpoints: OrderedDict[int, StreamDecoder] = OrderedDict()  # seq -> decoder copy at that frame
        self._snapshots: OrderedDict[int, PoolSnapshot] = OrderedDict()  # seq -> rebuilt snapshot (LRU)
        self.recording = None  # a RecordingInfo when the history is a recording opened from disk
        self._closer = None  # closes the recording's file

    def close(self) -> None:
        """Release the file of a recording opened from disk (nothing for an in-memory history)."""
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- size ---------------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        """Most bytes of frames kept; lowering it trims at once (a recording read from disk ignores it)."""
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the history budget must be a positive number of bytes, got {value!r}")
        with self._write_lock:
            self._budget = value
            if not self.read_only and self._nbytes > value:
                self._trim()

    @property
    def nbytes(self) -> int:
        """Bytes the kept frames cost (their payloads plus a per-frame and per-event estimate)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def first_seq(self) -> int | None:
        """seq of the oldest kept frame (None when empty)."""
        seqs = self._seqs
        return seqs[0] if seqs else None

    @property
    def last_seq(self) -> int | None:
        """seq of the newest kept frame (None when empty)."""
        seqs = self._seqs
        return seqs[-1] if seqs else None

    @property
    def stream_id(self) -> int | None:
        frames = self._frames
        return frames[-1].stream_id if frames else None

    def seqs(self) -> list[int]:
        """seq of every kept frame, ascending (contiguous unless the writer resynced after a gap)."""
        with self._lock:
            return list(self._seqs)

    def keyframe_seqs(self) -> list[int]:
        with self._lock:
            return list(self._keys)

    # ---- writing ------------------------------------------------------------------------------------------------
    def write(self, frame: Frame) -> None:
        """Keep ``frame`` (the writer thread). StreamError, and nothing kept, if it does not follow the last one."""
        check_frame(frame, "a History keeps")
        with self._write_lock:
            if self.read_only:
                raise StreamError("this history is a recording read from disk: it takes no new frames")
            if self._frames:
                last = self._frames[-1]
                if frame.stream_id != last.stream_id:
                    raise StreamError("this frame belongs to another stream (the source restarted): clear() the "
                                      "history or start a new one")
                if frame.seq <= last.seq:
                    raise StreamError(f"frame {frame.seq} is not newer than the history's last frame {last.seq}")
                if not frame.keyframe and frame.seq != last.seq + 1:
                    raise StreamError(f"frame {frame.seq} is a delta but the history's last frame is {last.seq}: "
                                      "frames are missing; write the next keyframe")
                if frame.step_id < last.step_id:
                    raise StreamError(f"frame {frame.seq} is of step {frame.step_id}, before step {last.step_id}")
            elif not frame.keyframe:
                raise StreamError("a history must start with a keyframe (give a sink that joins mid-stream "
                                  "StreamEncoder.keyframe() first)")
            self._append(frame)
            if self._nbytes > self._budget:
                self._trim()

    def _append(self, frame) -> None:
        """Add a checked frame."""
        with self._lock:
            self._frames.append(frame)
            self._seqs.append(frame.seq)
            self._steps.append(frame.step_id)
            if frame.keyframe:
                self._keys.append(frame.seq)
                if frame.bridged:
                    self._bridged.add(frame.seq)
            self._nbytes += _cost(frame)
            self._index_events(frame.seq, frame.events)

    def _index_events(self, seq: int, events: Iterable[BlockEvent]) -> None:
        named: set[int] = set()
        for e in events:
            if e.kind == EventKind.CLEARED:
                if not self._cleared or self._cleared[-1] != seq:
                    self._cleared.append(seq)
            elif e.kind == EventKind.RELOCATED and (not self._relocated or self._relocated[-1] != seq):
                self._relocated.append(seq)
            named.update(e.block_ids)
            named.update(e.new_block_ids)
        if named:
            self._touch_blocks.extend(named)
            self._touch_seqs.extend([seq] * len(named))
            self._touch_np = None

    def write_many(self, frames: Iterable[Frame]) -> None:
        for frame in frames:
            self.write(frame)

    def clear(self) -> None:
        """Forget every frame (a subscriber whose source restarted starts again)."""
        with self._write_lock, self._lock:
            self._frames, self._seqs, self._steps, self._keys = [], [], [], []
            self._bridged = set()
            self._nbytes = 0
            self._touch_blocks, self._touch_seqs, self._touch_np, self._cleared = [], [], None, []
            self._relocated = []
        with self._read_lock:
            self._decoder = None
            self._checkpoints.clear()
            self._snapshots.clear()

    def drop_cache(self) -> None:
        """Forget decoded states and snapshots (they cost a copy of the pool each); the next access decodes from a
        keyframe."""
        with self._read_lock:
            self._decoder = None
            self._checkpoints.clear()
            self._snapshots.clear()

    def _trim(self) -> None:
        """Drop the oldest frames down to _TRIM_TO of the budget (keeping at least the newest), re-keying the oldest
        kept frame when it is a delta. Runs on the writer thread, or the thread that lowers the budget."""
        for _ in range(4):  # a re-keyed frame is bigger than the delta it replaces: trim again if that overshoots
            if self._nbytes <= self._budget or not self._trim_once():
                return

    def _trim_once(self) -> bool:
        with self._lock:
            target = int(self._budget * _TRIM_TO)
            key_cost = max(_cost(self._frames[bisect.bisect_left(self._seqs, self._keys[-1])]), 0)
            cut, dropped = 0, 0
            # drop until what is left, with the kept head re-keyed (about as big as the newest keyframe), fits
            while cut < len(self._frames) - 1 and self._nbytes - dropped + (
                    0 if self._frames[cut].keyframe else key_cost - _cost(self._frames[cut])) > target:
                dropped += _cost(self._frames[cut])
                cut += 1
            if cut == 0:
                return False
            keep = self._frames[cut]
            run = None
            if not keep.keyframe:  # the keyframe before it and the deltas up to it
                key_seq = self._keys[bisect.bisect_right(self._keys, keep.seq) - 1]
                run = self._frames[bisect.bisect_left(self._seqs, key_seq, 0, cut + 1):cut + 1]
        if run is not None:  # decode outside the lock: readers go on meanwhile (there is no other writer)
            decoder = StreamDecoder()
            for f in run:
                decoder.apply(read_head(f.payload, events=False))
            snap = decoder.snapshot()
            keyframe = encode_keyframe(snap, keep.seq, keep.stream_id, keep.events)
        with self._lock:
            del self._frames[:cut], self._seqs[:cut], self._steps[:cut]
            self._nbytes -= dropped
            if run is not None:
                self._nbytes += _cost(keyframe) - _cost(keep)
                self._frames[0] = keyframe
            first = self._seqs[0]
            del self._keys[:bisect.bisect_left(self._keys, first)]
            if not self._keys or self._keys[0] != first:
                self._keys.insert(0, first)
            self._bridged = {k for k in self._bridged if k > first}  # the kept head is a keyframe of its own
            del self._cleared[:bisect.bisect_left(self._cleared, first)]
            del self._relocated[:bisect.bisect_left(self._relocated, first)]
            stale = bisect.bisect_left(self._touch_seqs, first)  # the dropped frames' part of the block index
            del self._touch_blocks[:stale], self._touch_seqs[:stale]
            self._touch_np = None
        return True

    # ---- reading ------------------------------------------------------------------------------------------------
    def _index(self, seq: int) -> int:
        """Position of frame ``seq`` (call with self._lock held)."""
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"a frame number is an integer, not {type(seq).__name__}")
        i = bisect.bisect_left(self._seqs, seq)
        if i == len(self._seqs) or self._seqs[i] != seq:
            if not self._seqs:
                raise LookupError(f"frame {seq} is not in the history: it is empty")
            raise LookupError(f"frame {seq} is not in the history (it keeps frames {self._seqs[0]} to "
                              f"{self._seqs[-1]})")
        return i

    def frame(self, seq: int):
        """The kept Frame ``seq`` (its payload is read from disk for a recording)."""
        with self._lock:
            return self._frames[self._index(seq)]

    def frame_info(self, seq: int) -> tuple[int, tuple[BlockEvent, ...]]:
        """(step_id, events) of frame ``seq``, without decoding it."""
        with self._lock:
            f = self._frames[self._index(seq)]
            return f.step_id, f.events

    def step_of(self, seq: int) -> int:
        return self.frame_info(seq)[0]

    def seq_of_step(self, step_id: int) -> int | None:
        """The last kept frame of step ``step_id`` (None if no kept frame has that step)."""
        with self._lock:
            i = bisect.bisect_right(self._steps, step_id) - 1
            return self._seqs[i] if i >= 0 and self._steps[i] == step_id else None

    def events(self, first_seq: int | None = None, last_seq: int | None = None,
               kinds: Iterable[EventKind] | None = None) -> list[tuple[int, BlockEvent]]:
        """(seq, event) for the kept frames from ``first_seq`` to ``last_seq`` (inclusive), oldest first."""
        wanted = None if kinds is None else frozenset(kinds)
        with self._lock:
            lo = 0 if first_seq is None else bisect.bisect_left(self._seqs, first_seq)
            hi = len(self._seqs) if last_seq is None else bisect.bisect_right(self._seqs, last_seq)
            frames = self._frames[lo:hi]
        return [(f.seq, e) for f in frames for e in f.events if wanted is None or e.kind in wanted]

    def block_events(self, block_id: int, last_seq: int | None = None) -> list[tuple[int, BlockEvent]]:
        """(seq, event) of the kept frames up to ``last_seq`` that can concern block ``block_id`` as it is then:
        every frame whose events name it, or name the ids its content had before relocations, plus every frame
        with a relocation or a reset of the prefix cache; oldest first. A subset of :meth:`events` that tells the
        block's story the same (explorer.model.block_history.block_events picks from it exactly what it picks from all),
        read through the block index instead of every event: walking every event of a long recording took a large
        share of a second, and held the collector busy for as long again (figures: docs/performance.md, "History
        decoding")."""
        with self._lock:
            if not self._seqs:
                return []
            last = self._seqs[-1] if last_seq is None else min(last_seq, self._seqs[-1])
            moves = self._relocated[:bisect.bisect_right(self._relocated, last)]
            ids, cur = {int(block_id)}, int(block_id)
            moved = (e for seq in reversed(moves) for e in reversed(self._frames[self._index(seq)].events)
                     if e.kind == EventKind.RELOCATED)
            for e in moved:  # the ids the block's content had, following relocations back
                if cur in e.new_block_ids:
                    cur = e.block_ids[e.new_block_ids.index(cur)]
                    ids.add(cur)
                elif cur in e.block_ids:
                    break  # moved away with nothing moved in: its story starts after this
            blocks, frames = self._block_index()
            named = frames[np.isin(blocks, np.fromiter(ids, np.int64, len(ids)))]
            wanted = np.union1d(named[named <= last], np.array(moves + self._cleared, np.int64))
            wanted = wanted[wanted <= last].tolist()
            picked = [self._frames[self._index(seq)] for seq in wanted]
        return [(f.seq, e) for f in picked for e in f.events]

    def _block_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, frame seqs) of the block index as arrays, built when first asked after a change (under
        ``_lock``)."""
        if self._touch_np is None:
            self._touch_np = (np.array(self._touch_blocks, np.int64), np.array(self._touch_seqs, np.int64))
        return self._touch_np

    def snapshot_at(self, seq: int, stop: Callable[[], bool] | None = None) -> PoolSnapshot:
        """The snapshot the source had at frame ``seq`` (LookupError if it is not kept). ``stop``: asked between
        frames; once it says True the decode ends with :class:`Cancelled`, leaving the decode cache at the frame it
        reached (a caller that no longer wants the frame does not hold the next one up)."""
        with self._lock:
            i = self._index(seq)
            key_seq, floor = self._floor(seq)
            lo = bisect.bisect_left(self._seqs, floor, 0, i + 1)
            run, seqs = self._frames[lo:i + 1], self._seqs[lo:i + 1]
            stream = run[-1].stream_id
        with self._read_lock:
            snap = self._cached_snapshot(seq, stream)
            if snap is not None:
                self._snapshots.move_to_end(seq)
                return snap
            cached = self._decoder
            # a step or a short jump back from the cache: the user scrubs backwards, so checkpoints every 8 frames
            # will pay off; any other long decode keeps one every _FORWARD_EVERY frames, for the step back that
            # follows (a few copies on a long run: a small cost on the jump, docs/performance.md "History decoding")
            backward = (cached is not None and cached.stream_id == stream and floor <= seq < cached.seq
                        and cached.seq - seq <= _SCRUB_BACK)
            decoder = self._resume(seq, stream, floor)
            start = decoder.seq + 1 if decoder is not None else key_seq
            if decoder is None:
                decoder = StreamDecoder()
            every = _CHECKPOINT_EVERY if backward else _FORWARD_EVERY if seq - start > _FORWARD_EVERY else 0
            at = seq
            try:
                for f in run[bisect.bisect_left(seqs, start):]:
                    if stop is not None and stop():
                        if decoder.seq is not None and decoder.stream_id == stream:
                            self._decoder = decoder  # where it got to: a valid state to go on from
                        raise Cancelled(f"the decode of frame {seq:,} was stopped at frame {decoder.seq}")
                    at = f.seq
                    decoder.apply(read_head(f.payload, events=False))
                    if every and f.seq % every == 0 and start < f.seq < seq and f.seq not in self._checkpoints:
                        self._keep_checkpoint(decoder)  # the next step back starts here, not at the keyframe
                at = seq
                snap = decoder.snapshot()
            except StreamError as exc:  # said with the frame (and the file): which frame, and why
                raise self._unusable(seq, at, exc) from None
            self._decoder = decoder
            self._snapshot_stream = stream
            self._snapshots[seq] = snap
            while len(self._snapshots) > _SNAPSHOT_CACHE:
                self._snapshots.popitem(last=False)
            return snap

    _snapshot_stream = None  # stream the cached snapshots belong to

    def _unusable(self, seq: int, at: int, exc: StreamError) -> StreamError:
        """The error for frame ``seq`` that cannot be shown because frame ``at`` (on the way to it) failed."""
        where = f"frame {seq:,}" + (f" (through frame {at:,})" if at != seq else "")
        if self.recording is not None:
            return self.recording.error(f"{where} cannot be shown: {exc}")
        return StreamError(f"{where} cannot be shown: {exc}")

    def decode_cost(self, seq: int) -> int:
        """About how many frames :meth:`snapshot_at` would decode for ``seq`` now: 0 when its snapshot is cached,
        else the deltas from the decode cache or the nearest checkpoint, or from the keyframe (which counts as
        ``KEYFRAME_COST`` frames more). While another thread is decoding, ``BUSY_COST``: the caller would wait for
        it. LookupError if ``seq`` is not kept. For a caller that decides where to decode (the window's scrubbing:
        cheap frames on the GUI thread, the others on a worker)."""
        with self._lock:
            i = self._index(seq)
            key_seq, floor = self._floor(seq)
            stream = self._frames[i].stream_id
        if not self._read_lock.acquire(blocking=False):
            return BUSY_COST
        try:
            if self._cached_snapshot(seq, stream) is not None:
                return 0
            best = self._nearest(seq, stream, floor)
            return seq - best.seq if best is not None else KEYFRAME_COST + seq - key_seq
        finally:
            self._read_lock.release()

    def _cached_snapshot(self, seq: int, stream: int) -> PoolSnapshot | None:
        """The rebuilt snapshot of ``seq`` if it is cached (under ``_read_lock``)."""
        snap = self._snapshots.get(seq)
        return snap if snap is not None and stream == self._snapshot_stream else None

    def _nearest(self, seq: int, stream: int, floor: int) -> StreamDecoder | None:
        """The decoder at hand nearest before ``seq``: the cache or a checkpoint of ``stream`` at a frame from
        ``floor`` to ``seq``; None: none (start at the keyframe). Under ``_read_lock``."""
        best = None
        cached = self._decoder
        if cached is not None and cached.stream_id == stream and floor <= cached.seq <= seq:
            best = cached
        for s, d in self._checkpoints.items():
            if d.stream_id == stream and floor <= s <= seq and (best is None or s > best.seq):
                best = d
        return best

    def walk(self, seqs: Iterable[int]) -> Iterator[tuple[int, PoolSnapshot]]:
        """(seq, snapshot) for each kept frame among ``seqs`` (ascending), read in order with a decoder of its own:
        one delta per frame passed, however many are skipped between two wanted ones, and the decode cache that
        :meth:`snapshot_at` keeps for scrubbing is left where it is. A frame no longer kept (the budget dropped it
        meanwhile) is skipped. For reading a history through, e.g. a recording's metrics."""
        decoder: StreamDecoder | None = None
        for seq in seqs:
            with self._lock:
                try:
                    i = self._index(seq)
                except LookupError:
                    continue
                key_seq, floor = self._floor(seq)
                stream = self._frames[i].stream_id
                fresh = (decoder is None or decoder.stream_id != stream or decoder.seq is None
                         or not min(floor, key_seq - 1) <= decoder.seq < seq)
                first = key_seq if fresh else decoder.seq + 1
                run = self._frames[bisect.bisect_left(self._seqs, first, 0, i + 1):i + 1]
            if fresh:
                decoder = StreamDecoder()
            for f in run:
                decoder.apply(read_head(f.payload, events=False))
            yield seq, decoder.snapshot()

    def _floor(self, seq: int) -> tuple[int, int]:
        """(the keyframe at or before ``seq``, the earliest frame a decoder may be at to go on to ``seq`` from):
        that keyframe, or earlier through keyframes that bridge (carry the delta from the frame before) while that
        costs fewer frames than decoding the keyframe would; never before what is kept. Under ``_lock``."""
        keys = self._keys
        k = bisect.bisect_right(keys, seq) - 1
        key_seq = floor = keys[k]
        reach = max(self._seqs[0], key_seq - KEYFRAME_COST)
        while keys[k] > reach and keys[k] in self._bridged:
            k -= 1
            floor = max(reach, keys[k])
        return key_seq, floor

    def _resume(self, seq: int, stream: int, floor: int) -> StreamDecoder | None:
        """A decoder to continue from (:meth:`_nearest`; a checkpoint's copy, checkpoints stay where they are);
        None: start at the keyframe."""
        best = self._nearest(seq, stream, floor)
        return best.copy() if best is not None and best is not self._decoder else best

    def _keep_checkpoint(self, decoder: StreamDecoder) -> None:
        self._checkpoints[decoder.seq] = decoder.copy()
        self._checkpoints.move_to_end(decoder.seq)
        while len(self._checkpoints) > _CHECKPOINTS:
            self._checkpoints.popitem(last=False)

    def latest(self) -> PoolSnapshot | None:
        """The newest kept frame's snapshot (None when empty)."""
        last = self.last_seq
        return None if last is None else self.snapshot_at(last)

    def block_tokens(self, block_id: int, seq: int) -> tuple[int, ...] | None:
        """The tokens block ``block_id`` holds at frame ``seq`` if it is a hashed block whose STORED event is kept
        (followed back through relocations); None if it holds none or the history does not go back far enough."""
        with self._lock:
            if not self._seqs:
                return None
            self._index(seq)
            first = self._seqs[0]
            b, at = int(block_id), seq
            blocks, frames = self._block_index()
            while True:
                seqs = frames[blocks == b]  # [frames naming b], ascending
                j = int(np.searchsorted(seqs, at, side="right")) - 1
                s = int(seqs[j]) if j >= 0 else -1
                c = self._cleared[bisect.bisect_right(self._cleared, at) - 1] if self._cleared else -1
                if c > at:
                    c = -1
                frame_seq = max(s, c)
                if frame_seq < first:
                    return None
                events = self._frames[self._index(frame_seq)].events
                for e in reversed(events):
                    kind = e.kind
                    if kind == EventKind.CLEARED:
                        return None
                    if kind == EventKind.RELOCATED:
                        if b in e.new_block_ids:
                            b = e.block_ids[e.new_block_ids.index(b)]  # where its content was before the move
                        elif b in e.block_ids:
                            return None  # moved away, nothing moved in
                        continue
                    if b in e.block_ids:
                        if kind == EventKind.STORED:
                            per = len(e.token_ids) // len(e.block_ids)
                            k = e.block_ids.index(b)
                            return tuple(e.token_ids[k * per:(k + 1) * per])
                        if kind in _ENDS_CONTENT:
                            return None
                    elif kind == EventKind.COPIED_ON_WRITE and b in e.new_block_ids:
                        return None  # a fresh private copy: written after this, not stored yet
                at = frame_seq - 1

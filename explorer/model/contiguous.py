"""What the same conversations would cost under the allocator paging replaced: one contiguous run of slots each.

Before PagedAttention, servers reserved every request's prompt plus its whole ``max_new_tokens`` budget up front, in
one run of memory (the source text: "if it reserves a large contiguous memory region in advance for each entire
future response, some space remains unused"). This model replays the live conversations of successive
:class:`PoolSnapshot` views through such an allocator, over the same total memory as the paged pool
(``num_blocks * block_size`` slots):

- a conversation asks for ``len(prompt_token_ids) + max_new_tokens`` slots when it first appears live;
- requests are admitted first come, first served (arrival step, then id), each at the lowest address where a free
  run is long enough (first fit); the head of the queue waits until it fits, and everyone behind it waits too;
- a reservation is released when the conversation finishes or ends (or leaves the snapshot); a reply re-queues it
  with its longer prompt, as a new request;
- a placed conversation's filled slots are the tokens whose K/V the paged engine holds for it
  (``num_computed_tokens``), so both views show the same decode progress.

The placement is state kept from frame to frame (a contiguous allocator cannot move what it placed). Numbers come
from the snapshot the model was last updated with. Pure numpy: no Qt, so it is tested on hand-built snapshots.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from kvstream.views import ConversationInfo, PoolSnapshot, Status

# What each slot of the contiguous memory holds, as drawn (values of ContiguousLayout.slot_roles).
FREE_SLOT = 0  # free and after the last reservation: usable by the next request that fits
FILLED_SLOT = 1  # reserved and holding K/V
RESERVED_SLOT = 2  # reserved for tokens not generated yet (and perhaps never: EOS may come first)
GAP_SLOT = 3  # free but stranded between reservations: external fragmentation


@dataclass(frozen=True)
class Reservation:
    """One conversation's run of slots."""

    conversation_id: int  # whose run it is
    start: int  # first slot of the run
    length: int  # prompt + max_new_tokens at admission
    filled: int  # slots holding K/V now (0..length)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ContiguousLayout:
    """The contiguous allocator's memory after one snapshot, and its counts for the summary line."""

    num_slots: int  # total memory, the same as the paged pool's num_blocks * block_size
    block_size: int  # the paged pool's block size (the drawing uses the same rows of slots)
    reservations: tuple[Reservation, ...]  # placed conversations, by start address
    waiting: tuple[int, ...]  # conversation ids in its queue, first come first
    never_fits: tuple[int, ...]  # ids whose request is larger than the whole memory (not in ``waiting``)
    paged_running: int  # conversations the paged engine runs now (status running)
    paged_waiting: int  # live conversations the paged engine has not admitted (waiting or preempted)

    @property
    def num_running(self) -> int:
        return len(self.reservations)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.never_fits)

    @property
    def num_reserved_slots(self) -> int:
        return sum(r.length for r in self.reservations)

    @property
    def num_filled_slots(self) -> int:
        return sum(r.filled for r in self.reservations)

    @property
    def num_reserved_empty_slots(self) -> int:
        """Reserved but holding nothing: the internal waste of contiguous reservation."""
        return self.num_reserved_slots - self.num_filled_slots

    @property
    def num_gap_slots(self) -> int:
        """Free slots before the end of the last reservation: holes between runs (external fragmentation)."""
        top = max((r.end for r in self.reservations), default=0)
        return top - sum(r.length for r in self.reservations)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self.num_reserved_slots

    @property
    def largest_free_run(self) -> int:
        """The longest request that could be placed now."""
        best, cursor = 0, 0
        for r in self.reservations:
            best = max(best, r.start - cursor)
            cursor = r.end
        return max(best, self.num_slots - cursor)

    def fraction(self, slots: int) -> float:
        return slots / self.num_slots if self.num_slots else 0.0

    def summary(self) -> str:
        """'paged: 24 running; contiguous: 9 running, 15 waiting, 61% of its memory reserved but empty, ...'."""
        paged = f"paged: {self.paged_running} running"
        if self.paged_waiting:
            paged += f", {self.paged_waiting} waiting"
        text = (f"{paged}; contiguous: {self.num_running} running, {self.num_waiting} waiting, "
                f"{_percent(self.fraction(self.num_reserved_empty_slots))} of its memory reserved but empty")
        if self.num_gap_slots:
            text += f", {_percent(self.fraction(self.num_gap_slots))} in gaps between reservations"
        if self.never_fits:
            text += f" ({len(self.never_fits)} can never fit)"
        return text

    def slot_roles(self) -> np.ndarray:
        """uint8 [num_slots]: FREE_SLOT, FILLED_SLOT, RESERVED_SLOT or GAP_SLOT for every slot (two slice
        assignments per run: runs are few, slots are up to millions)."""
        roles = np.full(self.num_slots, FREE_SLOT, np.uint8)
        top = max((r.end for r in self.reservations), default=0)
        roles[:top] = GAP_SLOT  # everything below the top that no run covers is a hole
        for r in self.reservations:
            roles[r.start:r.start + r.filled] = FILLED_SLOT
            roles[r.start + r.filled:r.end] = RESERVED_SLOT
        return roles

    def slot_owners(self) -> np.ndarray:
        """int64 [num_slots]: the conversation whose run holds each slot, -1 for free slots and gaps."""
        owners = np.full(self.num_slots, -1, np.int64)
        for r in self.reservations:
            owners[r.start:r.end] = r.conversation_id
        return owners

    def reservation_at(self, slot: int) -> Reservation | None:
        starts = [r.start for r in self.reservations]
        i = bisect.bisect_right(starts, slot) - 1
        if i >= 0 and self.reservations[i].start <= slot < self.reservations[i].end:
            return self.reservations[i]
        return None


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def request_slots(info: ConversationInfo) -> int:
    """What a contiguous allocator reserves for a conversation: its prompt plus its whole generation budget."""
    return len(info.prompt_token_ids) + info.max_new_tokens


class ContiguousAllocator:
    """First-fit contiguous reservation with a first-come-first-served queue, fed one snapshot at a time.

    Call :meth:`update` with every new snapshot (in order). A snapshot of another pool (other size or block size),
    or one older than the last (the user scrubbed back in history), starts the placement over from that snapshot.
    """

    def __init__(self):
        self._key: tuple | None = None  # (num_blocks, block_size, source) of the pool being followed
        self._step = -1  # step of the last snapshot seen
        self._placed: dict[int, tuple[int, int, int]] = {}  # id -> (start, length, arrival step it was placed for)
        self._runs: list[tuple[int, int]] = []  # (start, length) of every placed run, by start (for first fit)
        self._queue: list[tuple[int, int, int]] = []  # (arrival step, id, length), first come first
        self.layout: ContiguousLayout | None = None  # the result of the last update

    def reset(self) -> None:
        self._key, self._step = None, -1
        self._placed.clear()
        self._runs.clear()
        self._queue.clear()
        self.layout = None

    def update(self, snapshot: PoolSnapshot) -> ContiguousLayout:
        key = (snapshot.num_blocks, snapshot.block_size, snapshot.source)
        if key != self._key or snapshot.step_id < self._step:
            self.reset()
            self._key = key
        self._step = snapshot.step_id
        num_slots = snapshot.num_blocks * snapshot.block_size
        live = {c.conversation_id: c for c in snapshot.conversations if c.is_live}

        # Release what finished, ended or left; a conversation continued since it was placed asks again.
        for cid, (_, _, arrival) in list(self._placed.items()):
            info = live.get(cid)
            if info is None or info.arrival_step != arrival:
                del self._placed[cid]
        self._runs = sorted((start, length) for start, length, _ in self._placed.values())
        self._queue = [(arrival, cid, length) for arrival, cid, length in self._queue
                       if cid in live and live[cid].arrival_step == arrival]
        known = set(self._placed) | {cid for _, cid, _ in self._queue}
        arrivals = sorted((c.arrival_step, c.conversation_id, request_slots(c)) for cid, c in live.items()
                          if cid not in known)
        self._queue.extend(arrivals)
        self._queue.sort()  # stable order of arrival, even when several arrive in one frame

        never = tuple(cid for _, cid, length in self._queue if length > num_slots)
        queue = [entry for entry in self._queue if entry[2] <= num_slots]
        admitted = 0
        for arrival, cid, length in queue:  # first come first served: the head waits for room, and so does
            start = self._first_fit(length, num_slots)  # everyone behind it
            if start is None:
                break
            self._placed[cid] = (start, length, arrival)
            bisect.insort(self._runs, (start, length))
            admitted += 1
        queue = queue[admitted:]
        self._queue = queue + [entry for entry in self._queue if entry[2] > num_slots]

        reservations = tuple(sorted(
            (Reservation(cid, start, length, int(min(max(live[cid].num_computed_tokens, 0), length)))
             for cid, (start, length, _) in self._placed.items()), key=lambda r: r.start))
        running = sum(1 for c in live.values() if c.status == Status.RUNNING)
        self.layout = ContiguousLayout(
            num_slots=num_slots, block_size=snapshot.block_size, reservations=reservations,
            waiting=tuple(cid for _, cid, _ in queue), never_fits=never, paged_running=running,
            paged_waiting=len(live) - running)
        return self.layout

    def _first_fit(self, length: int, num_slots: int) -> int | None:
        """Lowest address of a free run of at least ``length`` slots, or None."""
        cursor = 0
        for start, run in self._runs:
            if start - cursor >= length:
                return cursor
            cursor = start + run
        return cursor if num_slots - cursor >= length else None

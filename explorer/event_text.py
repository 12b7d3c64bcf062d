"""Block events in plain words, for the event log, the timeline's tooltips and a block's own history.

``describe`` turns one :class:`kvstream.events.BlockEvent` into a sentence ("step 230: block 17 copied on write
to 42 for conversation 7"). ``group`` goes one step further for the events of one frame: the engine reports a
fork as two events (the conversation added, then its shared blocks) and a finish or preemption as one event plus
a release per block state, but a reader wants one line for each story. Qt-free, so tests and headless tools can
use it; the widgets only lay the lines out.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

from kvstream.events import BlockEvent, EventKind
from kvstream.views import FinishReason

ID_LIMIT = 8  # ids listed before "and N more"

_RELEASE_KINDS = (EventKind.RELEASED, EventKind.CACHED, EventKind.FREED)
_LIFECYCLE_KINDS = (EventKind.PREEMPTED, EventKind.CONVERSATION_FINISHED, EventKind.CONVERSATION_ENDED)


def id_list(ids: Sequence[int], limit: int = ID_LIMIT) -> str:
    """'4, 9, 17', or '4, 9, 17 and 12 more' past ``limit`` ids (ids in the order given)."""
    ids = list(ids)
    head = ", ".join(str(i) for i in ids[:limit])
    return head + (f" and {len(ids) - limit:,} more" if len(ids) > limit else "")


def blocks_phrase(ids: Sequence[int], limit: int = ID_LIMIT) -> str:
    """'block 4' or 'blocks 4, 9 and 3 more'."""
    return f"block{'s' if len(ids) != 1 else ''} {id_list(ids, limit)}" if ids else "no blocks"


def count_phrase(n: int, word: str) -> str:
    """'1 block', '2,304 blocks'."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def finish_words(reason: str) -> str:
    """A FinishReason value as the window says it ('max new tokens'); an unknown reason as it is."""
    try:
        return FinishReason(reason).words
    except ValueError:
        return reason


def describe(event: BlockEvent, step: bool = True) -> str:
    """One event as a sentence; with ``step`` it starts 'step 212: '."""
    if not isinstance(event, BlockEvent):
        raise TypeError(f"describe() takes a kvstream.events.BlockEvent, not {type(event).__name__}")
    text = _event_text(event)
    return f"step {event.step_id:,}: {text}" if step else text


def _conv(cid: int) -> str:
    return f"conversation {cid}"


def _event_text(e: BlockEvent) -> str:
    kind, cid, ids = e.kind, e.conversation_id, e.block_ids
    who = _conv(cid)
    if kind == EventKind.CONVERSATION_ADDED:
        if e.reason == "fork":
            return f"{who} forked from {e.other_id}" if e.other_id >= 0 else f"{who} added as a fork"
        if e.reason == "sample":
            return (f"{who} added, another sample of the request of conversation {e.other_id}"
                    if e.other_id >= 0 else f"{who} added, one more sample of the same request")
        return f"{who} added"
    if kind == EventKind.CONVERSATION_CONTINUED:
        return f"{who} got a reply and waits to run again"
    if kind == EventKind.CONVERSATION_FINISHED:
        return f"{who} finished ({finish_words(e.reason)})" if e.reason else f"{who} finished"
    if kind == EventKind.CONVERSATION_ENDED:
        return f"{who} ended by the user"
    if kind == EventKind.ALLOCATED:
        return f"{who} took new {blocks_phrase(ids)}"
    if kind == EventKind.SHARED:
        if e.reason == "prefix_hit":
            if len(ids) == 1:
                return f"{who} reused cached block {ids[0]} of its prompt"
            return f"{who} reused {len(ids):,} cached blocks ({id_list(ids)}) of its prompt"
        if e.reason == "fork" and e.other_id >= 0:
            return f"{who} shares {blocks_phrase(ids)} with conversation {e.other_id} (fork)"
        return f"{who} took one more reference to {blocks_phrase(ids)}"
    if kind == EventKind.COPIED_ON_WRITE:
        src = ids[0] if ids else "?"
        dst = e.new_block_ids[0] if e.new_block_ids else "?"
        return f"block {src} copied on write to {dst} for {who}"
    if kind == EventKind.STORED:
        owner = f" of {who}" if cid >= 0 else ""
        return f"{blocks_phrase(ids)}{owner} full and hashed"
    if kind == EventKind.RELEASED:
        return f"{who} let go of {blocks_phrase(ids)}, still held by others"
    if kind == EventKind.CACHED:
        return f"{who} let go of {blocks_phrase(ids)}: free, KV kept cached for reuse"
    if kind == EventKind.FREED:
        return f"{who} let go of {blocks_phrase(ids)}: free"
    if kind == EventKind.EVICTED:
        cached = f"cached {blocks_phrase(ids)}"
        return f"{cached} evicted for {who}" if cid >= 0 else f"{cached} evicted"
    if kind == EventKind.PREEMPTED:
        return f"{who} preempted: lost {blocks_phrase(ids)}; it will be recomputed"
    if kind == EventKind.RELOCATED:
        if not ids:
            return "every block moved: nothing to move"
        return f"every block moved: {count_phrase(len(ids), 'block')} to new ids"
    if kind == EventKind.CLEARED:
        return "prefix cache cleared: every hash dropped, cached blocks freed"
    return f"{kind.value} ({blocks_phrase(ids)})"  # a kind added to EventKind after this file


@dataclass(frozen=True)
class EventLine:
    """One line of the event log: a single event, or the few events of one frame that tell one story.

    A fork (CONVERSATION_ADDED "fork" + SHARED "fork") and a finish, end or preemption with the releases it caused
    are one line each; the line keeps its events so a filter on any of their kinds, conversations or blocks
    still finds it. Its words and block list are made on first use: a busy engine reports far more events than
    anyone reads, and most lines are filtered out or dropped unseen.
    """

    step_id: int  # the step of its first event
    kind: EventKind  # the kind the line is about (its first event's, or the lifecycle event's)
    kinds: frozenset  # EventKind of every event in the line
    conversation_id: int  # the conversation it is about; -1 for pool-wide lines (relocation, reset)
    conversation_ids: frozenset  # every conversation it names (its own, a fork's parent)
    events: tuple  # the BlockEvents it stands for, in arrival order (the lead event first)

    @cached_property
    def text(self) -> str:
        """The sentence without the "step N: " prefix."""
        return _event_text(self.events[0]) if len(self.events) == 1 else _group_text(self.events)

    @cached_property
    def block_ids(self) -> tuple:
        """Every block it names, first mention first (relocation and copy targets included)."""
        if len(self.events) == 1 and not self.events[0].new_block_ids:
            return tuple(dict.fromkeys(self.events[0].block_ids))
        blocks: dict[int, None] = {}  # an ordered set
        for e in self.events:
            blocks.update(dict.fromkeys(e.block_ids))
            blocks.update(dict.fromkeys(e.new_block_ids))
        return tuple(blocks)

    @property
    def sentence(self) -> str:
        """'step 212: conversation 7 forked from 3, shares blocks 4, 9, 17'."""
        return f"step {self.step_id:,}: {self.text}"

    @property
    def block_id(self) -> int:
        """The block to select when the line is clicked: the first it names (a copy-on-write's copy), -1 none."""
        if self.kind == EventKind.COPIED_ON_WRITE and self.events[0].new_block_ids:
            return self.events[0].new_block_ids[0]
        if self.kind == EventKind.RELOCATED:
            return -1  # every block: nothing in particular to select
        return self.block_ids[0] if self.block_ids else -1


def _line(events: Sequence[BlockEvent]) -> EventLine:
    main = events[0]
    if len(events) == 1:  # the common case, kept cheap
        ids = {main.conversation_id, main.other_id} - {-1}
        return EventLine(main.step_id, main.kind, frozenset((main.kind,)), main.conversation_id,
                         frozenset(i for i in ids if i >= 0), (main,))
    conversations = {e.conversation_id for e in events if e.conversation_id >= 0}
    conversations |= {e.other_id for e in events if e.other_id >= 0}
    return EventLine(main.step_id, main.kind, frozenset(e.kind for e in events), main.conversation_id,
                     frozenset(conversations), tuple(events))


def line_of(event: BlockEvent) -> EventLine:
    """A line for one event on its own."""
    if not isinstance(event, BlockEvent):
        raise TypeError(f"line_of() takes a kvstream.events.BlockEvent, not {type(event).__name__}")
    return _line([event])


def group(events: Iterable[BlockEvent]) -> list[EventLine]:
    """The events of ONE frame as log lines, in arrival order, with the events that tell one story merged.

    - a fork: CONVERSATION_ADDED (reason "fork") and the SHARED (reason "fork") of the same conversation;
    - a preemption, finish or end with the RELEASED / CACHED / FREED of that conversation in the same frame and
      step, before or after it (the engine releases a finished conversation's blocks first, a preempted one's
      after); for a preemption, only releases of blocks it lost.
    Everything else is a line of its own.
    """
    events = list(events)
    for e in events:
        if not isinstance(e, BlockEvent):
            raise TypeError(f"group() takes kvstream.events.BlockEvent items, not {type(e).__name__}")
    attached: dict[int, list[int]] = {}  # index of a lead event -> indices of the events merged into it
    taken: set[int] = set()
    forks = {e.conversation_id: i for i, e in enumerate(events)
             if e.kind == EventKind.CONVERSATION_ADDED and e.reason == "fork"}
    lifecycle: dict[int, list[int]] = {}  # conversation -> indices of its preempted/finished/ended events
    for i, e in enumerate(events):
        if e.kind in _LIFECYCLE_KINDS:
            lifecycle.setdefault(e.conversation_id, []).append(i)
    for i, e in enumerate(events):
        if e.kind == EventKind.SHARED and e.reason == "fork" and e.conversation_id in forks:
            lead = forks[e.conversation_id]
            if not attached.get(lead):  # one SHARED per fork
                attached.setdefault(lead, []).append(i)
                taken.add(i)
        elif e.kind in _RELEASE_KINDS and e.conversation_id in lifecycle:
            lead = _nearest_lead(events, lifecycle[e.conversation_id], i, e)
            if lead is not None:
                attached.setdefault(lead, []).append(i)
                taken.add(i)
    lines = []
    for i, e in enumerate(events):
        if i in taken:
            continue
        lines.append(_line([e] + [events[j] for j in attached.get(i, ())]))
    return lines


def _nearest_lead(events, leads: list[int], i: int, release: BlockEvent) -> int | None:
    """The lifecycle event a release belongs to: the closest one before it, else the closest after it."""
    fits = [j for j in leads if events[j].step_id == release.step_id and (
        events[j].kind != EventKind.PREEMPTED or set(release.block_ids) <= set(events[j].block_ids))]
    before = [j for j in fits if j < i]
    if before:
        return before[-1]
    after = [j for j in fits if j > i]
    return after[0] if after else None


def _group_text(members: Sequence[BlockEvent]) -> str:
    """The words of a merged line: a fork with its shared blocks, or a lifecycle event with its releases."""
    lead = members[0]
    who = _conv(lead.conversation_id)
    if lead.kind == EventKind.CONVERSATION_ADDED:  # a fork with its shared blocks
        parent = lead.other_id if lead.other_id >= 0 else members[1].other_id
        return f"{who} forked from {parent}, shares {blocks_phrase(members[1].block_ids)}"
    releases = members[1:]
    blocks = [b for e in releases for b in e.block_ids]
    counts = {k: sum(len(e.block_ids) for e in releases if e.kind == k) for k in _RELEASE_KINDS}
    parts = [f"{counts[EventKind.CACHED]:,} kept cached" if counts[EventKind.CACHED] else "",
             f"{counts[EventKind.FREED]:,} freed" if counts[EventKind.FREED] else "",
             f"{counts[EventKind.RELEASED]:,} still held by others" if counts[EventKind.RELEASED] else ""]
    fate = ", ".join(p for p in parts if p)
    if lead.kind == EventKind.PREEMPTED:
        lost = lead.block_ids or tuple(blocks)
        return f"{who} preempted: lost {blocks_phrase(lost)} ({fate}); it will be recomputed"
    return f"{_event_text(lead)}, let go of {blocks_phrase(blocks)}: {fate}"

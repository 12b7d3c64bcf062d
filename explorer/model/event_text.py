"""Block events in plain words, for the event log, the timeline's tooltips and a block's own history.

``describe`` turns one :class:`kvstream.events.BlockEvent` into a sentence ("step 230: block 17 copied on write
to 42 for conversation 7"). ``group`` goes one step further for the events of one frame: the engine reports a
fork as two events (the conversation added, then its shared blocks) and a finish or preemption as one event plus
a release per block state, but a reader wants one line for each story. Every kind's wording lives in one
table, :data:`PHRASES`: the event as a whole, and what it did to one block it names (:func:`block_phrase`, which a
block's own history uses). Qt-free, so tests and headless tools can use it; the widgets only lay the lines out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

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


FINISH_WORDS = {FinishReason.EOS: "end-of-sequence", FinishReason.LENGTH: "max new tokens",
                FinishReason.CONTEXT: "context limit", FinishReason.ENDED: "ended by user",
                FinishReason.NON_FINITE: "stopped: the model's output was NaN or infinite"}  # how the window says it


CLIENT_LEFT = "the client left"  # FinishReason.ENDED of a conversation the served traffic sent: its client went away


def finish_words(reason: str, served: bool = False) -> str:
    """A FinishReason value as the window says it ('max new tokens'); an unknown reason as it is. ``served``: the
    conversation is the served traffic's, so an end was its client's doing, not the user's."""
    try:
        reason = FinishReason(reason)
    except ValueError:
        return reason
    return CLIENT_LEFT if served and reason == FinishReason.ENDED else FINISH_WORDS[reason]


def describe(event: BlockEvent, step: bool = True, served=()) -> str:
    """One event as a sentence; with ``step`` it starts 'step 212: '. ``served``: the ids of the conversations the
    served traffic sent (what they do is their client's, not the user's)."""
    if not isinstance(event, BlockEvent):
        raise TypeError(f"describe() takes a kvstream.events.BlockEvent, not {type(event).__name__}")
    text = _event_text(event, _by_client(event, served))
    return f"step {event.step_id:,}: {text}" if step else text


def _conv(cid: int) -> str:
    return f"conversation {cid}"


# ---- one phrase per kind: the whole event (the log) and what it did to one block (that block's own history) -------
# Each kind's two wordings sit side by side, so a change to how an event reads is made once, in one place.
# ``bid`` is the block's id at that event; ``hashed`` whether it held a prefix hash just before (None: unknown).

def _added(e: BlockEvent) -> str:
    who = _conv(e.conversation_id)
    if e.reason == "fork":
        return f"{who} forked from {e.other_id}" if e.other_id >= 0 else f"{who} added as a fork"
    if e.reason == "sample":
        return (f"{who} added, another sample of the request of conversation {e.other_id}"
                if e.other_id >= 0 else f"{who} added, one more sample of the same request")
    return f"{who} added"


def _finished(e: BlockEvent) -> str:
    who = _conv(e.conversation_id)
    return f"{who} finished ({finish_words(e.reason)})" if e.reason else f"{who} finished"


def _shared(e: BlockEvent) -> str:
    who, ids = _conv(e.conversation_id), e.block_ids
    if e.reason == "prefix_hit":
        if len(ids) == 1:
            return f"{who} reused cached block {ids[0]} of its prompt"
        return f"{who} reused {len(ids):,} cached blocks ({id_list(ids)}) of its prompt"
    if e.reason == "fork" and e.other_id >= 0:
        return f"{who} shares {blocks_phrase(ids)} with conversation {e.other_id} (fork)"
    return f"{who} took one more reference to {blocks_phrase(ids)}"


def _shared_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    who = _conv(e.conversation_id)
    if e.reason == "prefix_hit":
        return f"{who} reused it for its prompt (prefix cache hit)"
    if e.reason == "fork":
        return f"shared with {who}, a fork of conversation {e.other_id}"
    return f"{who} took one more reference to it"


def _copied(e: BlockEvent) -> str:
    src = e.block_ids[0] if e.block_ids else "?"
    dst = e.new_block_ids[0] if e.new_block_ids else "?"
    return f"block {src} copied on write to {dst} for {_conv(e.conversation_id)}"


def _copied_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    who, src, dst = _conv(e.conversation_id), e.block_ids[0], e.new_block_ids[0]
    if bid == dst and bid != src:
        return f"made for {who} as a copy of block {src} (copy on write)"
    return f"{who} wrote into it while shared: copied to block {dst}, which {who} holds instead"


def _stored(e: BlockEvent) -> str:
    owner = f" of {_conv(e.conversation_id)}" if e.conversation_id >= 0 else ""
    return f"{blocks_phrase(e.block_ids)}{owner} full and hashed"


def _group_words(e: BlockEvent) -> str:
    """', group 1' for an event of a KV cache group other than the first (the inspector names the hash so too)."""
    return f", group {e.group}" if e.group else ""


def _stored_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    k = e.block_ids.index(bid)
    digest = f" (hash {e.block_hashes[k]:016x}{_group_words(e)})" if k < len(e.block_hashes) else ""
    owner = f" for {_conv(e.conversation_id)}" if e.conversation_id >= 0 else ""
    return f"full and hashed{owner}{digest}: a prompt with this prefix can reuse it"


def _evicted(e: BlockEvent) -> str:
    cached = f"cached {blocks_phrase(e.block_ids)}"
    return f"{cached} evicted for {_conv(e.conversation_id)}" if e.conversation_id >= 0 else f"{cached} evicted"


def _evicted_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    if e.conversation_id >= 0:
        return f"evicted: its cached KV dropped so {_conv(e.conversation_id)} could have it"
    return "evicted: its cached KV dropped"


def _relocated(e: BlockEvent) -> str:
    if not e.block_ids:
        return "every block moved: nothing to move"
    return f"every block moved: {count_phrase(len(e.block_ids), 'block')} to new ids"


def _relocated_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    if bid in e.new_block_ids:
        old = e.block_ids[e.new_block_ids.index(bid)]
        return f"moved from {old} to {bid} (every block moved)" if old != bid else \
            f"stayed at {bid} when every block moved"
    if bid in e.block_ids:
        new = e.new_block_ids[e.block_ids.index(bid)]
        return f"every block moved: what block {bid} held went to block {new}; nothing moved in"
    return f"every block moved; block {bid} was free and stayed free"


def _cleared_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    if hashed is False:
        return ""  # nothing to drop
    return "prefix cache cleared: its hash dropped" if hashed else "prefix cache cleared: any hash it had was dropped"


def _no_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    return ""  # conversation events name no blocks


def _for(words: str):
    """A per-block phrase that only names the event's conversation: ``words`` with {who} filled in."""
    return lambda e, bid, hashed: words.format(who=_conv(e.conversation_id))


def _hashes(e: BlockEvent, limit: int = ID_LIMIT) -> str:
    """'hash ab12' or 'hashes ab12, cd34' (the first four hex digits; the inspector gives all sixteen)."""
    if not e.block_hashes:
        return ""
    short = [f"{int(h):016x}"[:4] for h in e.block_hashes]
    return f"hash{'es' if len(short) != 1 else ''} {id_list(short, limit)}"


def _slots(e: BlockEvent) -> str:
    """'host slot 3' or 'host slots 3, 4'."""
    slots = tuple(e.tier_slots)
    tier = e.tier or "a tier"
    return f"{tier} slot{'s' if len(slots) != 1 else ''} {id_list(slots)}" if slots else tier


def _offloaded(e: BlockEvent) -> str:
    what = f"{blocks_phrase(e.block_ids)} ({_hashes(e)})" if e.block_ids else _hashes(e) or "KV"
    came = f" from {e.reason}" if not e.block_ids and e.reason else ""
    return f"{what} offloaded to {_slots(e)}{came}"


def _loaded(e: BlockEvent) -> str:
    who = f" for {_conv(e.conversation_id)}" if e.conversation_id >= 0 else ""
    into = f" into {blocks_phrase(e.block_ids)}" if e.block_ids else ""
    return f"{_slots(e)} ({_hashes(e)}) loaded{into}{who}: a prefix hit, not recomputed"


def _dropped(e: BlockEvent) -> str:
    fate = f": moved on to {e.reason}" if e.reason else ": its KV is gone"
    return f"{_slots(e)} ({_hashes(e)}) dropped{fate}"


def _tier_block(e: BlockEvent, bid: int, hashed: bool | None) -> str:
    k = e.block_ids.index(bid) if bid in e.block_ids else -1
    slot = f" slot {e.tier_slots[k]}" if 0 <= k < len(e.tier_slots) else ""
    digest = f" (hash {int(e.block_hashes[k]):016x}{_group_words(e)})" if 0 <= k < len(e.block_hashes) else ""
    if e.kind == EventKind.OFFLOADED:
        return f"its KV{digest} offloaded to {e.tier or 'a tier'}{slot}"
    if e.kind == EventKind.LOADED:
        who = f" for {_conv(e.conversation_id)}" if e.conversation_id >= 0 else ""
        return f"filled from {e.tier or 'a tier'}{slot}{digest}{who} (loaded, not recomputed)"
    return ""


def _window_released(e: BlockEvent) -> str:
    return (f"{_conv(e.conversation_id)}'s sliding window (group {e.group}) let go of {blocks_phrase(e.block_ids)}: "
            f"out of the window, never read again")


@dataclass(frozen=True)
class Phrase:
    """How one kind of block event reads: as a whole (the event log) and for one block it names (block history)."""

    event: Callable[[BlockEvent], str]  # the event in words, without "step N: "
    block: Callable[[BlockEvent, int, bool | None], str]  # (event, block id then, hashed before) -> words; "": none


PHRASES: dict[EventKind, Phrase] = {
    EventKind.CONVERSATION_ADDED: Phrase(_added, _no_block),
    EventKind.CONVERSATION_CONTINUED: Phrase(
        lambda e: f"{_conv(e.conversation_id)} got a reply and waits to run again", _no_block),
    EventKind.CONVERSATION_FINISHED: Phrase(_finished, _no_block),
    EventKind.CONVERSATION_ENDED: Phrase(lambda e: f"{_conv(e.conversation_id)} ended by the user", _no_block),
    EventKind.ALLOCATED: Phrase(lambda e: f"{_conv(e.conversation_id)} took new {blocks_phrase(e.block_ids)}",
                                _for("allocated to {who}")),
    EventKind.SHARED: Phrase(_shared, _shared_block),
    EventKind.COPIED_ON_WRITE: Phrase(_copied, _copied_block),
    EventKind.STORED: Phrase(_stored, _stored_block),
    EventKind.RELEASED: Phrase(
        lambda e: f"{_conv(e.conversation_id)} let go of {blocks_phrase(e.block_ids)}, still held by others",
        _for("{who} let go of it; others still hold it")),
    EventKind.CACHED: Phrase(
        lambda e: f"{_conv(e.conversation_id)} let go of {blocks_phrase(e.block_ids)}: free, KV kept cached for reuse",
        _for("{who} let go of it: free, KV kept cached for reuse")),
    EventKind.FREED: Phrase(lambda e: f"{_conv(e.conversation_id)} let go of {blocks_phrase(e.block_ids)}: free",
                            _for("{who} let go of it: free")),
    EventKind.EVICTED: Phrase(_evicted, _evicted_block),
    EventKind.PREEMPTED: Phrase(
        lambda e: f"{_conv(e.conversation_id)} preempted: lost {blocks_phrase(e.block_ids)}; it will be recomputed",
        _for("{who} preempted: lost it (to be recomputed)")),
    EventKind.RELOCATED: Phrase(_relocated, _relocated_block),
    EventKind.CLEARED: Phrase(lambda e: "prefix cache cleared: every hash dropped, cached blocks freed",
                              _cleared_block),
    EventKind.OFFLOADED: Phrase(_offloaded, _tier_block),
    EventKind.LOADED: Phrase(_loaded, _tier_block),
    EventKind.DROPPED: Phrase(_dropped, _tier_block),
    EventKind.WINDOW_RELEASED: Phrase(_window_released, lambda e, bid, hashed: (
        f"{_conv(e.conversation_id)}'s sliding window (group {e.group}) let go of it: out of the window")),
}


# what a served conversation's client did, in its own words (the PHRASES' are the user's)
CLIENT_PHRASES = {EventKind.CONVERSATION_CONTINUED: "{who}: the client replied; it waits to run again",
                  EventKind.CONVERSATION_ENDED: "{who} ended: the client left"}


def _by_client(e: BlockEvent, served) -> bool:
    """Whether ``e`` is something a served conversation's client did (a reply, an end)."""
    return e.kind in CLIENT_PHRASES and e.conversation_id in served


def _event_text(e: BlockEvent, client: bool = False) -> str:
    if client:
        return CLIENT_PHRASES[e.kind].format(who=_conv(e.conversation_id))
    phrase = PHRASES.get(e.kind)
    if phrase is None:  # a kind added to EventKind after this file
        return f"{e.kind.value} ({blocks_phrase(e.block_ids)})"
    return phrase.event(e)


def block_phrase(event: BlockEvent, block_id: int, hashed: bool | None = None) -> str:
    """What ``event`` did to the one block that had id ``block_id`` at that event, in words ("" when there is
    nothing to say for a block: a conversation event, or a reset of a block that held no hash). ``hashed``: whether
    that block held a prefix hash just before (None: not known)."""
    if not isinstance(event, BlockEvent):
        raise TypeError(f"block_phrase() takes a kvstream.events.BlockEvent, not {type(event).__name__}")
    phrase = PHRASES.get(event.kind)
    return "" if phrase is None else phrase.block(event, int(block_id), hashed)


class EventLine:
    """One line of the event log: a single event, or the few events of one frame that tell one story.

    A fork (CONVERSATION_ADDED "fork" + SHARED "fork") and a finish, end or preemption with the releases it caused
    are one line each; the line keeps its events so a filter on any of their kinds, conversations or blocks
    still finds it. Its words and block list are made on first use: a busy engine reports far more events than
    anyone reads, and most lines are filtered out or dropped unseen. A plain class with slots, not a dataclass: a
    busy pool makes thousands of lines a frame, and a frozen dataclass's constructor is much slower (figures:
    docs/performance.md, "Event log").
    Lines are never changed once made.
    """

    __slots__ = ("step_id", "kind", "kinds", "conversation_id", "conversation_ids", "events", "_text", "_block_ids",
                 "client")

    def __init__(self, step_id: int, kind: EventKind, kinds: frozenset, conversation_id: int,
                 conversation_ids: frozenset, events: tuple, client: bool = False):
        self.step_id = step_id  # the step of its first event
        self.kind = kind  # the kind the line is about (its first event's, or the lifecycle event's)
        self.kinds = kinds  # EventKind of every event in the line
        self.conversation_id = conversation_id  # the conversation it is about; -1 for pool-wide lines
        self.conversation_ids = conversation_ids  # every conversation it names (its own, a fork's parent)
        self.events = events  # the BlockEvents it stands for, in arrival order (the lead event first)
        self._text: str | None = None
        self._block_ids: tuple | None = None
        self.client = client  # its lead event is a served conversation's client's doing (a reply, an end)

    def __repr__(self) -> str:
        return f"EventLine({self.step_id}, {self.kind.name}, {len(self.events)} events)"

    def __eq__(self, other) -> bool:
        return isinstance(other, EventLine) and (self.step_id, self.kind, self.conversation_id, self.events) == (
            other.step_id, other.kind, other.conversation_id, other.events)

    def __hash__(self) -> int:
        return hash((self.step_id, self.kind, self.conversation_id, self.events))

    @property
    def text(self) -> str:
        """The sentence without the "step N: " prefix."""
        if self._text is None:
            self._text = (_event_text(self.events[0], self.client) if len(self.events) == 1
                          else _group_text(self.events, self.client))
        return self._text

    @property
    def block_ids(self) -> tuple:
        """Every block it names, first mention first (relocation and copy targets included)."""
        if self._block_ids is None:
            if len(self.events) == 1 and not self.events[0].new_block_ids:
                self._block_ids = tuple(dict.fromkeys(self.events[0].block_ids))
            else:
                blocks: dict[int, None] = {}  # an ordered set
                for e in self.events:
                    blocks.update(dict.fromkeys(e.block_ids))
                    blocks.update(dict.fromkeys(e.new_block_ids))
                self._block_ids = tuple(blocks)
        return self._block_ids

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


_KIND_SETS = {k: frozenset((k,)) for k in EventKind}  # a single event's ``kinds``, shared by every such line
_NOBODY = frozenset()
# kinds that lead a merged line (a fork's CONVERSATION_ADDED, the lifecycle events): a frame without any of them
# is one line per event, made without looking for stories
_LEAD_KINDS = frozenset((EventKind.CONVERSATION_ADDED, *_LIFECYCLE_KINDS))


def _single(e: BlockEvent) -> EventLine:
    """The line of one event on its own: the common case (a busy engine sends thousands a frame), kept cheap."""
    cid, other = e.conversation_id, e.other_id
    if other < 0 or other == cid:
        ids = frozenset((cid,)) if cid >= 0 else _NOBODY
    else:
        ids = frozenset((cid, other)) if cid >= 0 else frozenset((other,))
    return EventLine(e.step_id, e.kind, _KIND_SETS[e.kind], cid, ids, (e,))


def _line(events: Sequence[BlockEvent]) -> EventLine:
    main = events[0]
    if len(events) == 1:
        return _single(main)
    conversations = {e.conversation_id for e in events if e.conversation_id >= 0}
    conversations |= {e.other_id for e in events if e.other_id >= 0}
    return EventLine(main.step_id, main.kind, frozenset(e.kind for e in events), main.conversation_id,
                     frozenset(conversations), tuple(events))


def line_of(event: BlockEvent) -> EventLine:
    """A line for one event on its own."""
    if not isinstance(event, BlockEvent):
        raise TypeError(f"line_of() takes a kvstream.events.BlockEvent, not {type(event).__name__}")
    return _line([event])


def group(events: Iterable[BlockEvent], served=()) -> list[EventLine]:
    """The events of ONE frame as log lines, in arrival order, with the events that tell one story merged.
    ``served``: the ids of the conversations the served traffic sent (their replies and ends are worded as their
    client's).

    - a fork: CONVERSATION_ADDED (reason "fork") and the SHARED (reason "fork") of the same conversation;
    - a preemption, finish or end with the RELEASED / CACHED / FREED of that conversation in the same frame and
      step, before or after it (the engine releases a finished conversation's blocks first, a preempted one's
      after); for a preemption, only releases of blocks it lost.
    Everything else is a line of its own.
    """
    events = list(events)
    kinds = set()
    for e in events:
        if type(e) is not BlockEvent and not isinstance(e, BlockEvent):
            raise TypeError(f"group() takes kvstream.events.BlockEvent items, not {type(e).__name__}")
        kinds.add(e.kind)
    if served and not kinds.isdisjoint(CLIENT_PHRASES):
        return [_as_client(line, served) for line in group(events)]
    if kinds.isdisjoint(_LEAD_KINDS):  # nothing to merge: no fork, no finish, end or preemption
        return [_single(e) for e in events]
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


def _as_client(line: EventLine, served) -> EventLine:
    """``line``, marked as its client's doing when its lead event is a served conversation's reply or end (before
    anyone has read its words: they are made on first use)."""
    line.client = _by_client(line.events[0], served)
    return line


def _group_text(members: Sequence[BlockEvent], client: bool = False) -> str:
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
    return f"{_event_text(lead, client)}, let go of {blocks_phrase(blocks)}: {fate}"

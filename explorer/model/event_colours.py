"""One colour per block-event kind, shared by the timeline's markers and the event log's swatches.

Kept apart from both widgets (and free of Qt) so that a marker on the timeline and the line it points to in the
log are always the same colour. The loud colours go to what a user hunts for (copy-on-write, eviction,
preemption, relocation); the routine allocation and release kinds get quiet greys and blues.
"""
from __future__ import annotations

from kvstream.events import EventKind

KIND_COLOURS: dict[EventKind, tuple[int, int, int]] = {
    EventKind.CONVERSATION_ADDED: (90, 200, 120),  # green: a conversation appears
    EventKind.CONVERSATION_CONTINUED: (150, 220, 110),  # light green: it got a reply
    EventKind.CONVERSATION_FINISHED: (110, 160, 230),  # blue: done on its own
    EventKind.CONVERSATION_ENDED: (170, 130, 230),  # violet: ended by the user
    EventKind.ALLOCATED: (140, 140, 150),  # grey: routine
    EventKind.SHARED: (80, 200, 210),  # cyan: a prefix hit or a fork's shared blocks
    EventKind.COPIED_ON_WRITE: (250, 165, 40),  # orange: a shared block split
    EventKind.STORED: (120, 120, 170),  # muted blue: a full block hashed
    EventKind.RELEASED: (125, 125, 135),  # grey
    EventKind.CACHED: (100, 130, 190),  # muted blue: freed but reusable
    EventKind.FREED: (105, 105, 112),  # dark grey
    EventKind.EVICTED: (235, 75, 65),  # red: reusable KV lost
    EventKind.PREEMPTED: (230, 70, 200),  # magenta: a conversation lost its blocks
    EventKind.RELOCATED: (250, 225, 60),  # yellow: every block moved
    EventKind.CLEARED: (240, 240, 240),  # white: the whole prefix cache dropped
    EventKind.OFFLOADED: (70, 160, 250),  # sky blue: KV went down a tier (kept, not lost)
    EventKind.LOADED: (110, 235, 190),  # mint: KV came back up from a tier instead of being recomputed
    EventKind.DROPPED: (190, 100, 70),  # brick: a tier let go of KV
    EventKind.WINDOW_RELEASED: (225, 120, 35),  # amber: a sliding window let go of blocks it never reads again
}

# Which kind wins when several land on the same pixel column of the timeline: the rarer and more telling first.
KIND_PRIORITY: tuple[EventKind, ...] = (
    EventKind.RELOCATED, EventKind.CLEARED, EventKind.PREEMPTED, EventKind.EVICTED, EventKind.DROPPED,
    EventKind.LOADED, EventKind.OFFLOADED, EventKind.WINDOW_RELEASED, EventKind.COPIED_ON_WRITE,
    EventKind.CONVERSATION_ENDED, EventKind.CONVERSATION_FINISHED, EventKind.CONVERSATION_CONTINUED,
    EventKind.CONVERSATION_ADDED, EventKind.SHARED, EventKind.STORED, EventKind.CACHED,
    EventKind.RELEASED, EventKind.FREED, EventKind.ALLOCATED,
)

# Short names for legends and menus.
KIND_NAMES: dict[EventKind, str] = {
    EventKind.CONVERSATION_ADDED: "conversation added",
    EventKind.CONVERSATION_CONTINUED: "conversation continued",
    EventKind.CONVERSATION_FINISHED: "conversation finished",
    EventKind.CONVERSATION_ENDED: "conversation ended",
    EventKind.ALLOCATED: "allocated",
    EventKind.SHARED: "shared",
    EventKind.COPIED_ON_WRITE: "copy-on-write",
    EventKind.STORED: "stored (hashed)",
    EventKind.RELEASED: "released",
    EventKind.CACHED: "cached",
    EventKind.FREED: "freed",
    EventKind.EVICTED: "evicted",
    EventKind.PREEMPTED: "preempted",
    EventKind.RELOCATED: "relocated",
    EventKind.CLEARED: "prefix cache cleared",
    EventKind.OFFLOADED: "offloaded to a tier",
    EventKind.LOADED: "loaded from a tier",
    EventKind.DROPPED: "dropped from a tier",
    EventKind.WINDOW_RELEASED: "released by the window",
}

# Every kind in one fixed order (menus, legends, the small integer codes the timeline stores per marker).
ALL_KINDS: tuple[EventKind, ...] = tuple(EventKind)
KIND_CODE: dict[EventKind, int] = {kind: i for i, kind in enumerate(ALL_KINDS)}

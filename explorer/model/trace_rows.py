"""What the conversations table says of a prompt's blocks and of a trace's requests (Qt-free).

Every admission records how each prompt block fared (``ConversationInfo.prompt_block_outcomes``: a hit and the
medium it came from, or a miss and its one cause), so the table can count them for any conversation of the local
engine or of a recording. A trace replay adds what the trace says of the request behind a conversation: its place
in the trace, when it arrived and its lengths in the trace's own tokens (the replay's prompt is the trace's blocks
as synthesised tokens, so the engine's own lengths differ).
"""
from __future__ import annotations

from kvstream.views import HIT_MEDIA, MISS_CAUSES

from .words import number

CAUSE_WORDS = {"cold": "cold", "evicted": "evicted", "after_break": "after a miss", "partial": "partial",
               "window": "window", "last_token": "last token", "salted": "salted"}  # short, for a table cell


def outcome_counts(outcomes) -> tuple[dict, dict]:
    """({medium: hits}, {cause: misses}) of a prompt's block outcomes, in HIT_MEDIA and MISS_CAUSES order, zeros
    left out."""
    hits = dict.fromkeys(HIT_MEDIA, 0)
    misses = dict.fromkeys(MISS_CAUSES, 0)
    for o in outcomes:
        kind = o.outcome
        if kind in hits:
            hits[kind] += 1
        else:
            misses[kind] = misses.get(kind, 0) + 1
    return {k: v for k, v in hits.items() if v}, {k: v for k, v in misses.items() if v}


def outcome_cell(outcomes) -> str:
    """'12 device · 3 host | 4 evicted · 9 cold' (hits by medium, then misses by cause); '' when not known."""
    if not outcomes:
        return ""
    hits, misses = outcome_counts(outcomes)
    left = " · ".join(f"{number(n)} {medium}" for medium, n in hits.items()) or "no hits"
    right = " · ".join(f"{number(n)} {CAUSE_WORDS.get(cause, cause)}" for cause, n in misses.items())
    return f"{left} | {right}" if right else left


class TraceRequests:
    """Which trace request each conversation of a replay is, read from the replay's outcomes (appended on the
    engine thread before the conversation is published, so a conversation the window sees is already there)."""

    def __init__(self, replay):
        self.replay = replay
        self._by_conversation: dict[int, int] = {}
        self._read = 0  # outcomes read so far

    def index(self, conversation_id: int) -> int | None:
        """The conversation's request in the trace, or None (not one of this replay's)."""
        found = self._by_conversation.get(conversation_id)
        if found is None:
            outcomes = self.replay.outcomes
            end = len(outcomes)  # a list the engine thread only appends to: what is below this length stays
            for o in outcomes[self._read:end]:
                self._by_conversation[o.conversation_id] = o.index
            self._read = end
            found = self._by_conversation.get(conversation_id)
        return found

    def cell(self, conversation_id: int) -> str:
        """'#17 at 12.3 s: 3,412 in, 240 out' for a replayed request; '' for any other conversation."""
        i = self.index(conversation_id)
        if i is None:
            return ""
        trace = self.replay.trace
        return (f"#{i} at {float(trace.arrival_s[i]):.1f} s: {number(int(trace.input_length[i]))} in, "
                f"{number(int(trace.output_length[i]))} out")

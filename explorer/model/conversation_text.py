"""What the conversations table and detail say about tiers and KV cache groups, without Qt: prompt tokens by the
place their K/V came from, and one block table per group with the window's released entries as holes.
"""
from __future__ import annotations

import html
from typing import Mapping

from kvstream.views import ConversationInfo, PoolSnapshot

from .groups import HOLE, conversation_group_tables, group_name, groups_of
from .tiers import SOURCES

SOURCE_SHORT = {"device": "dev", "host": "host", "disk": "disk", "computed": "comp"}
HOLE_TEXT = "∅"  # a table entry the sliding window released


def sources_of(info: ConversationInfo) -> Mapping[str, int]:
    return info.prompt_token_sources or {}


def sources_cell(info: ConversationInfo) -> str:
    """The table's 'prompt from' cell: 'dev 32 · host 16 · comp 8' (sources with tokens only); '' when unknown."""
    sources = sources_of(info)
    return " · ".join(f"{SOURCE_SHORT[s]} {int(sources[s]):,}" for s in SOURCES if sources.get(s))


def sources_sentence(info: ConversationInfo) -> str:
    """The detail's line: 'prompt tokens by source: device 32, host 16, disk 0, computed 8'; '' when unknown."""
    sources = sources_of(info)
    if not sources:
        return ""
    return "prompt tokens by source: " + ", ".join(f"{s} {int(sources.get(s, 0)):,}" for s in SOURCES)


def group_tables_html(snapshot: PoolSnapshot, info: ConversationInfo) -> str:
    """One line per KV cache group: 'group 1: sliding window 4 — 0→∅, 1→∅, 2→7' with holes drawn as ∅ (greyed);
    '' for a one-group pool (the plain block table says it all)."""
    groups = groups_of(snapshot)
    tables = conversation_group_tables(snapshot, info.conversation_id)
    if len(groups) < 2 and not any(b == HOLE for t in tables for b in t):
        return ""
    lines = []
    for g, table in enumerate(tables):
        name = group_name(groups[g], g) if g < len(groups) else f"group {g}"
        holes = sum(1 for b in table if b == HOLE)
        cells = [f"<span style='color:#808088'>{i}→{HOLE_TEXT}</span>" if b == HOLE else f"{i}→<b>{b}</b>"
                 for i, b in enumerate(table)]
        note = f" ({holes} released by the window)" if holes else ""
        lines.append(f"{html.escape(name)}{note}: " + (", &nbsp;".join(cells) if cells else "empty"))
    return "<br>".join(lines)

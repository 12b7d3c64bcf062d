"""Why a prompt hit or missed, in words: the conversation detail, the inspector, the timeline's regretted
evictions and the prompt check all say it here, the same way.

The facts are the sources' (:class:`kvstream.views.BlockOutcome` per prompt block at a conversation's last
admission; :class:`kvstream.prompt_check.PromptCheck` for a prompt not sent yet); this module only puts them in
sentences: "3 of 7 prompt blocks hit on the device; block 4 was evicted at step 812 for conversation 31 after 40
steps idle (12 s), by LRU; blocks 5-6 were held but recomputed after that miss". Seconds appear where a
:class:`~explorer.model.step_clock.StepClock` saw the steps go by. Qt-free, tested without a display.
"""
from __future__ import annotations

import time
from typing import Iterable, Mapping, Sequence

from kvstream.views import HIT_MEDIA, BlockOutcome

from .step_clock import StepClock
from .words import count, number

POLICY_WORDS = {"lru": "LRU", "fifo": "FIFO", "s3fifo": "S3-FIFO", "s3lru": "S3-LRU", "radix": "the radix cache",
                "belady": "Belady", "reset": "a prefix-cache reset", "host tier": "the host tier",
                "disk tier": "the disk tier", "removed": "the server (BlockRemoved)",
                "cleared": "the server clearing its cache"}
MEDIUM_WORDS = {"device": "on the device", "host": "from the host tier", "disk": "from the disk tier"}
CAUSE_NAMES = {"cold": "cold", "evicted": "evicted", "after_break": "after an earlier miss", "partial": "partial",
               "window": "released by the window", "last_token": "holds the last token", "salted": "salted"}
MAX_EVICTED_TOLD = 3  # evicted blocks told one by one; the rest are counted


def index_ranges(indices: Iterable[int]) -> str:
    """'4', '5-6', '0-2, 5 and 7-9' (sorted, runs joined)."""
    ids = sorted(set(int(i) for i in indices))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(parts) < 2:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def blocks_words(indices: Sequence[int]) -> str:
    """'block 4', 'blocks 5-6'."""
    many = len(set(indices)) != 1
    return f"block{'s' if many else ''} {index_ranges(indices)}"


def duration_words(seconds: float) -> str:
    """'0.4 s', '12 s', '3 min 5 s', '2 h 10 min'."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m} min {s} s" if s else f"{m} min"
    h, m = divmod(int(round(seconds)) // 60, 60)
    return f"{h} h {m} min" if m else f"{h} h"


def by_words(by: str) -> str:
    """The policy or the tier that let a block go, as people say it ('LRU', 'the host tier')."""
    return POLICY_WORDS.get(by, by) if by else "an eviction"


def outcome_names(snapshot) -> dict[int, str]:
    """The source's own names of its conversations (a vLLM request id), where it has them: the words name those
    instead of the explorer's numbers."""
    return {c.conversation_id: f"request {c.label}" for c in snapshot.conversations if c.label}


def _conversation(cid: int | None, names: Mapping[int, str] | None) -> str:
    if names and cid in names:
        return names[cid]
    return f"conversation {cid}"


def eviction_words(step: int | None, for_cid: int | None, by: str, idle_steps: int | None,
                   clock: StepClock | None = None, names: Mapping[int, str] | None = None,
                   at: float | None = None, now: float | None = None) -> str:
    """'evicted at step 812 for conversation 31 after 40 steps idle (12 s), by LRU' (the parts the source knows);
    ``at``: unix time where the source dates removals (KV events) instead of counting steps."""
    parts = ["evicted" if by not in ("removed", "cleared") else "removed"]
    if step is not None:
        parts.append(f"at step {number(step)}")
    elif at is not None:
        parts.append(f"at {time.strftime('%H:%M:%S', time.localtime(at))}")
        if now is not None and now >= at:
            parts[-1] += f" ({duration_words(now - at)} before the check)"
    if for_cid is not None and for_cid >= 0:
        parts.append(f"for {_conversation(for_cid, names)}")
    if idle_steps is not None:
        idle = f"after {count(idle_steps, 'step')} idle"
        if clock is not None and step is not None:
            seconds = clock.seconds_between(step - idle_steps, step)
            if seconds is not None:
                idle += f" ({duration_words(seconds)})"
        parts.append(idle)
    text = " ".join(parts)
    return text + (f", by {by_words(by)}" if by and by not in ("removed",) else "")


def _hit_clause(outcomes: Sequence[BlockOutcome]) -> str:
    n = len(outcomes)
    hits = [o for o in outcomes if o.outcome in HIT_MEDIA]
    total = count(n, "prompt block")
    if not hits:
        return f"none of {total} hit" if n > 1 else "its one prompt block missed"
    media = [m for m in HIT_MEDIA if any(o.outcome == m for o in hits)]
    lead = f"{number(len(hits))} of {total} hit" if len(hits) < n else \
        (f"all {total} hit" if n > 1 else "its one prompt block hit")
    if len(media) == 1:
        return f"{lead} {MEDIUM_WORDS[media[0]]}"
    split = ", ".join(f"{sum(1 for o in hits if o.outcome == m)} {MEDIUM_WORDS[m]}" for m in media)
    return f"{lead}: {split}"


def outcomes_sentence(outcomes: Sequence[BlockOutcome], clock: StepClock | None = None,
                      names: Mapping[int, str] | None = None) -> str:
    """One conversation's last admission in words; '' when the source did not say (no outcomes)."""
    if not outcomes:
        return ""
    clauses: list[tuple[int, str]] = []  # (first block it tells of, the clause): told in block order
    by_cause: dict[str, list[BlockOutcome]] = {}
    for o in outcomes:
        if o.outcome not in HIT_MEDIA:
            by_cause.setdefault(o.outcome, []).append(o)
    evicted = by_cause.get("evicted", [])
    for o in evicted[:MAX_EVICTED_TOLD]:
        clauses.append((o.index, f"block {o.index} was " + eviction_words(o.evicted_step, o.evicted_for,
                                                                          o.evicted_by, o.idle_steps, clock, names)))
    if len(evicted) > MAX_EVICTED_TOLD:
        rest = evicted[MAX_EVICTED_TOLD:]
        clauses.append((rest[0].index, f"{blocks_words([o.index for o in rest])} were evicted too"))
    for cause, template in (("cold", "{} never in the pool before (cold)"),
                            ("after_break", "{} held but recomputed after an earlier miss"),
                            ("window", "{} let go by the sliding window"),
                            ("salted", "{} salted (a cache salt or LoRA made equal tokens differ)"),
                            ("last_token", "{} held, but holds the prompt's last token, which is always recomputed"),
                            ("partial", "{} not full (only full blocks are cached)")):
        group = by_cause.get(cause)
        if group:
            indices = [o.index for o in group]
            verb = "was" if len(indices) == 1 or cause == "last_token" else "were"
            clauses.append((indices[0], template.format(f"{blocks_words(indices)} {verb}")))
    clauses.sort(key=lambda c: c[0])
    return "; ".join([_hit_clause(outcomes)] + [text for _, text in clauses])


def block_outcome_words(o: BlockOutcome, clock: StepClock | None = None,
                        names: Mapping[int, str] | None = None) -> str:
    """What one prompt block did at admission: 'a hit on the device', 'a miss: evicted at step 812 ... by LRU'."""
    if o.outcome in HIT_MEDIA:
        return f"a hit {MEDIUM_WORDS[o.outcome]}"
    if o.outcome == "evicted":
        return "a miss: " + eviction_words(o.evicted_step, o.evicted_for, o.evicted_by, o.idle_steps, clock, names)
    return {"cold": "a miss: never in the pool before (cold)",
            "after_break": "a miss: held, but recomputed after an earlier block missed",
            "partial": "not cached: the prompt's last block was not full",
            "window": "a miss: the sliding window had let it go",
            "last_token": "a miss: it holds the prompt's last token, which is always recomputed",
            "salted": "a miss: a cache salt or LoRA made equal tokens differ"}.get(o.outcome, o.outcome)


def outcome_at(info, index: int) -> BlockOutcome | None:
    """Conversation ``info``'s outcome for its prompt block ``index`` (None: not a prompt block, or unknown)."""
    outcomes = info.prompt_block_outcomes or ()
    if 0 <= index < len(outcomes) and outcomes[index].index == index:
        return outcomes[index]
    return next((o for o in outcomes if o.index == index), None)


def block_prompt_lines(snapshot, owners: Sequence[tuple[int, int]], clock: StepClock | None = None,
                       names: Mapping[int, str] | None = None, limit: int = 3) -> list[str]:
    """For the inspector: what each owner's admission did with the prompt block this block holds, e.g.
    'conversation 5, prompt block 3: a hit on the device' (owners whose entry is no prompt block say nothing)."""
    lines, more = [], 0
    for cid, index in owners:
        info = snapshot.conversation(cid)
        o = outcome_at(info, index) if info is not None else None
        if o is None:
            continue
        if len(lines) == limit:
            more += 1
            continue
        if names is None:  # only the conversations named here (a pool may list thousands)
            named = (snapshot.conversation(c) for c in (cid, o.evicted_for) if c is not None and c >= 0)
            said = {c.conversation_id: f"request {c.label}" for c in named if c is not None and c.label}
        else:
            said = names
        lines.append(f"{_conversation(cid, said)}, prompt block {index}: {block_outcome_words(o, clock, said)}")
    if more:
        lines.append(f"and {count(more, 'other owner')}")
    return lines


def missed_indices(outcomes: Sequence[BlockOutcome]) -> list[int]:
    """The prompt blocks an admission computed because they missed (the partial last block included: it was
    computed too)."""
    return [o.index for o in outcomes if o.outcome not in HIT_MEDIA]


def regret_words(victim: int, index: int, o: BlockOutcome, clock: StepClock | None = None,
                 names: Mapping[int, str] | None = None) -> str:
    """A regretted eviction: 'cost conversation 40 a hit on prompt block 4 (evicted for conversation 31 after 40
    steps idle, by LRU)'."""
    why = eviction_words(None, o.evicted_for, o.evicted_by, o.idle_steps, None, names)
    return f"cost {_conversation(victim, names)} a hit on prompt block {index} ({why})"


# ---- a prompt not sent yet ---------------------------------------------------------------------------------------
def check_sentence(check, clock: StepClock | None = None, names: Mapping[int, str] | None = None) -> str:
    """A PromptCheck in words: '48 of 70 prompt tokens would come from the cache (3 of 5 blocks, on the device);
    block 3 was evicted at step 812 for conversation 31, by LRU; block 4 is shorter than a block'."""
    blocks = check.blocks
    hits = check.hit_blocks
    lead = (f"{number(check.cached_tokens)} of {count(check.num_tokens, 'prompt token')} would come from the cache"
            if check.cached_tokens else f"none of its {count(check.num_tokens, 'prompt token')} would come from "
                                        "the cache")
    if hits:
        media = [m for m in HIT_MEDIA if any(b.outcome == m for b in hits)]
        lead += f" ({number(len(hits))} of {count(len(blocks), 'block')}, " + \
            " and ".join(MEDIUM_WORDS[m] for m in media) + ")"
    clauses = [lead]
    evicted = [b for b in blocks if b.outcome == "evicted"]
    for b in evicted[:MAX_EVICTED_TOLD]:
        gone = b.removal
        clauses.append(f"block {b.index} was stored, then " + eviction_words(
            gone.step, gone.for_conversation, gone.by, gone.idle_steps, clock, names, gone.at, check.checked_at))
    if len(evicted) > MAX_EVICTED_TOLD:
        clauses.append(f"{blocks_words([b.index for b in evicted[MAX_EVICTED_TOLD:]])} were removed too")
    for cause, template in (("cold", "{} never stored"),
                            ("after_break", "{} held but would be recomputed after an earlier miss"),
                            ("window", "{} held by the full-attention layers, not the sliding window's"),
                            ("last_token", "{} held, but holds the last token, which the server recomputes"),
                            ("partial", "{} shorter than a block (only full blocks are cached)")):
        group = [b.index for b in blocks if b.outcome == cause]
        if group:
            verb = "is" if cause in ("partial", "last_token") or len(group) == 1 else "are"
            clauses.append(template.format(f"{blocks_words(group)} {verb}"))
    text = "; ".join(clauses)
    return text + (f". {check.note}" if check.note else "")


def check_block_words(b, check=None, clock: StepClock | None = None) -> str:
    """One row of the check dialog's table: where the block is, and why it would or would not hit."""
    where = f" (held {MEDIUM_WORDS.get(b.held.tier, 'in ' + b.held.tier)})" if b.held is not None else ""
    if b.hit:
        return f"would hit {MEDIUM_WORDS.get(b.outcome, b.outcome)}" + \
            (f", block {b.held.block_id}" if b.held is not None and b.held.block_id is not None else "")
    if b.outcome == "evicted" and b.removal is not None:
        gone = b.removal
        return "miss: stored, then " + eviction_words(gone.step, gone.for_conversation, gone.by, gone.idle_steps,
                                                      clock, None, gone.at,
                                                      check.checked_at if check is not None else None)
    return {"cold": "miss: never stored",
            "after_break": "miss: held, but an earlier block misses, so it is recomputed",
            "window": "miss: the sliding window let it go",
            "last_token": "miss: holds the prompt's last token, which the server recomputes",
            "partial": "miss: shorter than a block"}.get(b.outcome, b.outcome) + where

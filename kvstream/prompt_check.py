"""'Would this prompt hit?': which of a prompt's blocks a pool holds now, where, and why the others would miss.

The question operators ask before they send a request (vLLM issues 42948, 45633: a hit rate near zero and no way
to see why). Every source answers it from what it knows (the local engine from its own pool and eviction book, a
pool stream from its stored blocks and their removals, a KV-event stream from the tokens ``BlockStored`` carries,
chained by parent), and all of them count the answer by one rule, :func:`classify_prompt`, so the figure is the
one the server will report:

- only full blocks are cached: a last block shorter than a block is a miss ("partial");
- a prompt hits its longest leading run of held blocks; a held block after the first miss is recomputed
  ("after_break"), since a prefix hash covers everything before it;
- a generating request recomputes its last token, for the logits of its first output (vLLM caps a hit at
  ``num_tokens - 1`` tokens, SGLang at ``len(input) - 1``): a prompt held whole counts the whole blocks before the
  one holding its last token ("last_token").

``cached_tokens`` is then what vLLM reports as the request's ``num_cached_tokens``. Plain data, no torch, no Qt: it
crosses from the engine thread to the window and into ``--json`` lines.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from .views import HIT_MEDIA

TIER_OF_MEDIUM = {"GPU": "device", "CPU": "host", "STORAGE": "disk"}  # KV-event media as the pool's tiers are named


class Held(NamedTuple):
    """Where a pool holds one block of the prompt now."""

    tier: str  # "device", "host", "disk" (or another tier a KV-event publisher names)
    block_id: int | None = None  # the device block holding it (None: not on the device, or no physical ids)
    block_hash: int | bytes | None = None  # its prefix hash as the source names it


class Removal(NamedTuple):
    """When and why content that was stored left every pool that held it."""

    step: int | None = None  # the source's step (the engine, a pool stream); None where it counts no steps
    at: float | None = None  # unix time (a KV-event batch's timestamp); None where the source keeps no clock
    by: str = ""  # the eviction policy ("lru"), the tier that dropped it ("host tier"), "reset", "removed"
    for_conversation: int | None = None  # the conversation it made room for (-1: none, e.g. a reset)
    idle_steps: int | None = None  # steps it had gone unused when it went


@dataclass(frozen=True)
class PromptBlock:
    """One block of a checked prompt: a hit (``outcome`` is where from) or a miss and its cause, as
    :class:`kvstream.views.BlockOutcome` names causes: "cold" (never stored, as far as the source knows),
    "evicted" (stored, then removed: ``removal`` says when), "after_break", "partial", "last_token", "window"."""

    index: int  # the block's logical index in the prompt
    outcome: str  # one of HIT_MEDIA (a hit), or a miss cause
    held: Held | None = None  # where the pool holds it now, hit or not (after_break and last_token are held)
    removal: Removal | None = None  # evicted: when and why it went

    @property
    def hit(self) -> bool:
        return self.outcome in HIT_MEDIA

    def as_json(self) -> dict:
        held, gone = self.held, self.removal
        block_hash = None if held is None else held.block_hash
        return {"index": self.index, "outcome": self.outcome, "hit": self.hit,
                "held": None if held is None else held.tier,
                "block_id": None if held is None else held.block_id,
                "block_hash": block_hash.hex() if isinstance(block_hash, bytes) else block_hash,
                "removed_step": None if gone is None else gone.step,
                "removed_at": None if gone is None else gone.at,
                "removed_by": None if gone is None else (gone.by or None),
                "removed_for": None if gone is None else gone.for_conversation,
                "idle_steps": None if gone is None else gone.idle_steps}


@dataclass(frozen=True)
class PromptCheck:
    """The answer for one prompt against one pool, at one moment."""

    checked_at: float  # unix time of the check
    num_tokens: int  # the prompt's tokens
    block_size: int  # the pool's tokens per block (how the prompt was cut)
    cached_tokens: int  # prompt tokens the server would take from its cache (its num_cached_tokens)
    blocks: tuple[PromptBlock, ...]  # one per block of the prompt, the partial last one included
    source: str = ""  # the pool it was checked against ("engine", "vllm", a KV-event instance's name)
    step: int | None = None  # the pool's step (or a KV-event stream's last sequence number) when checked
    note: str = ""  # what the source cannot know, said once (a KV-event stream joined late, say)

    @property
    def hit_blocks(self) -> tuple[PromptBlock, ...]:
        return tuple(b for b in self.blocks if b.hit)

    def as_json(self) -> dict:
        """The ``prompt_check`` of a ``--json`` line (DESIGN.md: checked_at, num_tokens, cached_tokens, one
        entry per block)."""
        return {"checked_at": self.checked_at, "num_tokens": self.num_tokens, "block_size": self.block_size,
                "cached_tokens": self.cached_tokens, "source": self.source or None, "step": self.step,
                "blocks": [b.as_json() for b in self.blocks], "note": self.note or None}


def classify_prompt(num_tokens: int, block_size: int, held: Sequence[Held | None],
                    removal: Callable[[int], Removal | None] = lambda _i: None, *, hits: int | None = None,
                    recompute_last: bool = True, source: str = "", step: int | None = None, note: str = "",
                    checked_at: float | None = None) -> PromptCheck:
    """The one counting rule (see the module docstring). ``held[i]``: where the pool holds the prompt's full block
    ``i`` now (None: nowhere), for each of its ``num_tokens // block_size`` full blocks; ``removal(i)``: for a block
    held nowhere, when it left (None: never stored, as far as the source knows). ``hits``: the leading blocks the
    source itself would serve, where it knows better than the held run (a sliding window: the full-attention layers
    hold a block its window let go, "window"); ``recompute_last`` False for a request that generates nothing (the
    engine's prefill-only requests hit whole)."""
    if block_size < 1:
        raise ValueError(f"a block holds at least one token, not {block_size}")
    if num_tokens < 1:
        raise ValueError("the prompt is empty")
    full = num_tokens // block_size
    if len(held) != full:
        raise ValueError(f"{len(held)} held entries for {full} full blocks")
    cap = (num_tokens - 1) // block_size if recompute_last else full
    run = 0
    while run < full and held[run] is not None:
        run += 1
    served = min(run, cap) if hits is None else min(hits, run, cap)
    blocks = []
    for i in range(full):
        where = held[i]
        if i < served:
            # a tier the project does not name (SGLang's "EXTERNAL"): a lower tier, its KV loaded back on a hit
            blocks.append(PromptBlock(i, where.tier if where.tier in HIT_MEDIA else "host", where))
        elif where is not None:
            cause = "last_token" if i >= cap and i < run else "window" if i < run else "after_break"
            blocks.append(PromptBlock(i, cause, where))
        else:
            gone = removal(i)
            blocks.append(PromptBlock(i, "cold" if gone is None else "evicted", None, gone))
    if num_tokens % block_size:
        blocks.append(PromptBlock(full, "partial"))
    return PromptCheck(time.time() if checked_at is None else checked_at, num_tokens, block_size,
                       served * block_size, tuple(blocks), source, step, note)


def prompt_ids_from_text(text: str) -> list[int] | None:
    """A JSON list of token ids (``[1, 2, 3]``) as a list, or None when the text is a prompt to tokenise (it does
    not start with "["). Raises ValueError for a list that does not parse (half written, say) or holds anything but
    non-negative integers."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return None
    import json
    try:
        value = json.loads(stripped)
    except ValueError as exc:
        raise ValueError(f"it starts like a JSON list of token ids but does not parse: {exc}") from None
    if not isinstance(value, list):
        raise ValueError("it starts like a JSON list of token ids but is not a list")
    if not value:
        raise ValueError("the list of token ids is empty")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"token id {i} is {v!r}: token ids are integers 0 or more")
    return value

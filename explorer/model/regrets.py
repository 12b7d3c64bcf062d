"""Regretted evictions: evictions that later cost a hit, found in the conversations' own accounts.

An eviction is only a mistake in hindsight: when a later prompt wanted that content back. Every admission records
why each prompt block missed (:class:`kvstream.views.BlockOutcome`), and an "evicted" block names the step it left
the pool, by which policy, for whom. So the regrets come out of the views the window already gets: each time a
conversation's outcomes change (a new admission), its evicted blocks become regrets at their eviction steps, which
the timeline marks. Qt-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstream.views import BlockOutcome, PoolSnapshot

MAX_REGRETS = 100_000  # regrets kept (the oldest go first): a long run's marks, bounded


@dataclass(frozen=True)
class Regret:
    """One eviction that later cost one prompt block its hit."""

    step: int  # the step of the eviction
    victim: int  # the conversation whose prompt block missed because of it
    index: int  # that prompt block's logical index
    outcome: BlockOutcome  # the miss as the admission recorded it (by whom, for whom, idle how long)


class RegretBook:
    """Follows the views of one source; :meth:`observe` returns the regrets each new admission reveals."""

    def __init__(self):
        self.regrets: list[Regret] = []
        self._seen: dict[int, tuple] = {}  # conversation id -> the outcomes already read (a new tuple: an admission)

    def clear(self) -> None:
        """A new source, or a jump back in time: start over."""
        self.regrets.clear()
        self._seen.clear()

    def observe(self, snapshot: PoolSnapshot) -> list[Regret]:
        """The regrets of the admissions ``snapshot`` shows that were not read before."""
        new: list[Regret] = []
        seen = self._seen
        present = set()
        for info in snapshot.conversations:
            cid = info.conversation_id
            present.add(cid)
            outcomes = info.prompt_block_outcomes
            old = seen.get(cid)
            if outcomes is old or not outcomes or old == outcomes:
                continue
            seen[cid] = outcomes
            for o in outcomes:
                if o.outcome == "evicted" and o.evicted_step is not None:
                    new.append(Regret(int(o.evicted_step), cid, o.index, o))
        for cid in [c for c in seen if c not in present]:  # left the view: a later admission would be a new one
            del seen[cid]
        if new:
            self.regrets.extend(new)
            if len(self.regrets) > MAX_REGRETS:
                del self.regrets[:len(self.regrets) - MAX_REGRETS]
        return new

    def at_step(self, step: int) -> list[Regret]:
        return [r for r in self.regrets if r.step == step]

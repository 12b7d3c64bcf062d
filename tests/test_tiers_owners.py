"""The owners of a large tier's slots kept up to date frame by frame (explorer.model.tiers.TierOwners): the owners
the content book learns every step are found through the tier's hash -> slot map, not by searching all its slots,
and the result always equals looking every slot up afresh."""
from __future__ import annotations

import numpy as np
import pytest

import explorer.model.tiers as tiers_mod
from explorer.model.tiers import ContentBook, TierOwners
from kvstream.events import BlockEvent, EventKind
from kvstream.views import NO_HASH, BlockState, TierView


def _view(hashes: np.ndarray) -> TierView:
    state = np.where(hashes != NO_HASH, BlockState.CACHED, BlockState.FREE).astype(np.int8)
    return TierView(len(hashes), state, hashes.copy(), np.zeros(len(hashes), np.int64))


def _learn(book: ContentBook, pairs, step: int) -> None:
    book.add_events([BlockEvent(step, EventKind.STORED, owner, (1,), block_hashes=(int(h),), token_ids=(1, 2))
                     for h, owner in pairs])


@pytest.mark.parametrize("duplicates", [False, True])
def test_owners_follow_changed_slots_and_learnt_owners(monkeypatch, duplicates):
    """Random frames (slots refilled, emptied, owners learnt and changed) on a 4,096-slot tier: the kept owners
    equal a fresh lookup of every slot after each frame. Without duplicate hashes the whole tier is never
    searched (np.isin is not called); a tier that holds one hash twice (a watched server's might) still
    recolours both slots."""
    rng = np.random.default_rng(1)
    n = 4096
    hashes = np.where(rng.random(n) < 0.7, rng.integers(1, 2**62, n, dtype=np.uint64), np.uint64(NO_HASH))
    if duplicates:
        hashes[10] = hashes[20] = np.uint64(777)
    book, owners = ContentBook(), TierOwners()
    _learn(book, [(h, i % 5) for i, h in enumerate(hashes[:100]) if h != NO_HASH], 1)
    owners.update(_view(hashes), book)
    searched = []
    real_isin = np.isin
    monkeypatch.setattr(tiers_mod.np, "isin", lambda *a, **k: (searched.append(1), real_isin(*a, **k))[1])
    for step in range(2, 40):
        slots = rng.integers(0, n, 12)
        hashes = hashes.copy()
        hashes[slots[:8]] = rng.integers(1, 2**62, 8, dtype=np.uint64)  # new content
        hashes[slots[8:]] = np.uint64(NO_HASH)  # dropped
        held = hashes[hashes != NO_HASH]
        learnt = [(h, int(rng.integers(0, 9))) for h in rng.choice(held, 6)]  # owners learnt or changed
        if duplicates and step % 5 == 0:
            learnt.append((777, step))
            hashes[10] = hashes[20] = np.uint64(777)
        _learn(book, learnt, step)
        owners.update(_view(hashes), book)
        assert owners.owner.tolist() == book.owners(hashes).tolist(), step
    assert bool(searched) == duplicates


def test_a_big_tier_is_not_searched_when_owners_are_learnt(monkeypatch):
    """262,144 slots, an owner learnt for one of them: only that slot is looked up again."""
    n = 262_144
    hashes = np.arange(1, n + 1, dtype=np.uint64)
    book, owners = ContentBook(), TierOwners()
    owners.update(_view(hashes), book)
    monkeypatch.setattr(tiers_mod.np, "isin", lambda *a, **k: pytest.fail("the whole tier was searched"))
    looked = []
    real_owner = book.owner
    monkeypatch.setattr(book, "owner", lambda h: (looked.append(int(h)), real_owner(h))[1])
    _learn(book, [(12345, 3)], 2)
    assert owners.update(_view(hashes), book)
    assert looked == [12345] and owners.owner[12344] == 3 and (owners.owner >= 0).sum() == 1

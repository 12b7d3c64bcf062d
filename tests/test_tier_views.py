"""The window's views of tiers and KV cache groups, computed without Qt (explorer.model, explorer.render).

VIEW tests: the snapshots and events are built by hand to the contract of DESIGN.md "Beyond one pool" (see
tests/tier_view_helpers.py); tests against a real engine with tiers and groups come once those engine sides merge.
"""
from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np

from explorer.model import palette
from explorer.render.grid import block_colours, grid_geometry
from explorer.model.conversation_text import group_tables_html, sources_cell, sources_sentence
from explorer.model.groups import block_group_of, block_groups, group_counts, hash_words, window_saving_text
from explorer.model.tier_stats import BlockDurations, HitRates, histogram
from explorer.model.tiers import ContentBook, TierStories, tier_block_facts, tier_snapshot, where_held
from explorer.render.groups import GROUP_COLOURS
from explorer.render.tiers import tier_rgba
from kvstream.events import BlockEvent, EventKind
from kvstream.views import BlockState, PoolSnapshot, Status
from tests.tier_view_helpers import H0, H5, HA, HB, conversation, tier, tier_events, tiered_snapshot


# ---- groups ---------------------------------------------------------------------------------------------------
def test_block_groups_come_from_the_group_tables():
    snap = tiered_snapshot()
    groups = block_groups(snap)
    assert groups.dtype == np.int8
    assert groups.tolist() == [0, 0, 0, 1, 1, -1, -1, -1]  # cached block 5 and the free ones: not said


def test_block_groups_of_a_one_group_pool_are_zero_wherever_kv_is_held():
    snap = tiered_snapshot(groups=False)
    assert block_groups(snap).tolist() == [0, 0, 0, 0, 0, 0, -1, -1]


def test_a_per_block_group_array_sent_by_the_source_wins():
    snap = tiered_snapshot()
    object.__setattr__(snap, "block_group", np.array([1, 1, 0, 0, 0, 1, -1, -1], np.int8))
    assert block_groups(snap).tolist() == [1, 1, 0, 0, 0, 1, -1, -1]


def test_group_counts_and_what_the_window_saved():
    snap = tiered_snapshot()
    counts = group_counts(snap)
    assert [(c.blocks, c.holes) for c in counts] == [(3, 0), (2, 1)]
    assert counts[1].full_attention_blocks == 3
    text = window_saving_text(snap)
    assert "group 0: full attention (layers 0, 2): 3 blocks in use" in text
    assert "group 1: sliding window 4 (layers 1, 3): 2 blocks in use, 1 released by the window" in text
    assert "saved 1 block against full attention (5 held, 6 with every layer reading everything: 17% less)" in text
    assert window_saving_text(tiered_snapshot(groups=False)) == ""


def test_group_colour_mode_colours_each_block_by_its_group():
    snap = tiered_snapshot()
    fill, _ = block_colours(snap, "group")
    assert (fill[0] == GROUP_COLOURS[0]).all() and (fill[3] == GROUP_COLOURS[1]).all()
    assert (fill[7] == palette.FREE).all()
    assert not (fill[5] == GROUP_COLOURS[0]).all() and not (fill[5] == GROUP_COLOURS[1]).all()  # cached: muted


def test_group_filter_dims_the_blocks_of_other_groups_only():
    snap = tiered_snapshot()
    plain, _ = block_colours(snap, "state")
    only_window, _ = block_colours(snap, "state", group_filter=1)
    assert (only_window[3:5] == plain[3:5]).all()  # group 1: as bright as before
    assert (only_window[0:3, :3] < plain[0:3, :3]).all()  # group 0: dimmed
    assert (only_window[6:] == plain[6:]).all()  # free blocks: untouched


def test_per_group_tables_draw_released_entries_as_holes():
    snap = tiered_snapshot()
    text = group_tables_html(snap, snap.conversation(1))
    assert "group 0: full attention (layers 0, 2): 0→<b>0</b>" in text
    assert "group 1: sliding window 4 (layers 1, 3) (1 released by the window): " in text
    assert "0→∅" in text and "1→<b>3</b>" in text
    assert group_tables_html(tiered_snapshot(groups=False), snap.conversation(1)) == ""


# ---- prompt tokens by source ----------------------------------------------------------------------------------
def test_prompt_sources_in_words():
    info = conversation(1, sources={"device": 32, "host": 16, "disk": 0, "computed": 8})
    assert sources_cell(info) == "dev 32 · host 16 · comp 8"
    assert sources_sentence(info) == "prompt tokens by source: device 32, host 16, disk 0, computed 8"
    assert sources_cell(conversation(2)) == "" and sources_sentence(conversation(2)) == ""


def test_hit_rates_per_source_count_each_admission_once():
    rates = HitRates()
    snap = tiered_snapshot(step_id=20)
    rates.record(snap)
    rates.record(tiered_snapshot(step_id=21))  # the same admissions, a step later: not counted again
    assert rates.totals == {"device": 4, "host": 4, "disk": 0, "computed": 8}
    x, host = rates.series("host")
    assert x.tolist() == [20, 21] and host.tolist() == [25.0, 25.0]
    later = tiered_snapshot(step_id=22, conversations=snap.conversations + (
        conversation(3, sources={"disk": 8, "computed": 0}, arrival=22),))
    rates.record(later)
    assert rates.series("disk")[1].tolist() == [0.0, 0.0, 100 * 8 / 24]
    assert rates.series("computed")[1][-1] == 100 * 8 / 24


def test_hit_rates_count_a_continued_or_preempted_conversation_at_its_new_admission():
    """A continued conversation waits with its last admission's sources (and a preempted one too) under a new key:
    they are not counted again then, only its own sources once it is admitted again."""
    rates = HitRates()
    first = conversation(1, Status.FINISHED, sources={"computed": 8}, arrival=0)
    rates.record(tiered_snapshot(step_id=5, conversations=(first,)))
    waiting = replace(first, status=Status.WAITING, arrival_step=6, turns=((0, 8), (8, 10)))  # continued
    rates.record(tiered_snapshot(step_id=6, conversations=(waiting,)))
    assert rates.totals == {"device": 0, "host": 0, "disk": 0, "computed": 8}
    admitted = replace(waiting, status=Status.RUNNING, prompt_token_sources={"host": 8, "computed": 2})
    rates.record(tiered_snapshot(step_id=7, conversations=(admitted,)))
    preempted = replace(admitted, status=Status.PREEMPTED, num_preemptions=1)
    rates.record(tiered_snapshot(step_id=8, conversations=(preempted,)))
    assert rates.totals == {"device": 0, "host": 8, "disk": 0, "computed": 10}
    again = replace(preempted, status=Status.RUNNING, prompt_token_sources={"device": 8, "computed": 2})
    rates.record(tiered_snapshot(step_id=9, conversations=(again,)))
    assert rates.totals == {"device": 8, "host": 8, "disk": 0, "computed": 12}


# ---- durations per tier ---------------------------------------------------------------------------------------
def test_lifetime_idle_and_reuse_gap_per_tier_from_events():
    d = BlockDurations()
    d.add_events(tier_events())
    d.add_events([BlockEvent(30, EventKind.DROPPED, block_hashes=(HA,), tier="host", tier_slots=(0,))])
    got = d.durations
    assert got.of("device", "lifetime").tolist() == [9, 2, 3]  # block 6: 3 -> 12; block 7: 13 -> 15, 16 -> 19
    assert got.of("device", "idle").tolist() == [6, 1]  # cached at 6, evicted at 12; cached at 14, evicted at 15
    assert got.of("host", "reuse_gap").tolist() == [3]  # offloaded to slot 2 at 15, loaded back at 18
    assert got.of("host", "lifetime").tolist() == [18] and got.of("host", "idle").tolist() == [18]  # slot 0
    assert got.tiers() == ["device", "host"]


def test_device_reuse_gap_and_relocation_follow_the_content():
    d = BlockDurations()
    K = EventKind
    d.add_events([BlockEvent(1, K.ALLOCATED, 1, (2,)), BlockEvent(3, K.CACHED, 1, (2,)),
                  BlockEvent(4, K.RELOCATED, -1, (2,), (5,)),
                  BlockEvent(10, K.SHARED, 2, (5,), reason="prefix_hit"), BlockEvent(11, K.FREED, 2, (5,))])
    assert d.durations.of("device", "reuse_gap").tolist() == [7]
    assert d.durations.of("device", "lifetime").tolist() == [10]


def test_followed_slots_and_stories_leave_nothing_for_the_collector_to_walk():
    """A 262,144-slot host tier followed by one object per slot, and stories kept as lists of facts holding enum
    members, were most of what a full collection walked while the GUI thread waited (docs/performance.md, "The
    collector"); once collections have seen them, none of it is tracked."""
    K = EventKind
    d, stories = BlockDurations(), TierStories()
    events = [BlockEvent(1, K.ALLOCATED, 1, tuple(range(64))),
              BlockEvent(2, K.STORED, 1, tuple(range(64)), block_hashes=tuple(range(100, 164))),
              BlockEvent(3, K.CACHED, 1, tuple(range(64))),
              BlockEvent(4, K.EVICTED, 1, tuple(range(64)), block_hashes=tuple(range(100, 164))),
              BlockEvent(4, K.OFFLOADED, -1, tuple(range(64)), block_hashes=tuple(range(100, 164)), tier="host",
                         tier_slots=tuple(range(64))),
              BlockEvent(5, K.LOADED, 2, (70,), block_hashes=(100,), tier="host", tier_slots=(0,))]
    d.add_events(events)
    stories.add_events(events)
    gc.collect()
    gc.collect()  # a tuple is untracked once its items are: a story's facts on one pass, the story on the next
    followed = list(d._device.values()) + [v for slots in d._tiers.values() for v in slots.values()]
    assert len(followed) == 1 + 64  # device block 70 (the evicted ones ended), host slots 0-63
    assert not [v for v in followed if gc.is_tracked(v)]
    kept = [stories._moves[h] for h in range(100, 164)]
    assert not [v for v in kept if gc.is_tracked(v)]
    assert stories.story(100) == [(2, "stored in device block 0"), (4, "evicted from device block 0"),
                                  (4, "offloaded to host slot 0 from device block 0"),
                                  (5, "loaded from host slot 0 into device block 70")]
    assert d.durations.of("host", "reuse_gap").tolist() == [1]


def test_histogram_bins_are_whole_steps_from_zero():
    counts, edges = histogram(np.array([0, 1, 1, 5]), bins=3)
    assert edges.tolist() == [0, 2, 4, 6] and counts.tolist() == [3, 0, 1]
    counts, edges = histogram(np.array([], np.int64))
    assert counts.tolist() == [0] and edges.tolist() == [0, 1]


# ---- tiers ----------------------------------------------------------------------------------------------------
def test_content_book_learns_owners_from_the_pool_and_the_events():
    book = ContentBook()
    snap = tiered_snapshot()
    book.observe(snap)
    assert book.owner(H0) == 1 and book.owner(HA) == -1
    book.add_events(tier_events())
    assert book.owner(HA) == 2 and book.tokens(HA) == (7, 8, 9, 10)
    assert book.owners(np.array([HA, HB, H0, 0], np.uint64)).tolist() == [2, -1, 1, -1]


def test_tier_grid_uses_the_device_grids_colour_rules():
    snap = tiered_snapshot()
    book = ContentBook()
    book.observe(snap)
    book.add_events(tier_events())
    host = tier_snapshot(snap, "host", snap.tiers["host"], book)
    assert host.state.tolist() == [BlockState.CACHED, 0, BlockState.CACHED, 0]
    assert host.owner.tolist() == [2, -1, 1, -1] and host.num_filled.tolist() == [4, 0, 4, 0]
    image = tier_rgba(snap, "host", book)
    geo = grid_geometry(4, snap.block_size)
    t = geo.tile

    def centre(slot):
        x, y = geo.cell_origin(slot)
        return tuple(int(c) for c in image[y * t + t // 2, x * t + t // 2, :3])

    device, _ = block_colours(snap, "owner")
    assert centre(0) == tuple(int(c) for c in device[5, :3])  # conversation 2's cached content: as on the device
    assert centre(1) == tuple(int(c) for c in palette.FREE[:3])
    disk = tier_rgba(snap, "disk", book)
    geo = grid_geometry(2, snap.block_size)
    x, y = geo.cell_origin(1)
    assert tuple(int(c) for c in disk[y * geo.tile + geo.tile // 2, x * geo.tile + geo.tile // 2, :3]) == \
        tuple(int(c) for c in palette.UNOWNED[:3])  # nobody announced HB's owner


def test_where_content_is_held_and_a_tier_slots_facts():
    snap = tiered_snapshot()
    assert where_held(snap, H0) == [("device", 0), ("host", 2)]
    book, stories = ContentBook(), TierStories()
    book.observe(snap)
    book.add_events(tier_events(), grouped=True)
    stories.add_events(tier_events())
    facts = tier_block_facts(snap, "host", 2, book, stories)
    assert facts[:3] == ["host slot 2: cached", f"hash {H0:016x}, group 0", "last written or read at step 15"]
    assert "content of conversation 1" in facts and "tokens 1 2 3 4" in facts
    assert "held now by device block 0, host slot 2" in facts
    assert facts[-4:] == ["step 13: stored in device block 7", "step 15: evicted from device block 7",
                          "step 15: offloaded to host slot 2 from device block 7",
                          "step 18: loaded from host slot 2 into device block 0"]
    assert tier_block_facts(snap, "host", 1, book, stories)[0] == "host slot 1: free"
    unknown = tier_block_facts(snap, "disk", 1, book, stories)
    assert unknown[:2] == ["disk slot 1: cached", f"hash {HB:016x} (cache key; its KV cache group is not known here)"]
    plain = tier_block_facts(tiered_snapshot(groups=False), "disk", 1, book, stories)
    assert plain[1] == f"hash {HB:016x}"  # one group: the key is the hash
    assert any(f.startswith("tokens not known") for f in unknown) and "held now by disk slot 1" in unknown


def test_a_group_ones_tier_slot_is_known_under_its_groups_key():
    """A grouped engine's pool and tiers hold cache keys (kvstream.rules.group_key), its events the plain hash and
    the group: the book and the stories file what they learn under the key the slot shows, so a group-1 slot's
    tokens and story are known, and the same hash in group 0 stays another piece of content."""
    from kvstream.rules import group_key
    key = group_key(H0, 1)
    events = [BlockEvent(4, EventKind.STORED, 2, (6,), block_hashes=(H0,), token_ids=(7, 8, 9, 10), group=1),
              BlockEvent(9, EventKind.EVICTED, 3, (6,), block_hashes=(H0,), group=1),
              BlockEvent(9, EventKind.OFFLOADED, 3, (6,), block_hashes=(H0,), tier="host", tier_slots=(1,),
                         group=1)]
    book, stories = ContentBook(), TierStories()
    book.add_events(events, grouped=True)
    stories.add_events(events)
    assert book.tokens(key) == (7, 8, 9, 10) and book.owner(key) == 2
    assert book.tokens(H0) is None and book.owner(H0) == -1
    assert [text for _, text in stories.story(key)] == [
        "stored in device block 6", "evicted from device block 6", "offloaded to host slot 1 from device block 6"]
    assert stories.story(H0) == []
    snap = tiered_snapshot(host=tier(4, {1: key}))
    facts = tier_block_facts(snap, "host", 1, book, stories)
    assert "tokens 7 8 9 10" in facts and "content of conversation 2" in facts
    assert facts[1] == f"hash {H0:016x}, group 1"  # as the events name it, not the key the slot holds
    assert facts[-1] == "step 9: offloaded to host slot 1 from device block 6"


def test_a_hash_is_named_as_the_events_name_it_with_its_group():
    import dataclasses
    from kvstream.rules import group_key
    snap = tiered_snapshot()
    hashes = np.asarray(snap.block_hash).copy()
    hashes[3] = group_key(H5, 1)  # a group-1 block of the sliding window's table (-1, 3, 4)
    snap = dataclasses.replace(snap, block_hash=hashes)
    assert block_group_of(snap, 3) == 1 and block_group_of(snap, 0) == 0 and block_group_of(snap, 99) is None
    assert hash_words(snap, int(hashes[3]), 1) == f"{H5:016x}, group 1"
    assert hash_words(snap, H0, 0) == f"{H0:016x}, group 0"
    vllm = dataclasses.replace(snap, source="vllm")  # vLLM's tap sends the plain hash already
    assert hash_words(vllm, H5, 1) == f"{H5:016x}, group 1"
    assert hash_words(tiered_snapshot(groups=False), H0, 0) == f"{H0:016x}"
    assert hash_words(snap, HB, None) == f"{HB:016x} (cache key; its KV cache group is not known here)"


def test_a_finished_conversations_sources_and_tables_survive_missing_fields():
    old = conversation(4, Status.FINISHED)  # a source that says nothing of tiers or groups
    snap = PoolSnapshot(step_id=1, block_size=4, num_blocks=2, ref_count=np.zeros(2, np.int32),
                        num_filled=np.zeros(2, np.int32), state=np.zeros(2, np.int8),
                        owner=np.full(2, -1, np.int32), last_access=np.zeros(2, np.int64), block_tables={},
                        conversations=(old,))
    assert snap.tiers == {} and snap.kv_cache_groups == () and snap.group_block_tables == (snap.block_tables,)
    assert block_groups(snap).tolist() == [-1, -1] and group_tables_html(snap, old) == ""
    assert tier(2, {}).state.tolist() == [0, 0]


def test_the_content_book_reads_only_what_changed_and_only_for_pools_with_tiers():
    book = ContentBook()
    plain = tiered_snapshot()
    import dataclasses
    book.observe(dataclasses.replace(plain, tiers={}))  # no tier: nothing is coloured through the book
    assert book.owner(H0) == -1
    book.observe(plain)
    assert book.owner(H0) == 1
    hashes = plain.block_hash.copy()
    owner = plain.owner.copy()
    hashes[6], owner[6] = HB, 2  # one block changed
    book.observe(dataclasses.replace(plain, version=2, block_hash=hashes, owner=owner))
    assert book.owner(HB) == 2 and book.owner(H0) == 1


def test_the_tier_and_group_models_and_renderers_import_no_qt():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    code = ("import sys; import explorer.model.tiers, explorer.model.groups, explorer.model.tier_stats, "
            "explorer.model.conversation_text, explorer.render.tiers, explorer.render.groups; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'pyqtgraph', 'torch')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root)})


def test_tier_owners_look_up_only_changed_slots_and_newly_learnt_owners():
    from explorer.model.tiers import TierOwners
    snap = tiered_snapshot()
    book = ContentBook()
    book.observe(snap)
    owners = TierOwners()
    assert owners.update(snap.tiers["host"], book) and owners.owner.tolist() == [-1, -1, 1, -1]  # HA: not known
    drawn = owners.owner
    assert not owners.update(snap.tiers["host"], book) and owners.owner is drawn  # nothing new: nothing redone
    book.add_events(tier_events())  # HA's STORED event names conversation 2
    assert owners.update(snap.tiers["host"], book) and owners.owner.tolist() == [2, -1, 1, -1]
    assert drawn.tolist() == [-1, -1, 1, -1]  # the array an earlier frame drew from is left alone
    assert not owners.update(tier(4, {0: HA, 1: HB, 2: H0}), book)  # a new slot whose owner nobody knows
    book.add_events([BlockEvent(30, EventKind.STORED, 3, (1,), block_hashes=(HB,), token_ids=(5, 5, 5, 5))])
    assert owners.update(tier(4, {0: HA, 1: HB, 2: H0}), book) and owners.owner.tolist() == [2, 3, 1, -1]

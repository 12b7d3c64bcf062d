"""Block events in words (explorer.model.event_text): a sentence for every kind, short id lists, one line per story."""
import pytest

from kvstream.events import BlockEvent, EventKind
from kvstream.views import FinishReason
from explorer.model import event_colours
from explorer.model.event_text import EventLine, blocks_phrase, describe, finish_words, group, id_list, line_of

K = EventKind

# One representative event per kind and the exact sentence it must give.
EXAMPLES = [
    (BlockEvent(212, K.CONVERSATION_ADDED, 7), "step 212: conversation 7 added"),
    (BlockEvent(212, K.CONVERSATION_ADDED, 7, other_id=3, reason="fork"), "step 212: conversation 7 forked from 3"),
    (BlockEvent(5, K.CONVERSATION_ADDED, 8, other_id=7, reason="sample"),
     "step 5: conversation 8 added, another sample of the request of conversation 7"),
    (BlockEvent(40, K.CONVERSATION_CONTINUED, 2), "step 40: conversation 2 got a reply and waits to run again"),
    (BlockEvent(41, K.CONVERSATION_FINISHED, 2, reason="eos"), "step 41: conversation 2 finished (end-of-sequence)"),
    (BlockEvent(41, K.CONVERSATION_FINISHED, 2, reason="length"), "step 41: conversation 2 finished (max new tokens)"),
    (BlockEvent(41, K.CONVERSATION_FINISHED, 2, reason="context"), "step 41: conversation 2 finished (context limit)"),
    (BlockEvent(42, K.CONVERSATION_ENDED, 2), "step 42: conversation 2 ended by the user"),
    (BlockEvent(3, K.ALLOCATED, 1, (4,)), "step 3: conversation 1 took new block 4"),
    (BlockEvent(3, K.ALLOCATED, 1, (4, 9)), "step 3: conversation 1 took new blocks 4, 9"),
    (BlockEvent(9, K.SHARED, 5, (4, 9, 17), reason="prefix_hit"),
     "step 9: conversation 5 reused 3 cached blocks (4, 9, 17) of its prompt"),
    (BlockEvent(9, K.SHARED, 5, (4,), reason="prefix_hit"),
     "step 9: conversation 5 reused cached block 4 of its prompt"),
    (BlockEvent(9, K.SHARED, 7, (4, 9), other_id=3, reason="fork"),
     "step 9: conversation 7 shares blocks 4, 9 with conversation 3 (fork)"),
    (BlockEvent(230, K.COPIED_ON_WRITE, 7, (17,), (42,)),
     "step 230: block 17 copied on write to 42 for conversation 7"),
    (BlockEvent(8, K.STORED, 3, (4, 9), block_hashes=(11, 12)),
     "step 8: blocks 4, 9 of conversation 3 full and hashed"),
    (BlockEvent(8, K.STORED, -1, (4,), block_hashes=(11,)), "step 8: block 4 full and hashed"),
    (BlockEvent(50, K.RELEASED, 3, (4,)), "step 50: conversation 3 let go of block 4, still held by others"),
    (BlockEvent(50, K.CACHED, 3, (4, 9)),
     "step 50: conversation 3 let go of blocks 4, 9: free, KV kept cached for reuse"),
    (BlockEvent(50, K.FREED, 3, (10,)), "step 50: conversation 3 let go of block 10: free"),
    (BlockEvent(301, K.EVICTED, 9, (12,), block_hashes=(5,)), "step 301: cached block 12 evicted for conversation 9"),
    (BlockEvent(301, K.EVICTED, -1, (12, 13), block_hashes=(5, 6)), "step 301: cached blocks 12, 13 evicted"),
    (BlockEvent(77, K.PREEMPTED, 8, (1, 2)),
     "step 77: conversation 8 preempted: lost blocks 1, 2; it will be recomputed"),
    (BlockEvent(1204, K.RELOCATED, -1, tuple(range(2304)), tuple(range(2304, 4608))),
     "step 1,204: every block moved: 2,304 blocks to new ids"),
    (BlockEvent(1204, K.RELOCATED, -1, (3,), (8,)), "step 1,204: every block moved: 1 block to new ids"),
    (BlockEvent(90, K.CLEARED), "step 90: prefix cache cleared: every hash dropped, cached blocks freed"),
    (BlockEvent(12, K.OFFLOADED, -1, (7,), block_hashes=(0xAB12_0000_0000_0001,), tier="host", tier_slots=(3,)),
     "step 12: block 7 (hash ab12) offloaded to host slot 3"),
    (BlockEvent(14, K.OFFLOADED, block_hashes=(0xAB12_0000_0000_0001,), tier="disk", tier_slots=(5,), reason="host"),
     "step 14: hash ab12 offloaded to disk slot 5 from host"),
    (BlockEvent(13, K.LOADED, 2, (9,), block_hashes=(0xAB12_0000_0000_0001,), tier="host", tier_slots=(3,)),
     "step 13: host slot 3 (hash ab12) loaded into block 9 for conversation 2: a prefix hit, not recomputed"),
    (BlockEvent(14, K.DROPPED, block_hashes=(0xAB12_0000_0000_0001, 0xCD34_0000_0000_0000), tier="host",
                tier_slots=(3, 4), reason="disk"),
     "step 14: host slots 3, 4 (hashes ab12, cd34) dropped: moved on to disk"),
    (BlockEvent(15, K.DROPPED, block_hashes=(0x0001_0000_0000_0000,), tier="disk", tier_slots=(0,)),
     "step 15: disk slot 0 (hash 0001) dropped: its KV is gone"),
    (BlockEvent(15, K.WINDOW_RELEASED, 3, (4,), group=1),
     "step 15: conversation 3's sliding window (group 1) let go of block 4: out of the window, never read again"),
]


@pytest.mark.parametrize("event,sentence", EXAMPLES, ids=[f"{e.kind.value}-{i}" for i, (e, _) in enumerate(EXAMPLES)])
def test_sentence_for_each_kind(event, sentence):
    assert describe(event) == sentence
    assert describe(event, step=False) == sentence.split(": ", 1)[1]


def test_every_kind_is_covered_by_an_example_a_colour_and_a_name():
    assert {e.kind for e, _ in EXAMPLES} == set(EventKind)
    assert set(event_colours.KIND_COLOURS) == set(EventKind) == set(event_colours.KIND_NAMES)
    assert sorted(event_colours.KIND_PRIORITY, key=lambda k: k.value) == sorted(EventKind, key=lambda k: k.value)
    assert len(set(event_colours.KIND_COLOURS.values())) == len(EventKind)  # kinds tell apart by colour


def test_every_finish_reason_has_words():
    for reason in FinishReason:
        text = describe(BlockEvent(1, K.CONVERSATION_FINISHED, 4, reason=reason.value))
        assert text == f"step 1: conversation 4 finished ({finish_words(reason)})"
    assert describe(BlockEvent(1, K.CONVERSATION_FINISHED, 4, reason="stop_string")).endswith("(stop_string)")
    assert describe(BlockEvent(1, K.CONVERSATION_FINISHED, 4)) == "step 1: conversation 4 finished"


def test_long_id_lists_are_shortened():
    assert id_list(range(3)) == "0, 1, 2"
    assert id_list([4, 9, 17] + list(range(100, 112)), limit=3) == "4, 9, 17 and 12 more"
    assert id_list(range(2000), limit=2) == "0, 1 and 1,998 more"
    assert blocks_phrase(()) == "no blocks" and blocks_phrase((5,)) == "block 5"
    text = describe(BlockEvent(3, K.ALLOCATED, 1, tuple(range(20))))
    assert text == "step 3: conversation 1 took new blocks 0, 1, 2, 3, 4, 5, 6, 7 and 12 more"


def test_bad_input_is_refused_clearly():
    with pytest.raises(TypeError, match="BlockEvent"):
        describe({"kind": "allocated"})
    with pytest.raises(TypeError, match="BlockEvent"):
        group([BlockEvent(1, K.CLEARED), "allocated"])


def test_fork_is_one_line():
    events = [BlockEvent(212, K.CONVERSATION_ADDED, 7, other_id=3, reason="fork"),
              BlockEvent(212, K.SHARED, 7, (4, 9, 17), other_id=3, reason="fork")]
    [line] = group(events)
    assert line.sentence == "step 212: conversation 7 forked from 3, shares blocks 4, 9, 17"
    assert line.kind == K.CONVERSATION_ADDED and line.kinds == {K.CONVERSATION_ADDED, K.SHARED}
    assert line.conversation_id == 7 and line.conversation_ids == {3, 7}
    assert line.block_ids == (4, 9, 17) and line.block_id == 4 and line.events == tuple(events)


def test_shares_of_another_conversation_stay_apart():
    events = [BlockEvent(1, K.CONVERSATION_ADDED, 7, other_id=3, reason="fork"),
              BlockEvent(1, K.SHARED, 8, (4,), other_id=3, reason="fork"),
              BlockEvent(1, K.SHARED, 5, (4,), reason="prefix_hit")]
    lines = group(events)
    assert [line.text for line in lines] == [describe(e, step=False) for e in events]


def test_preemption_with_its_releases_is_one_line():
    events = [BlockEvent(77, K.ALLOCATED, 2, (30,)),
              BlockEvent(77, K.PREEMPTED, 8, (1, 2, 3, 4)),
              BlockEvent(77, K.CACHED, 8, (1, 2)),
              BlockEvent(77, K.FREED, 8, (3,)),
              BlockEvent(77, K.RELEASED, 8, (4,))]
    first, second = group(events)
    assert first.text == "conversation 2 took new block 30"
    assert second.text == ("conversation 8 preempted: lost blocks 1, 2, 3, 4 (2 kept cached, 1 freed, "
                           "1 still held by others); it will be recomputed")
    assert second.kind == K.PREEMPTED and second.kinds == {K.PREEMPTED, K.CACHED, K.FREED, K.RELEASED}
    assert second.block_ids == (1, 2, 3, 4)


def test_release_of_blocks_a_preemption_did_not_take_stays_apart():
    events = [BlockEvent(7, K.PREEMPTED, 8, (1,)), BlockEvent(7, K.FREED, 8, (1,)), BlockEvent(7, K.FREED, 8, (9,))]
    lines = group(events)
    assert len(lines) == 2 and lines[1].text == "conversation 8 let go of block 9: free"


def test_finish_and_end_take_their_releases_in_either_order():
    events = [BlockEvent(60, K.CACHED, 5, (9,)),
              BlockEvent(60, K.CONVERSATION_FINISHED, 5, reason="length"),
              BlockEvent(60, K.RELEASED, 5, (4,)),
              BlockEvent(60, K.CONVERSATION_ENDED, 6),
              BlockEvent(60, K.FREED, 6, (11, 12))]
    finish, end = group(events)
    assert finish.text == ("conversation 5 finished (max new tokens), let go of blocks 9, 4: 1 kept cached, "
                           "1 still held by others")
    assert finish.kind == K.CONVERSATION_FINISHED and len(finish.events) == 3
    assert end.text == "conversation 6 ended by the user, let go of blocks 11, 12: 2 freed"


def test_lone_events_keep_their_own_lines_and_order():
    events = [e for e, _ in EXAMPLES]
    lines = group(events)
    # Only the examples that tell one story together may merge; every event appears in exactly one line.
    assert sorted(id(e) for line in lines for e in line.events) == sorted(id(e) for e in events)
    assert [line.events[0] for line in lines] == [e for e in events if any(line.events[0] is e for line in lines)]


def test_a_frame_without_stories_gives_the_same_lines_as_one_searched_for_them():
    """A frame with no fork or lifecycle event skips the search for stories (a busy pool sends thousands of such
    events a frame): its lines must be what the search would have made, conversations of forks and samples
    included, and a bad item is still refused."""
    lone = [e for e, _ in EXAMPLES if e.kind not in (K.CONVERSATION_ADDED, K.PREEMPTED, K.CONVERSATION_FINISHED,
                                                       K.CONVERSATION_ENDED)]
    lone += [BlockEvent(9, K.SHARED, -1, (4,), other_id=3, reason="fork"),  # no conversation of its own
             BlockEvent(9, K.SHARED, 3, (4,), other_id=3, reason="fork")]  # the parent named twice
    fast = group(lone)
    searched = group(lone + [BlockEvent(10**6, K.CONVERSATION_ENDED, 10**6)])[:-1]  # a lead: the search runs
    assert len(fast) == len(lone) == len(searched)
    for a, b in zip(fast, searched):
        assert (a.step_id, a.kind, a.kinds, a.conversation_id, a.conversation_ids, a.events, a.text, a.block_ids) \
            == (b.step_id, b.kind, b.kinds, b.conversation_id, b.conversation_ids, b.events, b.text, b.block_ids)
    assert fast[-2].conversation_ids == {3} and fast[-1].conversation_ids == {3}
    for line, e in zip(fast, lone):
        assert line.events == (e,) and line.kinds == {e.kind} and line.text == describe(e, step=False)
        assert line.conversation_ids == {e.conversation_id, e.other_id} - {-1}
    with pytest.raises(TypeError, match="BlockEvent"):
        group([BlockEvent(1, K.ALLOCATED, 1, (4,)), "allocated"])


def test_line_targets():
    cow = line_of(BlockEvent(230, K.COPIED_ON_WRITE, 7, (17,), (42,)))
    assert cow.block_id == 42 and cow.block_ids == (17, 42) and cow.conversation_id == 7
    moved = line_of(BlockEvent(5, K.RELOCATED, -1, (1, 2), (5, 6)))
    assert moved.block_id == -1 and moved.conversation_id == -1 and set(moved.block_ids) == {1, 2, 5, 6}
    assert isinstance(moved, EventLine)


def test_releases_of_another_step_in_the_same_frame_stay_apart():
    # As the engine orders them: a preemption's releases follow it, a finish's come first. A frame spanning
    # several steps (run_until_idle between two frames) must not hand step 43's releases to step 22's preemption.
    events = [BlockEvent(22, K.PREEMPTED, 5, (37, 15, 7)), BlockEvent(22, K.RELEASED, 5, (37, 15)),
              BlockEvent(22, K.FREED, 5, (7,)),
              BlockEvent(43, K.RELEASED, 5, (37, 15)), BlockEvent(43, K.CACHED, 5, (7,)),
              BlockEvent(43, K.CONVERSATION_FINISHED, 5, reason="length")]
    preempt, finish = group(events)
    assert preempt.events == tuple(events[:3]) and finish.events == (events[5], events[3], events[4])
    assert finish.sentence == ("step 43: conversation 5 finished (max new tokens), let go of blocks 37, 15, 7: "
                               "1 kept cached, 2 still held by others")


def test_real_engine_events_read_as_sentences():
    from itertools import groupby

    from tests.event_workload import engine_frames
    _, pairs = engine_frames()
    kinds = {e.kind for _, e in pairs}
    assert {K.CONVERSATION_ADDED, K.CONVERSATION_CONTINUED, K.CONVERSATION_FINISHED, K.CONVERSATION_ENDED,
            K.ALLOCATED, K.SHARED, K.COPIED_ON_WRITE, K.STORED, K.RELEASED, K.CACHED, K.FREED, K.EVICTED,
            K.PREEMPTED, K.RELOCATED} <= kinds  # all but CLEARED: the workload exercises the pool
    merged = []
    for _, frame in groupby(pairs, key=lambda pair: pair[0]):
        events = [e for _, e in frame]
        lines = group(events)
        assert sorted(id(e) for line in lines for e in line.events) == sorted(id(e) for e in events)
        for line in lines:
            assert "?" not in line.text and line.sentence.startswith(f"step {line.step_id:,}: ")
            if line.conversation_id >= 0:
                assert f"conversation {line.conversation_id}" in line.text
            merged += [line] if len(line.events) > 1 else []
    forks = [line for line in merged if line.kind == K.CONVERSATION_ADDED]
    assert forks and all(" forked from " in line.text and ", shares blocks " in line.text for line in forks)
    finishes = [line for line in merged if line.kind == K.CONVERSATION_FINISHED]
    # A finish's own releases name exactly the blocks it held: none twice, none from another step.
    assert finishes and all(len(set(line.block_ids)) == len(line.block_ids) for line in finishes)
    assert all({e.step_id for e in line.events} == {line.step_id} for line in merged)


def test_a_blocks_story_names_the_group_of_a_hash_beyond_the_first():
    """The same plain hash is two pieces of content in two KV cache groups: a block's history line says which, as
    the inspector's hash field does ("…, group 1")."""
    from explorer.model.event_text import block_phrase
    h = 0x1111_2222_3333_4444
    stored = BlockEvent(4, EventKind.STORED, 2, (6,), block_hashes=(h,), group=1)
    assert f"(hash {h:016x}, group 1)" in block_phrase(stored, 6)
    assert f"(hash {h:016x})" in block_phrase(BlockEvent(4, EventKind.STORED, 2, (5,), block_hashes=(h,)), 5)
    loaded = BlockEvent(9, EventKind.LOADED, 3, (6,), block_hashes=(h,), tier="host", tier_slots=(1,), group=1)
    assert f"host slot 1 (hash {h:016x}, group 1)" in block_phrase(loaded, 6)


def test_what_the_served_traffics_clients_do_is_worded_as_theirs_not_the_users():
    served = {2, 5}
    reply, end = BlockEvent(40, K.CONVERSATION_CONTINUED, 2), BlockEvent(42, K.CONVERSATION_ENDED, 5)
    assert describe(reply, served=served) == "step 40: conversation 2: the client replied; it waits to run again"
    assert describe(end, served=served) == "step 42: conversation 5 ended: the client left"
    assert describe(BlockEvent(42, K.CONVERSATION_ENDED, 3), served=served) == (
        "step 42: conversation 3 ended by the user")
    lines = group([reply, end, BlockEvent(42, K.FREED, 5, (10,)), BlockEvent(42, K.CONVERSATION_ENDED, 3)], served)
    assert [line.text for line in lines] == [
        "conversation 2: the client replied; it waits to run again",
        "conversation 5 ended: the client left, let go of block 10: 1 freed", "conversation 3 ended by the user"]
    assert finish_words("ended", served=True) == "the client left" and finish_words("ended") == "ended by user"

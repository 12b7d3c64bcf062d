"""Why a prompt missed, in words, without a display: the conversation detail's sentence, the inspector's lines, the
prompt check's sentence, regretted evictions found in the conversations' accounts, and step times as the window
saw them (issue 46)."""
from __future__ import annotations

import pytest

from engine import Engine, EngineConfig
from kvstream.prompt_check import Held, Removal, classify_prompt
from kvstream.views import BlockOutcome
from explorer.model.outcome_text import (block_outcome_words, block_prompt_lines, check_block_words, check_sentence,
                                         duration_words, index_ranges, missed_indices, outcomes_sentence)
from explorer.model.regrets import RegretBook
from explorer.model.step_clock import StepClock


def _o(i, outcome, *rest):
    return BlockOutcome(i, outcome, *rest)


def test_the_sentence_of_an_admission():
    outcomes = (_o(0, "device"), _o(1, "device"), _o(2, "device"), _o(3, "evicted", 812, 31, "lru", 40),
                _o(4, "after_break"), _o(5, "after_break"), _o(6, "partial"))
    assert outcomes_sentence(outcomes) == (
        "3 of 7 prompt blocks hit on the device; block 3 was evicted at step 812 for conversation 31 after 40 steps "
        "idle, by LRU; blocks 4-5 were held but recomputed after an earlier miss; block 6 was not full (only full "
        "blocks are cached)")
    clock = StepClock()
    clock.saw(700, now=100.0)
    clock.saw(900, now=160.0)
    text = outcomes_sentence(outcomes, clock, names={31: "request cmpl-9"})
    assert "after 40 steps idle (12 s)" in text and "for request cmpl-9" in text
    assert outcomes_sentence(()) == ""  # the source did not say


@pytest.mark.parametrize("outcomes, words", [
    ((_o(0, "cold"), _o(1, "cold")), "none of 2 prompt blocks hit; blocks 0-1 were never in the pool before (cold)"),
    ((_o(0, "host"), _o(1, "disk"), _o(2, "device")), "all 3 prompt blocks hit: 1 on the device, 1 from the host "
                                                       "tier, 1 from the disk tier"),
    ((_o(0, "device"), _o(1, "last_token")), "block 1 was held, but holds the prompt's last token"),
    ((_o(0, "window"), _o(1, "window"), _o(2, "partial")), "blocks 0-1 were let go by the sliding window"),
    ((_o(0, "salted"),), "its one prompt block missed; block 0 was salted"),
    ((_o(0, "evicted", 5, -1, "reset", 2),), "block 0 was evicted at step 5 after 2 steps idle, by a prefix-cache "
                                             "reset"),
    ((_o(0, "evicted", 5, 3, "host tier", None),), "evicted at step 5 for conversation 3, by the host tier"),
])
def test_each_cause_in_words(outcomes, words):
    assert words in outcomes_sentence(outcomes)


def test_many_evictions_are_counted_not_listed():
    outcomes = tuple(_o(i, "evicted", 10 + i, 1, "fifo", 1) for i in range(6))
    text = outcomes_sentence(outcomes)
    assert text.count("was evicted at step") == 3 and "blocks 3-5 were evicted too" in text


def test_ranges_and_durations():
    assert index_ranges([7, 0, 1, 2, 5, 8, 9]) == "0-2, 5 and 7-9"
    assert index_ranges([4]) == "4" and index_ranges([]) == ""
    assert [duration_words(s) for s in (0.42, 12.4, 185, 7800)] == ["0.4 s", "12 s", "3 min 5 s", "2 h 10 min"]


def test_the_inspectors_lines_name_each_owners_prompt_block():
    eng = Engine(EngineConfig(model="none", block_size=4, num_blocks=16))
    eng.add_conversation(prompt_token_ids=list(range(1, 10)), max_new_tokens=30)
    eng.step()
    b = eng.add_conversation(prompt_token_ids=list(range(1, 9)) + [50, 51], max_new_tokens=30)
    eng.step()
    snap = eng.snapshot()
    shared = snap.block_tables[b][0]
    lines = block_prompt_lines(snap, snap.owners_of(shared))
    assert lines == ["conversation 0, prompt block 0: a miss: never in the pool before (cold)",
                     "conversation 1, prompt block 0: a hit on the device"]
    tail = snap.block_tables[b][2]  # its partial last prompt block, computed
    assert block_prompt_lines(snap, snap.owners_of(tail)) == [
        "conversation 1, prompt block 2: not cached: the prompt's last block was not full"]
    assert missed_indices(snap.conversation(b).prompt_block_outcomes) == [2]
    eng.close()


def test_one_block_in_words():
    assert block_outcome_words(_o(2, "host")) == "a hit from the host tier"
    assert block_outcome_words(_o(2, "evicted", 812, 31, "lru", 40)) == \
        "a miss: evicted at step 812 for conversation 31 after 40 steps idle, by LRU"


def test_a_prompt_check_in_words():
    on = Held("device", 9, 1)
    gone = Removal(812, None, "lru", 31, 40)
    check = classify_prompt(21, 4, [on, on, on, None, None], lambda i: gone if i == 3 else None)
    text = check_sentence(check)
    assert text.startswith("12 of 21 prompt tokens would come from the cache (3 of 6 blocks, on the device)")
    assert "block 3 was stored, then evicted at step 812 for conversation 31 after 40 steps idle, by LRU" in text
    assert "block 4 is never stored" in text and "block 5 is shorter than a block" in text
    assert check_block_words(check.blocks[0], check) == "would hit on the device, block 9"
    kv = classify_prompt(8, 4, [on, None], lambda i: Removal(None, 1000.0, "removed"), checked_at=1030.0)
    assert "(30 s before the check)" in check_sentence(kv)
    assert check_sentence(classify_prompt(3, 4, [])).startswith("none of its 3 prompt tokens")


def test_regretted_evictions_come_from_the_admissions_accounts():
    eng = Engine(EngineConfig(model="none", block_size=4, num_blocks=8, eviction_policy="fifo"))
    book = RegretBook()
    first = list(range(1, 14))
    eng.add_conversation(prompt_token_ids=first, max_new_tokens=1)
    eng.run_until_idle()
    assert book.observe(eng.snapshot()) == []
    thief = eng.add_conversation(prompt_token_ids=list(range(200, 224)), max_new_tokens=1)
    eng.run_until_idle()
    evicted = [e for e in eng.take_events() if e.kind == "evicted"]
    assert book.observe(eng.snapshot()) == []  # an eviction is not a regret until someone wanted it back
    back = eng.add_conversation(prompt_token_ids=first, max_new_tokens=1)
    eng.run_until_idle()
    regrets = book.observe(eng.snapshot())
    assert regrets and {r.step for r in regrets} <= {e.step_id for e in evicted}
    assert all(r.victim == back and r.outcome.evicted_for == thief for r in regrets)
    assert book.observe(eng.snapshot()) == []  # the same admission is read once
    assert book.at_step(regrets[0].step)
    eng.close()


def test_the_step_clock():
    clock = StepClock(capacity=4)
    assert clock.time_of(3) is None
    for step, t in ((10, 1.0), (20, 3.0), (20, 9.0), (15, 4.0), (30, 4.0)):
        clock.saw(step, now=t)
    assert clock.time_of(15) == 2.0 and clock.seconds_between(10, 30) == 3.0
    assert clock.time_of(9) is None and clock.time_of(31) is None
    for step in (40, 50, 60):  # past its capacity: the newest half is kept
        clock.saw(step, now=float(step))
    assert clock.time_of(10) is None and clock.time_of(55) == 55.0

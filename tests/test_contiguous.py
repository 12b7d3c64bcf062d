"""The contiguous allocator model against hand-computed placements, and on a real engine's busy demo."""
import numpy as np
import pytest

from kvstream.views import ConversationInfo, PoolSnapshot, Status
from explorer.model.contiguous import (FILLED_SLOT, FREE_SLOT, GAP_SLOT, RESERVED_SLOT, ContiguousAllocator,
                                 request_slots)


def conv(cid, prompt, max_new, computed=0, status=Status.RUNNING, arrival=0):
    return ConversationInfo(conversation_id=cid, status=status, prompt_token_ids=tuple(range(prompt)),
                            output_token_ids=(), output_text="", prompt_text="", block_table=(),
                            num_computed_tokens=computed, num_cached_tokens=0, max_new_tokens=max_new,
                            temperature=0.0, parent_id=None, num_preemptions=0, arrival_step=arrival)


def snap(step, conversations, num_blocks=8, block_size=4):
    n = num_blocks
    return PoolSnapshot(step_id=step, block_size=block_size, num_blocks=n, ref_count=np.zeros(n, np.int32),
                        num_filled=np.zeros(n, np.int32), state=np.zeros(n, np.int8), owner=np.full(n, -1, np.int32),
                        last_access=np.zeros(n, np.int64), block_tables={}, conversations=tuple(conversations))


def runs(layout):
    return [(r.conversation_id, r.start, r.length, r.filled) for r in layout.reservations]


def test_hand_computed_first_fit_queue_and_release():
    # 8 blocks x 4 slots = 32 slots. A wants 6 + 10 = 16, B 4 + 4 = 8, C 5 + 7 = 12, D 2 + 2 = 4.
    model = ContiguousAllocator()
    a, b, c, d = conv(0, 6, 10, 6), conv(1, 4, 4, 4), conv(2, 5, 7, 0, Status.WAITING, 1), conv(3, 2, 2, 2, arrival=1)
    layout = model.update(snap(1, [a, b, c, d]))
    # A at 0..16, B at 16..24; C needs 12 but only 8 are left: it waits, and D waits behind it (first come first)
    assert runs(layout) == [(0, 0, 16, 6), (1, 16, 8, 4)]
    assert layout.waiting == (2, 3) and layout.num_running == 2 and layout.num_waiting == 2
    assert layout.paged_running == 3 and layout.paged_waiting == 1
    assert layout.num_reserved_slots == 24 and layout.num_filled_slots == 10
    assert layout.num_reserved_empty_slots == 14 and layout.num_gap_slots == 0 and layout.largest_free_run == 8
    assert layout.summary() == ("paged: 3 running, 1 waiting; contiguous: 2 running, 2 waiting, "
                                "44% of its memory reserved but empty")  # 14 / 32
    roles = layout.slot_roles()
    assert list(roles[:6]) == [FILLED_SLOT] * 6 and list(roles[6:16]) == [RESERVED_SLOT] * 10
    assert list(roles[16:20]) == [FILLED_SLOT] * 4 and list(roles[20:24]) == [RESERVED_SLOT] * 4
    assert list(roles[24:]) == [FREE_SLOT] * 8

    # B finishes: 16..32 is free, C goes to 16..28 and D to 28..32; A has decoded 3 more tokens
    b_done = conv(1, 4, 4, 4, Status.FINISHED)
    layout = model.update(snap(2, [conv(0, 6, 10, 9), b_done, conv(2, 5, 7, 5, arrival=1),
                                   conv(3, 2, 2, 3, arrival=1)]))
    assert runs(layout) == [(0, 0, 16, 9), (2, 16, 12, 5), (3, 28, 4, 3)]
    assert layout.waiting == () and layout.num_free_slots == 0

    # A ends; E (10 + 10 = 20) arrives: the largest hole is A's 16 slots, so E waits; those 16 are a gap now
    layout = model.update(snap(3, [conv(0, 6, 10, 9, Status.ENDED), conv(2, 5, 7, 6, arrival=1),
                                   conv(3, 2, 2, 4, arrival=1), conv(4, 10, 10, 0, Status.WAITING, 3)]))
    assert runs(layout) == [(2, 16, 12, 6), (3, 28, 4, 4)]
    assert layout.waiting == (4,) and layout.num_gap_slots == 16 and layout.largest_free_run == 16
    assert layout.num_reserved_empty_slots == 6
    roles = layout.slot_roles()
    assert list(roles[:16]) == [GAP_SLOT] * 16
    assert layout.summary() == ("paged: 2 running, 1 waiting; contiguous: 2 running, 1 waiting, "
                                "19% of its memory reserved but empty, 50% in gaps between reservations")  # 6, 16 of 32
    owners = layout.slot_owners()
    assert owners[15] == -1 and owners[16] == 2 and owners[31] == 3
    assert layout.reservation_at(20).conversation_id == 2 and layout.reservation_at(3) is None


def test_a_reply_asks_again_with_its_longer_prompt():
    model = ContiguousAllocator()
    model.update(snap(1, [conv(0, 4, 4, 4)]))
    layout = model.update(snap(2, [conv(0, 4, 4, 8, Status.FINISHED)]))
    assert layout.reservations == ()
    layout = model.update(snap(5, [conv(0, 12, 6, 0, Status.WAITING, arrival=5)]))  # continued at step 5
    assert runs(layout) == [(0, 0, 18, 0)]


def test_requests_larger_than_memory_are_counted_but_do_not_block_the_queue():
    model = ContiguousAllocator()
    layout = model.update(snap(1, [conv(0, 30, 10), conv(1, 2, 2, arrival=1)]))  # 40 > 32 slots
    assert layout.never_fits == (0,) and runs(layout) == [(1, 0, 4, 0)] and layout.num_waiting == 1
    assert "can never fit" in layout.summary()


def test_new_pool_or_going_back_in_time_starts_over():
    model = ContiguousAllocator()
    model.update(snap(5, [conv(0, 4, 4), conv(1, 4, 4, arrival=1)]))
    layout = model.update(snap(6, [conv(1, 4, 4, arrival=1)]))
    assert runs(layout) == [(1, 8, 8, 0)]  # a placed run never moves
    layout = model.update(snap(2, [conv(1, 4, 4, arrival=1)]))  # scrubbed back: placed afresh
    assert runs(layout) == [(1, 0, 8, 0)]
    layout = model.update(snap(3, [conv(1, 4, 4, arrival=1)], num_blocks=4, block_size=8))
    assert layout.num_slots == 32 and layout.block_size == 8


def test_busy_demo_on_a_real_engine_keeps_runs_apart():
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import seed_busy
    engine = Engine(EngineConfig(model="builtin", num_blocks=24, block_size=16))
    seed_busy(engine)
    model = ContiguousAllocator()
    more_paged = []
    for _ in range(6):
        engine.step()
        snapshot = engine.snapshot()
        layout = model.update(snapshot)
        live = [c for c in snapshot.conversations if c.is_live]
        assert layout.num_running + layout.num_waiting == len(live)
        ends = [(r.start, r.end) for r in layout.reservations]
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ends, ends[1:])) and (not ends or ends[-1][1] <= 384)
        for r in layout.reservations:
            assert r.length == request_slots(snapshot.conversation(r.conversation_id))
        roles = layout.slot_roles()
        assert int((roles == FILLED_SLOT).sum()) == layout.num_filled_slots
        assert int((roles == RESERVED_SLOT).sum()) == layout.num_reserved_empty_slots
        more_paged.append(layout.paged_running > layout.num_running)
    # busy reserves more than the pool's 384 slots in all: paging runs all five at first, contiguous cannot
    assert more_paged[0]


@pytest.mark.parametrize("count", [0, 1])
def test_empty_memory(count):
    model = ContiguousAllocator()
    layout = model.update(snap(1, [conv(0, 2, 2, 1)][:count]))
    assert layout.slot_roles().shape == (32,) and layout.largest_free_run == 32 - 4 * count


def test_the_model_imports_neither_qt_nor_torch():
    import subprocess
    import sys
    code = ("import sys, explorer.model.contiguous; "
            "print(sorted(m for m in ('PySide6', 'torch', 'pyqtgraph') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "[]"

"""Relocating blocks from the main window while conversations decode changes nothing they compute."""
from PySide6 import QtCore

from engine import Engine
from explorer.widgets.relocation import human_bytes
from test_gui_support import make_config, wait_for_snapshot

PROMPTS = ("Pages are not addresses.", "Blocks of four slots each.", "A table maps logical to physical.")


def add_all(engine):
    for prompt in PROMPTS:
        engine.add_conversation(prompt, max_new_tokens=40, temperature=0.0)


def test_relocation_during_live_decode_keeps_every_token(qtbot, make_window):
    reference = Engine(make_config())
    add_all(reference)
    reference.run_until_idle()
    expected = [c.output_token_ids for c in reference.conversations()]

    window = make_window(setup=add_all, speed=25)
    panel = window.relocation
    for compact in (False, True, False):
        last = window.snapshot.step_id
        wait_for_snapshot(qtbot, window, lambda s: s.step_id >= last + 2)
        count = len(panel.reports)
        qtbot.mouseClick(panel.compact if compact else panel.scramble, QtCore.Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: len(panel.reports) == count + 1, timeout=5000)
        report = panel.reports[-1]
        assert report.max_abs_diff == 0.0
        assert "max |before − after| = 0" in panel.readout.text()
    assert panel.reports[0].num_conversations_checked == len(PROMPTS)  # the first move happened mid-decode
    assert panel.reports[0].num_moved > 0
    snap = wait_for_snapshot(qtbot, window, lambda s: all(str(c.status) == "finished" for c in s.conversations),
                             timeout=15000)
    assert [c.output_token_ids for c in snap.conversations] == expected
    assert window.errors == []


def test_memory_readout_matches_snapshot(qtbot, make_window):
    window = make_window(setup=lambda e: (add_all(e), e.step(), e.step()), paused=True)
    mem = window.snapshot.memory
    text = window.relocation.memory_text()
    assert text["Block tables"] == human_bytes(mem.block_table_bytes)
    assert text["KV in use (filled slots)"].endswith(f"({mem.num_filled_slots} slots)")
    assert text["Empty tail slots"].endswith(f"({mem.num_tail_empty_slots} slots)")
    assert text["Contiguous reservation"].endswith(f"({mem.num_contiguous_slots} slots)")
    assert mem.num_contiguous_slots > mem.num_allocated_slots  # reserving max length would take more

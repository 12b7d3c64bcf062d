"""The lesson's second chapter: the same toy head through a sliding window of 4 positions in blocks of 4.

Paging never drops KV (it only addresses it); a window drops the KV the model will never read again. The engine
part runs without Qt; the window part drives the real LessonWindow offscreen.
"""
from __future__ import annotations

import pytest

from engine.lesson import ToyPagedSequence
from kvstream.views import BlockState
from explorer.model.lesson_text import explanation


def twins(n: int) -> tuple[ToyPagedSequence, ToyPagedSequence]:
    window, paging = ToyPagedSequence(sliding_window=4), ToyPagedSequence()
    for _ in range(n):
        window.step()
        paging.step()
    return window, paging


def test_the_first_block_is_released_once_position_8_arrives_and_paging_alone_releases_nothing():
    window, paging = ToyPagedSequence(sliding_window=4), ToyPagedSequence()
    tables = []
    for n in range(1, 9):
        window.step()
        paging.step()
        tables.append((n, list(window.block_table), list(paging.block_table)))
        assert all(b >= 0 for b in paging.block_table)  # paging alone never releases anything
    assert tables[6] == (7, [4, 1], [4, 1])  # position 7 still reads position 4, in the first block
    assert tables[7] == (8, [-1, 1], [4, 1])  # position 8: the window is 5..8, block 4 is never read again
    assert window.released == [(8, 0, 4)]
    assert window.pool.state[4] == BlockState.FREE and window.free_queue == (0, 4)  # back in the free queue
    assert paging.pool.state[4] == BlockState.USED


def test_the_windowed_output_is_the_mean_of_the_last_four_positions():
    window = ToyPagedSequence(sliding_window=4)
    readouts = []
    for _ in range(10):
        window.step()
        readouts.append(window.result())
        assert window.result() == window.expected()
    assert readouts == [1.0, 1.5, 2.0, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5]


def test_a_released_block_is_never_read_again():
    window, _ = twins(8)
    before = window.result()
    window.value_cache[4] = 1000.0  # whatever the freed block holds now cannot change the output
    assert window.result() == before == 6.5


def test_a_long_window_holds_a_bounded_number_of_blocks_while_paging_runs_out():
    window, paging = ToyPagedSequence(sliding_window=4), ToyPagedSequence()
    for _ in range(40):
        window.step()
        assert len(window.live_blocks) <= 2  # ceil(window / block size) + 1
        if paging.can_step():
            paging.step()
    assert window.num_positions == 40 and window.result() == (37 + 40) / 2
    assert paging.num_positions == 12 and not paging.can_step()  # full attention keeps every block
    assert [at for at, _, _ in window.released] == list(range(8, 41, 4))  # one block every 4 positions


def test_memory_counts_only_the_kv_the_window_keeps():
    window, paging = twins(8)
    assert window.memory()["filled_slots"] == 4 and paging.memory()["filled_slots"] == 8
    assert window.memory()["released_blocks"] == 1


def test_layout_change_keeps_the_holes_and_the_result():
    window, _ = twins(9)
    before = window.result()
    change = window.change_layout(seed=3)
    assert window.block_table[0] == -1 and all(b >= 0 for b in window.block_table[1:])
    assert change.bit_identical and window.result() == before
    window.step()
    assert window.result() == window.expected()


def test_the_explanation_at_position_8_says_why_the_block_goes():
    window, _ = twins(8)
    title, text = explanation(window)
    assert title == "Position 8: logical block 0 is released"
    assert "never read them again" in text and "Paging alone never releases anything" in text
    assert "0 → released (-1), 1 → 1" in text


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_a_bad_window_is_refused(bad):
    with pytest.raises(ValueError):
        ToyPagedSequence(sliding_window=bad)


# ---- window part (pytest-qt, offscreen) ---------------------------------------------------------------------
def _plain(html: str) -> str:
    from PySide6.QtGui import QTextDocument
    doc = QTextDocument()
    doc.setHtml(html)
    return " ".join(doc.toPlainText().split())


def test_chapter_two_shows_paging_alone_beside_the_window(qtbot):
    from PySide6.QtCore import Qt

    from explorer.window.lesson import LessonWindow
    w = LessonWindow()
    qtbot.addWidget(w)
    w.show()
    qtbot.mouseClick(w.window_button, Qt.LeftButton)
    assert w.lesson.sliding_window == 4 and w.paging is not None
    assert not w.layout_button.isEnabled()
    for _ in range(7):
        qtbot.mouseClick(w.step_button, Qt.LeftButton)
    assert "Nothing released yet" in _plain(w.compare_label.text())
    qtbot.mouseClick(w.step_button, Qt.LeftButton)
    assert w.before_panel.isVisible()
    assert w.before_panel.title.text() == "Paging alone (full attention): 2 blocks held"
    assert w.current_panel.title.text() == "Window of 4: 1 block held"
    assert _plain(w.before_panel.table.text()).endswith("physical 4 1")
    assert _plain(w.table_text()).endswith("physical ∅ 1")
    assert "logical 0 (physical 4) at position 8" in _plain(w.compare_label.text())
    assert _plain(w.result_text()).startswith("Attention output 6.5 the window of 4 over positions 5..8 = "
                                              "mean(5, 6, 7, 8) = 26/4")
    assert w.explain_title.text() == "Position 8: logical block 0 is released"
    qtbot.mouseClick(w.window_button, Qt.LeftButton)  # back to chapter 1: plain paging, from the start
    assert w.paging is None and w.lesson.sliding_window is None and w.lesson.num_positions == 0
    assert not w.before_panel.isVisible()

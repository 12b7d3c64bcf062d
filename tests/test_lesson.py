"""The lesson: a toy head (keys 0, query 1, values 1, 2, 3, ...) stepped through a paged pool of 4-slot blocks.

The engine part runs without Qt; the window part drives the real LessonWindow offscreen and reads its labels.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.kv.pool import BlockPool
from engine.lesson import BLOCK_SIZE, ToyPagedSequence
from explorer.model.lesson_text import explanation
from kvstream.views import BlockState


def stepped(n: int) -> ToyPagedSequence:
    toy = ToyPagedSequence()
    for _ in range(n):
        toy.step()
    return toy


# ---- engine part (no Qt) ------------------------------------------------------------------------------------
def test_readouts_for_positions_one_to_five_are_the_running_mean():
    toy = ToyPagedSequence()
    readouts = []
    for _ in range(5):
        toy.step()
        readouts.append(toy.result())
    assert readouts == [1.0, 1.5, 2.0, 2.5, 3.0]


def test_readouts_keep_matching_the_mean_until_the_pool_is_full():
    toy = ToyPagedSequence()
    while toy.can_step():
        toy.step()
        assert toy.result() == toy.expected() == (toy.num_positions + 1) / 2
    assert toy.num_positions == 12  # 3 blocks: the tenants B and D keep the other five
    with pytest.raises(RuntimeError):
        toy.step()


def test_the_pool_uses_the_engines_shapes_and_block_pool():
    toy = stepped(5)
    assert isinstance(toy.pool, BlockPool)
    assert toy.key_cache.shape == (8, BLOCK_SIZE, 1, 1) == toy.value_cache.shape
    assert (toy.key_cache[4] == 0).all()
    assert toy.value_cache[4, :, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert toy.value_cache[1, 0, 0, 0].item() == 5.0
    assert toy.pool.ref_count[4] == toy.pool.ref_count[1] == 1


def test_second_block_appears_exactly_at_position_five():
    toy = ToyPagedSequence()
    tables = []
    for _ in range(5):
        event = toy.step()
        tables.append(list(toy.block_table))
        assert event.allocated == (event.position in (1, 5))
    assert [len(t) for t in tables] == [1, 1, 1, 1, 2]
    assert tables[-1] == [4, 1]  # logical 0 -> physical 4, logical 1 -> physical 1: not adjacent
    assert abs(tables[-1][0] - tables[-1][1]) > 1


def test_non_adjacent_blocks_come_from_the_block_pool_free_queue():
    toy = ToyPagedSequence()
    assert toy.free_queue == (4, 1, 0)  # arranged by the tenants' history, not by the lesson
    roles = toy.block_roles()
    assert roles == ["free", "free", "B", "B", "free", "D", "D", "D"]
    toy.step()
    assert toy.free_queue == (1, 0)
    for _ in range(4):
        toy.step()
    assert toy.free_queue == (0,)
    assert toy.block_roles()[2:4] == ["B", "B"]  # the block between stayed with another conversation


def test_at_position_five_first_block_full_second_one_entry_three_free_slots():
    toy = stepped(5)
    first, second = toy.block_table
    assert toy.pool.num_filled[first] == 4
    assert toy.pool.num_filled[second] == 1
    values = toy.slot_values()
    assert values[first].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert values[second][0] == 5.0 and np.isnan(values[second][1:]).all()
    memory = toy.memory()
    assert memory["empty_tail_slots"] == 3
    assert memory["tail_bytes"] == 3 * 8 and memory["table_bytes"] == 2 * 4


def test_prefix_block_did_not_move_between_positions_four_and_five():
    toy = stepped(4)
    table_before = list(toy.block_table)
    keys_before = toy.key_cache[table_before[0]].clone()
    values_before = toy.value_cache[table_before[0]].clone()
    toy.step()
    assert toy.block_table[0] == table_before[0]
    assert torch.equal(toy.key_cache[table_before[0]], keys_before)
    assert torch.equal(toy.value_cache[table_before[0]], values_before)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_layout_change_keeps_result_bit_identical_and_moves_every_block(seed):
    toy = stepped(5)
    before_table = tuple(toy.block_table)
    before = toy.result()
    change = toy.change_layout(seed)
    after = toy.result()
    assert change.before_table == before_table == (4, 1)
    assert change.after_table == tuple(toy.block_table)
    assert all(a != b for a, b in zip(change.before_table, change.after_table))
    assert np.float32(before).tobytes() == np.float32(after).tobytes() == np.float32(3.0).tobytes()
    assert change.bit_identical and change.before_result == change.after_result == 3.0
    new_first, new_second = change.after_table
    assert toy.value_cache[new_first, :, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert toy.value_cache[new_second, 0, 0, 0].item() == 5.0
    assert toy.pool.num_filled[new_first] == 4 and toy.pool.num_filled[new_second] == 1
    assert toy.pool.state[new_first] == toy.pool.state[new_second] == BlockState.USED


@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
def test_the_lesson_in_fp8_reads_what_its_pool_stored_and_a_layout_change_keeps_the_bits(kind):
    """An fp8 pool (the engine's --kv-cache-dtype): the toy's values are stored as the engine's cache write stores
    them (e5m2 has two mantissa bits: 9 is read back as 8, 11 as 10), the output is the mean of what was stored, and
    moving every block gives the same bits."""
    toy = ToyPagedSequence(kv_cache_dtype=kind)
    assert toy.key_cache.dtype == (torch.float8_e5m2 if kind == "fp8_e5m2" else torch.float8_e4m3fn)
    while toy.can_step():
        toy.step()
    n = toy.num_positions
    stored = [float(toy.value_cache[toy.block_table[(p - 1) // 4], (p - 1) % 4, 0, 0].float())
              for p in range(1, n + 1)]
    assert stored == ([p if p not in (9, 11) else p - 1 for p in range(1, n + 1)] if kind == "fp8_e5m2"
                      else list(range(1, n + 1)))
    assert toy.expected() == sum(stored) / n
    assert abs(toy.result() - toy.expected()) < 1e-6
    change = toy.change_layout(5)
    assert change.bit_identical and np.float32(change.before_result).tobytes() == np.float32(toy.result()).tobytes()
    assert toy.memory()["kv_bytes"] == n * 2  # a byte for the key and one for the value
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ToyPagedSequence(kv_cache_dtype="fp4")


def test_after_layout_change_the_sequence_keeps_growing_correctly():
    toy = stepped(5)
    toy.change_layout(3)
    while toy.can_step():
        toy.step()
        assert toy.result() == (toy.num_positions + 1) / 2


def test_a_wrong_table_would_give_a_wrong_answer():
    """The readout really depends on the table: the tenants' slots hold other values."""
    toy = stepped(5)
    toy.seq.block_table = [toy.block_table[0], 2]  # point logical 1 at tenant B's block
    assert toy.result() != 3.0


def test_every_step_has_an_explanation_with_the_key_ideas():
    toy = ToyPagedSequence()
    texts = [" ".join(explanation(toy))]
    while toy.can_step():
        toy.step()
        texts.append(" ".join(explanation(toy)))
    assert all(t.strip() for t in texts)
    everything = " ".join(texts).lower()
    for idea in ("page", "table", "empty", "compress", "flashattention", "prefix caching"):
        assert idea in everything, idea
    toy = stepped(5)
    toy.change_layout(0)
    assert "same" in " ".join(explanation(toy)).lower()


def test_lesson_engine_imports_no_qt():
    import subprocess
    import sys
    code = "import sys, engine.lesson; print(any(m.startswith(('PySide6', 'pyqtgraph')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "False"


# ---- window part (pytest-qt, offscreen) ---------------------------------------------------------------------
@pytest.fixture
def window(qtbot):
    from explorer.window.lesson import LessonWindow
    w = LessonWindow()
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    return w


def _plain(html: str) -> str:
    from PySide6.QtGui import QTextDocument
    doc = QTextDocument()
    doc.setHtml(html)
    return " ".join(doc.toPlainText().split())


def test_step_button_drives_the_lesson_and_labels_show_the_means(window, qtbot):
    from PySide6.QtCore import Qt
    shown = []
    for _ in range(5):
        qtbot.mouseClick(window.step_button, Qt.LeftButton)
        shown.append(_plain(window.result_text()))
    assert window.lesson.num_positions == 5
    for text, expected in zip(shown, ["1", "1.5", "2", "2.5", "3"]):
        assert text.startswith(f"Attention output {expected} ")
    assert "mean(1, 2, 3, 4, 5)" in shown[-1]
    assert _plain(window.table_text()) == "Block table (logical → physical) logical 0 1 physical 4 1"
    assert "Position 5 needs a second block" == window.explain_title.text()


def test_space_and_right_arrow_step(window, qtbot):
    from PySide6.QtCore import Qt
    window.activateWindow()
    qtbot.waitUntil(lambda: window.isActiveWindow())
    qtbot.keyClick(window, Qt.Key_Space)
    assert window.lesson.num_positions == 1
    qtbot.keyClick(window, Qt.Key_Right)
    assert window.lesson.num_positions == 2
    assert _plain(window.result_text()).startswith("Attention output 1.5 ")


def test_change_layout_shows_both_tables_and_results_side_by_side(window, qtbot):
    from PySide6.QtCore import Qt
    assert not window.before_panel.isVisible()
    for _ in range(5):
        qtbot.mouseClick(window.step_button, Qt.LeftButton)
    qtbot.mouseClick(window.layout_button, Qt.LeftButton)
    change = window.lesson.last_change
    assert window.before_panel.isVisible() and window.compare_label.isVisible()
    before_table = _plain(window.before_panel.table.text())
    after_table = _plain(window.current_panel.table.text())
    assert before_table.endswith("physical 4 1")
    assert after_table.endswith("physical " + " ".join(map(str, change.after_table)))
    assert before_table != after_table
    assert _plain(window.before_panel.result.text()).startswith("Attention output 3 ")
    assert _plain(window.current_panel.result.text()).startswith("Attention output 3 ")
    assert "bit-identical" in _plain(window.compare_label.text())
    qtbot.mouseClick(window.step_button, Qt.LeftButton)  # a new position ends the comparison
    assert not window.before_panel.isVisible()
    assert _plain(window.result_text()).startswith("Attention output 3.5 ")


def test_reset_and_full_pool(window, qtbot):
    from PySide6.QtCore import Qt
    clicks = 0
    while window.step_button.isEnabled() and clicks < 20:
        qtbot.mouseClick(window.step_button, Qt.LeftButton)
        clicks += 1
    assert window.lesson.num_positions == 12 and not window.step_button.isEnabled()
    assert window.explain_title.text() == "The pool is full"
    qtbot.mouseClick(window.reset_button, Qt.LeftButton)
    assert window.lesson.num_positions == 0 and window.step_button.isEnabled()
    assert math.isnan(window.lesson.result())
    assert "no positions yet" in _plain(window.result_text())


def test_pool_image_is_one_rgba_image_of_slot_cells(window):
    from explorer.window.lesson import CELL_X, CELL_Y, lesson_rgba
    for _ in range(5):
        window.step()
    view = window.lesson.view()
    image = lesson_rgba(view)
    assert image.dtype == np.uint8 and image.shape == (8 * CELL_Y, 4 * CELL_X, 4)
    centre = lambda b, s: image[b * CELL_Y + CELL_Y // 2, s * CELL_X + CELL_X // 2]  # noqa: E731
    assert (centre(4, 0) == centre(4, 3)).all()  # full first block: four filled slots, one colour
    assert (centre(1, 1) != centre(4, 1)).any()  # empty tail slots look different from filled ones
    drawn = window.current_panel.pool.image.image
    assert drawn.shape == image.shape and (drawn == image).all()

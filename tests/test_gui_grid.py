"""The snapshot-to-image function on synthetic snapshots, and the grid widget's hover/click mapping."""
import numpy as np
import pytest

from engine.snapshot import BlockState, PoolSnapshot
from explorer import palette
from explorer.grid import COLOR_BY, grid_geometry, snapshot_to_rgba


def make_snapshot(num_blocks=8, block_size=4, used=(), cached=(), step_id=10, tables=None):
    """``used``: (block, owner, filled, ref_count); ``cached``: (block, last_owner)."""
    state = np.zeros(num_blocks, np.int8)
    ref = np.zeros(num_blocks, np.int32)
    filled = np.zeros(num_blocks, np.int32)
    owner = np.full(num_blocks, -1, np.int32)
    last = np.zeros(num_blocks, np.int64)
    for block, who, n, r in used:
        state[block], owner[block], filled[block], ref[block] = BlockState.USED, who, n, r
        last[block] = step_id
    for block, who in cached:
        state[block], owner[block], filled[block] = BlockState.CACHED, who, block_size
    return PoolSnapshot(step_id=step_id, block_size=block_size, num_blocks=num_blocks, ref_count=ref,
                        num_filled=filled, state=state, owner=owner, last_access=last,
                        block_tables=tables or {}, conversations=())


def cell(image, geo, block, dy, dx):
    x, y = geo.cell_origin(block)
    return tuple(int(c) for c in image[y * geo.tile + dy, x * geo.tile + dx, :3])


def colour_of(conversation_id):
    return tuple(int(c) for c in palette.conversation_colours(np.array([conversation_id]))[0][:3])


@pytest.fixture
def small():
    snap = make_snapshot(used=[(0, 1, 4, 1), (1, 1, 1, 1), (2, 2, 4, 2), (5, 3, 2, 1)], cached=[(3, 1)],
                         tables={1: (0, 1), 2: (2,), 3: (2, 5)})
    return snap, grid_geometry(snap.num_blocks, snap.block_size)


def test_free_used_and_cached_colours(small):
    snap, geo = small
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    assert image.shape == (geo.rows * geo.tile, geo.cols * geo.tile, 4) and image.dtype == np.uint8
    mid = geo.tile // 2
    assert cell(image, geo, 4, mid, mid) == tuple(palette.FREE[:3])
    assert cell(image, geo, 0, mid, mid) == colour_of(1)  # full used block: its owner's colour
    cached = cell(image, geo, 3, mid, mid)
    assert cached != colour_of(1) and cached != tuple(palette.FREE[:3])
    muted = tuple(int(c) for c in palette.mix(palette.conversation_colours(np.array([1]))[0], palette.UNOWNED,
                                              palette.CACHED_MIX)[:3])
    assert cached == muted  # muted, with a hint of the last owner
    assert cell(image, geo, 0, 0, 0) == tuple(palette.BACKGROUND[:3])  # gap between cells


def test_partial_tail_is_visibly_partial(small):
    snap, geo = small
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    mid, t = geo.tile // 2, geo.tile
    left, right = cell(image, geo, 1, mid, 3), cell(image, geo, 1, mid, t - 3)  # 1 of 4 slots filled
    assert left == colour_of(1)
    assert right == tuple(int(c) for c in palette.scale(palette.conversation_colours(np.array([1]))[0],
                                                         palette.EMPTY_SLOT_LEVEL)[:3])
    assert sum(right) < sum(left)
    full_right = cell(image, geo, 0, mid, t - 3)
    assert full_right == colour_of(1)  # a full block is bright to its last slot


def test_shared_block_has_outline_and_unshared_does_not(small):
    snap, geo = small
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    assert cell(image, geo, 2, 1, geo.tile // 2) == tuple(palette.SHARED_RING[:3])
    assert cell(image, geo, 0, 1, geo.tile // 2) != tuple(palette.SHARED_RING[:3])
    assert cell(image, geo, 2, geo.tile // 2, geo.tile // 2) == colour_of(2)


def test_selected_block_and_conversation(small):
    snap, geo = small
    image = snapshot_to_rgba(snap, "owner", selected_conversation=3, selected_block=0, geometry=geo)
    mid = geo.tile // 2
    assert cell(image, geo, 0, 1, mid) == tuple(palette.SELECTED_RING[:3])
    assert cell(image, geo, 5, mid, 3) == colour_of(3)  # in conversation 3: normal
    assert cell(image, geo, 2, mid, mid) == colour_of(2)  # shared block of conversation 3 stays bright
    dimmed = cell(image, geo, 0, mid, mid)  # block of conversation 1: dimmed
    assert sum(dimmed) < sum(colour_of(1)) * 0.5
    image = snapshot_to_rgba(snap, "owner", selected_conversation=1, geometry=geo)
    assert cell(image, geo, 3, mid, mid) == cell(snapshot_to_rgba(snap, "owner", geometry=geo), geo, 3, mid, mid)
    assert sum(cell(image, geo, 5, mid, 3)) < sum(colour_of(3)) * 0.5  # the cached block it left stays lit


def test_colour_by_modes_differ(small):
    snap, geo = small
    images = {mode: snapshot_to_rgba(snap, mode, geometry=geo) for mode in COLOR_BY}
    mid = geo.tile // 2
    assert cell(images["state"], geo, 0, mid, mid) == tuple(palette.STATE_USED[:3])
    assert cell(images["state"], geo, 3, mid, mid) == tuple(palette.STATE_CACHED[:3])
    assert cell(images["ref_count"], geo, 2, mid, mid) == tuple(palette.REF_COLOURS[2][:3])
    assert cell(images["ref_count"], geo, 0, mid, mid) == tuple(palette.REF_COLOURS[1][:3])
    assert cell(images["fill"], geo, 0, mid, 3) != cell(images["fill"], geo, 5, mid, 3)  # 4/4 vs 2/4 filled
    for mode in COLOR_BY:
        assert cell(images[mode], geo, 4, mid, mid) == tuple(palette.FREE[:3])
    with pytest.raises(ValueError):
        snapshot_to_rgba(snap, "nonsense")


def test_age_colours_recent_brighter_than_old():
    snap = make_snapshot(used=[(0, 0, 4, 1), (1, 0, 4, 1)], step_id=300)
    last = np.array(snap.last_access)
    last[0], last[1] = 300, 10
    snap = PoolSnapshot(**{**snap.__dict__, "last_access": last})
    geo = grid_geometry(snap.num_blocks, snap.block_size)
    image = snapshot_to_rgba(snap, "age", geometry=geo)
    mid = geo.tile // 2
    assert sum(cell(image, geo, 0, mid, mid)) > sum(cell(image, geo, 1, mid, mid))


def test_large_pool_fits_and_shades_fill():
    n, bs = 65536, 16
    used = [(0, 5, 16, 1), (1, 5, 4, 1), (2, 6, 16, 3)]
    snap = make_snapshot(num_blocks=n, block_size=bs, used=used)
    geo = grid_geometry(n, bs)
    assert (geo.cols, geo.rows) == (256, 256) and not geo.striped
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    assert image.shape[0] <= 512 and image.shape[1] <= 512  # about its size on screen: no aliasing
    t = geo.tile
    full, quarter = cell(image, geo, 0, t - 1, t - 1), cell(image, geo, 1, t - 1, t - 1)
    assert full == colour_of(5)
    assert sum(quarter) < sum(full)  # a quarter-filled block is a darker shade
    lit = palette.mix(palette.conversation_colours(np.array([6])), palette.SHARED_RING[None], 0.45)[0]
    assert cell(image, geo, 2, 0, 0) == tuple(int(c) for c in lit[:3])  # too small for an outline: lightened
    assert cell(image, geo, n - 1, t - 1, t - 1) == tuple(palette.FREE[:3])


def test_pool_that_does_not_fill_the_last_row():
    snap = make_snapshot(num_blocks=100, block_size=16, used=[(99, 2, 16, 1)])
    geo = grid_geometry(100, 16)
    assert geo.cols * geo.rows >= 100 and geo.block_at(geo.cols - 1, geo.rows - 1) is None
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    mid = geo.tile // 2
    assert cell(image, geo, 99, mid, mid) == colour_of(2)
    x, y = geo.cols - 1, geo.rows - 1
    assert tuple(int(c) for c in image[y * geo.tile + mid, x * geo.tile + mid, :3]) == tuple(palette.BACKGROUND[:3])


def test_conversation_colours_are_stable_and_distinct():
    a = palette.conversation_colours(np.arange(12))
    b = palette.conversation_colours(np.array([11, 3, 0]))
    assert (a[[11, 3, 0]] == b).all()
    assert len({tuple(row) for row in a}) == 12


def test_grid_widget_hover_and_click(qtbot, small):
    from PySide6 import QtCore
    from explorer.grid_view import GridView
    snap, geo = small
    view = GridView()
    qtbot.addWidget(view)
    view.resize(500, 400)
    view.show()
    qtbot.waitExposed(view)
    view.set_snapshot(snap)
    assert view.render() and not view.render()  # draws once, then only when something changed
    clicked = []
    view.blockClicked.connect(clicked.append)
    for block in (2, 4):
        qtbot.mouseClick(view.view.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=view.cell_center(block))
    assert clicked == [2, 4]
    scene_pos = view.view.mapToScene(view.cell_center(5))
    view._on_mouse_moved(scene_pos)
    assert "block 5: used" in view.hover_label.text() and "conv 3 (logical 1)" in view.hover_label.text()
    assert view.cell_colour(0) == colour_of(1)


def test_grid_is_rebuilt_only_when_the_pool_changes(qtbot, small):
    from explorer.grid_view import GridView
    snap, _ = small
    view = GridView()
    qtbot.addWidget(view)
    view.set_snapshot(snap)
    assert view.render()
    republished = PoolSnapshot(**{**snap.__dict__, "ref_count": np.array(snap.ref_count)})  # after a command
    view.set_snapshot(republished)
    assert not view.render() and view.snapshot is republished
    state = np.array(snap.state)
    state[4] = BlockState.CACHED  # same step, changed pool (e.g. a conversation ended while paused)
    view.set_snapshot(PoolSnapshot(**{**snap.__dict__, "state": state}))
    assert view.render()
    view.set_snapshot(PoolSnapshot(**{**snap.__dict__, "step_id": snap.step_id + 1}))  # a new step
    assert view.render()
    view.set_color_by("fill")
    assert view.render() and not view.render()


def test_metrics_keep_one_sample_per_step():
    from explorer.metrics import MetricsHistory
    snap = make_snapshot(step_id=5)
    history = MetricsHistory()
    for _ in range(3):  # published again after commands, same step
        history.record(snap)
    history.record(PoolSnapshot(**{**snap.__dict__, "step_id": 6}))
    assert list(history.series("step")) == [5, 6]


def test_inspector_sentences():
    from explorer.inspector import _conversations, token_label
    assert _conversations([3]) == "conversation 3"
    assert _conversations([1, 0]) == "conversations 0, 1"
    assert token_label(" the") == "␣the" and token_label("\n") == "\\n"

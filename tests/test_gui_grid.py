"""The snapshot-to-image function on synthetic snapshots, and the grid widget's hover/click mapping."""
import dataclasses
import itertools

import numpy as np
import pytest
from PySide6 import QtGui
from kvstream.views import BlockState, PoolSnapshot
from explorer.model import palette
from explorer.render.grid import COLOR_BY, grid_geometry, snapshot_to_rgba


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


def colours_of(ids, snapshot=None, book=None):
    """RGBA of conversations ``ids`` in ``book`` (default: a book of ``snapshot`` alone, as a grid drawn without a
    source's book colours it)."""
    if book is None:
        book = palette.ColourBook()
        if snapshot is not None:
            book.observe(snapshot)
    return palette.conversation_colours(np.asarray(ids), book)


def colour_of(conversation_id, snapshot=None):
    return tuple(int(c) for c in colours_of([conversation_id], snapshot)[0][:3])


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
    muted = tuple(int(c) for c in palette.cached(colours_of([1])[0])[:3])
    assert cached == muted  # muted, with a hint of the last owner
    assert cell(image, geo, 0, 0, 0) == tuple(palette.BACKGROUND[:3])  # gap between cells


def test_partial_tail_is_visibly_partial(small):
    snap, geo = small
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    mid, t = geo.tile // 2, geo.tile
    left, right = cell(image, geo, 1, mid, 3), cell(image, geo, 1, mid, t - 3)  # 1 of 4 slots filled
    assert left == colour_of(1)
    assert right == tuple(int(c) for c in palette.scale(colours_of([1])[0],
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
    snap = dataclasses.replace(snap, last_access=last)
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
    lit = palette.mix(colours_of([6]), palette.SHARED_RING[None], 0.45)[0]
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
    book = palette.ColourBook()  # ids the book has not seen live
    a = palette.conversation_colours(np.arange(12), book)
    b = palette.conversation_colours(np.array([11, 3, 0]), book)
    assert (a[[11, 3, 0]] == b).all()
    assert len({tuple(row) for row in a}) == 12


def test_grid_widget_hover_and_click(qtbot, shown, small):
    from PySide6 import QtCore
    from explorer.widgets.grid_view import GridView
    snap, geo = small
    view = shown(GridView(), 500, 400)
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
    from explorer.widgets.grid_view import GridView
    snap, _ = small
    view = GridView()
    qtbot.addWidget(view)
    view.set_snapshot(snap)
    assert view.render()
    republished = dataclasses.replace(snap, ref_count=np.array(snap.ref_count))  # after a command
    view.set_snapshot(republished)
    assert not view.render() and view.snapshot is republished
    state = np.array(snap.state)
    state[4] = BlockState.CACHED  # same step, changed pool (e.g. a conversation ended while paused): a new version
    changed = dataclasses.replace(snap, state=state, version=snap.version + 1)
    view.set_snapshot(changed)
    assert view.render()
    view.set_snapshot(dataclasses.replace(changed, step_id=snap.step_id + 1))  # a new step
    assert view.render()
    view.set_snapshot(dataclasses.replace(changed, step_id=snap.step_id + 1, source="vllm"))  # another source
    assert view.render()
    view.set_color_by("fill")
    assert view.render() and not view.render()


def test_hover_line_follows_the_pool_under_a_resting_mouse(qtbot, shown, small):
    """Found in the X window: after Scramble the hover line still said 'block 27: used ... owners conv 1' of a
    block the relocation had freed (the inspector, rightly, said it moved)."""
    from explorer.widgets.grid_view import GridView
    snap, _ = small
    view = shown(GridView(), 500, 400)
    view.set_snapshot(snap)
    view.render()
    view._on_mouse_moved(view.view.mapToScene(view.cell_center(5)))
    assert view.hover_label.text().startswith("block 5: used")
    state, ref, owner = np.array(snap.state), np.array(snap.ref_count), np.array(snap.owner)
    state[5], ref[5], owner[5] = BlockState.FREE, 0, -1  # conversation 3's tail moved elsewhere
    moved = dataclasses.replace(snap, state=state, ref_count=ref, owner=owner,
                                block_tables={1: (0, 1), 2: (2,), 3: (2, 6)}, step_id=snap.step_id + 1)
    view.set_snapshot(moved)
    view.render()
    assert view.hover_label.text().startswith("block 5: free") and "conv 3" not in view.hover_label.text()


def hovered_grid(shown, snap, block):
    """A shown GridView drawing ``snap`` with the mouse over ``block``'s cell."""
    from explorer.widgets.grid_view import GridView
    view = shown(GridView(), 500, 400)
    view.set_snapshot(snap)
    view.render()
    view._on_mouse_moved(view.view.mapToScene(view.cell_center(block)))
    return view


def test_the_hover_line_clears_when_the_mouse_leaves_the_grid(qtbot, shown, small):
    """Issue 49: the hover line under the grid kept describing the last cell after the mouse had left."""
    from PySide6 import QtCore
    from explorer.widgets.grid_view import HOVER_HINT
    snap, _ = small
    view = hovered_grid(shown, snap, 5)
    assert view.hover_label.text().startswith("block 5: used")
    QtCore.QCoreApplication.sendEvent(view.view.viewport(), QtCore.QEvent(QtCore.QEvent.Type.Leave))
    assert view.hover_label.text() == HOVER_HINT and view.hovered_block is None
    view.set_snapshot(dataclasses.replace(snap, step_id=snap.step_id + 1))  # a later frame brings nothing back
    view.render()
    assert view.hover_label.text() == HOVER_HINT


def test_metrics_keep_one_sample_per_step():
    from explorer.model.metrics_history import MetricsHistory
    snap = make_snapshot(step_id=5)
    history = MetricsHistory()
    for _ in range(3):  # published again after commands, same step
        history.record(snap)
    history.record(dataclasses.replace(snap, step_id=6))
    assert list(history.series("step")) == [5, 6]


def test_inspector_sentences():
    from explorer.widgets.inspector import _conversations, token_label
    assert _conversations([3]) == "conversation 3"
    assert _conversations([1, 0]) == "conversations 0, 1"
    assert token_label(" the") == "␣the" and token_label("\n") == "\\n"


# ---- issue 13 -------------------------------------------------------------------------------------------------
def conversation(cid, status="running", arrival=0):
    from kvstream.views import ConversationInfo, Status
    return ConversationInfo(conversation_id=cid, status=Status(status), prompt_token_ids=(1, 2), output_token_ids=(),
                            output_text="", prompt_text="", block_table=(), num_computed_tokens=2,
                            num_cached_tokens=0, max_new_tokens=4, temperature=0.0, parent_id=None, num_preemptions=0,
                            arrival_step=arrival)


def lab(rgb):
    """CIELAB of sRGB colours [..., 3] (D65), for perceptual distances."""
    c = np.asarray(rgb, float)[..., :3] / 255
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = c @ m.T / np.array([0.9505, 1.0, 1.089])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def min_distance(colours):
    points = lab(colours)
    d = np.linalg.norm(points[:, None] - points[None], axis=-1)
    np.fill_diagonal(d, np.inf)
    return d.min()


def test_owner_colour_follows_owner_after_fork_and_end():
    """Conversation 9 forked into 10, then 9 ended: 10 is the only owner of the shared first blocks now."""
    used = [(b, 10, 4, 1) for b in range(4)] + [(4, 10, 2, 1), (5, 11, 4, 2)]
    snap = make_snapshot(num_blocks=16, used=used, tables={10: (0, 1, 2, 3, 4), 11: (5,), 12: (5,)})
    convs = (conversation(9, "ended"), conversation(10, arrival=1), conversation(11, arrival=2),
             conversation(12, arrival=3))
    snap = dataclasses.replace(snap, conversations=convs)
    geo = grid_geometry(snap.num_blocks, snap.block_size)
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    mid = geo.tile // 2
    for block in range(5):
        assert cell(image, geo, block, mid, 3) == colour_of(10, snap) != colour_of(9, snap)
    assert cell(image, geo, 5, mid, mid) == colour_of(11, snap)  # shared: the earliest holder's colour


def test_live_conversations_get_clearly_different_colours_and_keep_them():
    book = palette.ColourBook()
    live = [3, 11, 19, 24, 32, 40, 45, 53, 58, 66, 71, 79]  # ids 8 or 13 apart looked alike under the old hue walk
    snap = make_snapshot()
    snap = dataclasses.replace(snap, conversations=tuple(conversation(c, arrival=i) for i, c in
                                                                   enumerate(live)))
    book.observe(snap)
    colours = palette.conversation_colours(np.array(live), book)
    assert min_distance(colours) > 40  # CIELAB distance; 2.3 is a just-noticeable difference
    reserved = np.array([palette.FREE, palette.UNOWNED, palette.SHARED_RING, palette.SELECTED_RING])
    assert np.linalg.norm(lab(colours)[:, None] - lab(reserved)[None], axis=-1).min() > 25
    before = {c: tuple(palette.conversation_colours(np.array([c]), book)[0]) for c in live}
    # 3 finishes, 90 arrives: everyone keeps their colour, and the newcomer differs from every live one
    later = tuple(conversation(c, "finished" if c == 3 else "running", i) for i, c in enumerate(live)) + (
        conversation(90, arrival=20),)
    book.observe(dataclasses.replace(snap, conversations=later))
    assert all(tuple(palette.conversation_colours(np.array([c]), book)[0]) == before[c] for c in live)
    now_live = live[1:] + [90]
    assert min_distance(palette.conversation_colours(np.array(now_live), book)) > 40


def test_grid_tooltip_appears_and_stays(qtbot, shown, small):
    """The scene used to answer Qt's tooltip request with 'no tooltip' and hide it 300 ms later."""
    from PySide6 import QtCore, QtGui, QtWidgets
    from explorer.widgets.grid_view import GridView
    snap, _ = small
    view = shown(GridView(), 500, 400)
    view.activateWindow()
    qtbot.waitUntil(view.isActiveWindow)  # activating the window later would close the tooltip, as Qt does
    view.set_snapshot(snap)
    view.render()
    viewport = view.view.viewport()
    pos = view.cell_center(5)
    qtbot.mouseMove(viewport, pos)  # the mouse comes to rest on block 5 ...
    qtbot.wait(50)
    QtWidgets.QApplication.sendEvent(viewport, QtGui.QHelpEvent(QtCore.QEvent.Type.ToolTip, pos,  # ... so Qt
                                                                viewport.mapToGlobal(pos)))  # asks for a tooltip
    qtbot.wait(600)  # longer than the 300 ms after which the scene's "no tooltip here" used to hide it
    assert QtWidgets.QToolTip.isVisible()
    assert QtWidgets.QToolTip.text().startswith("block 5: used\nref count 1") and "conv 3" in QtWidgets.QToolTip.text()
    QtWidgets.QToolTip.hideText()


def test_zoomed_in_cells_show_their_block_ids(qtbot, shown):
    from PySide6 import QtCore
    from explorer.widgets.grid_view import GridView
    snap = make_snapshot(num_blocks=1024, block_size=16, used=[(0, 1, 16, 1), (33, 2, 16, 2)], tables={2: (33,)})
    view = shown(GridView(), 500, 400)
    view.set_snapshot(snap)
    view.render()
    assert view.label_texts() == []  # 1,024 cells in view: too small for text
    view.box.setRange(QtCore.QRectF(0, 0, 16, 8), padding=0)
    assert view.label_texts() == []  # 128 cells, but about 30 px each: the labels would hide their colours
    view.box.setRange(QtCore.QRectF(0, 0, 4, 4), padding=0)
    texts = view.label_texts()
    assert "0" in texts and "33 ×2" in texts and "2" in texts and len(texts) <= 36


def test_a_conversation_first_seen_stopped_does_not_look_like_a_live_one():
    book = palette.ColourBook()
    snap = make_snapshot()
    convs = (conversation(0, "finished"), conversation(1, arrival=1), conversation(2, arrival=2))
    book.observe(dataclasses.replace(snap, conversations=convs))
    colours = {tuple(palette.conversation_colours(np.array([c]), book)[0]) for c in (0, 1, 2)}
    assert len(colours) == 3


def test_every_cell_gap_survives_a_small_view(qtbot):
    """Found in the X window at 1024 x 640: 32-pixel tiles drawn 26 pixels wide lost gap rows and columns (Qt
    scales without smoothing), so free cells merged into larger blocks. The tile follows the screen size now."""
    from explorer.widgets.grid_view import GridView
    view = GridView()
    qtbot.addWidget(view)
    view.set_snapshot(make_snapshot(num_blocks=128, block_size=16))
    for width, height in ((480, 300), (900, 640), (330, 700)):
        view.resize(width, height)
        view.show()
        qtbot.waitExposed(view)
        for _ in range(3):  # draw, fit, draw again at the tile the fit calls for
            view.fit_whole_pool()
            view.render()
            qtbot.wait(10)
        geo = view.geometry_
        assert geo.tile <= view.pixels_per_cell()
        image = view.view.viewport().grab().toImage()
        free = QtGui.QColor(*[int(c) for c in palette.FREE[:3]]).rgb()

        def runs(points):  # how many separate stretches of free-cell colour a line of pixels crosses
            inside = [image.pixel(x, y) == free for x, y in points]
            return sum(1 for i, now in enumerate(inside) if now and (i == 0 or not inside[i - 1]))

        from PySide6 import QtCore
        inside = view.view.mapFromScene(view.box.mapViewToScene(QtCore.QPointF(0.85, 1.75)))  # clear of id labels
        assert runs([(x, inside.y()) for x in range(image.width())]) == geo.cols, (width, height)
        assert runs([(inside.x(), y) for y in range(image.height())]) == geo.rows, (width, height)


def test_free_blocks_are_plain_cells_and_used_ones_show_their_slots():
    """Found in the X window at block size 8: slot separators in every free cell read like the gaps between
    cells, so the pool looked like a grid of thin stripes."""
    snap = make_snapshot(num_blocks=16, block_size=8, used=[(0, 1, 8, 1)])
    geo = grid_geometry(16, 8, pixels_per_cell=40)
    assert geo.striped
    image = snapshot_to_rgba(snap, "owner", geometry=geo)
    t = geo.tile
    free = image[t + t // 2, 1:t]  # a free cell's middle pixel row, past its gap column
    assert (free[:, :3] == palette.FREE[:3]).all()
    used = image[t // 2, 1:t, :3]
    assert len({tuple(px) for px in used}) == 2  # the owner's colour and the darker slot separators


def test_colours_are_worked_out_once_per_snapshot(qtbot):
    """The grid, the conversations table and the detail all observe the snapshot they draw; the book sorts its
    conversations once per snapshot, not once per caller."""
    from explorer.widgets.conversations import ConversationsPanel
    from explorer.widgets.grid_view import GridView
    book = palette.ColourBook()  # one source's book, handed to both as the window does
    snap = dataclasses.replace(make_snapshot(), conversations=tuple(conversation(c, arrival=c) for c in range(5)))
    view, panel = GridView(), ConversationsPanel()
    qtbot.addWidget(view), qtbot.addWidget(panel)
    view.colours = book
    panel.set_colour_book(book)
    view.set_snapshot(snap)
    view.render()
    panel.refresh(snap)
    panel.select_conversation(2)
    panel.refresh(snap)
    assert book.sorts == 1
    later = dataclasses.replace(snap, version=snap.version + 1, conversations=snap.conversations + (
        conversation(9, arrival=9),))
    view.set_snapshot(later)
    view.render()
    panel.refresh(later)
    assert book.sorts == 2 and len(set(map(tuple, palette.conversation_colours(np.arange(5).tolist() + [9], book))))\
        == 6


@pytest.mark.parametrize("block_size, num_blocks", [(16, 4096), (4, 64), (16, 256)])  # shaded, striped, outlined
def test_drawing_only_the_changed_blocks_gives_the_whole_image_at_every_step(block_size, num_blocks):
    """The grid redraws only the blocks that changed since its last image (explorer.render.grid.redraw_blocks); at every
    step of a real workload (forks, shared prefixes, copy-on-write, eviction) and in every colour mode, with a block
    and a conversation selected or not, the image equals the one drawn whole."""
    from engine import Engine, EngineConfig
    from explorer.render.grid import changed_blocks, redraw_blocks
    engine = Engine(EngineConfig(model="builtin", num_blocks=num_blocks, block_size=block_size))
    rng = np.random.default_rng(4)
    prefix = [int(t) for t in rng.integers(3, 200, 40)]
    for i in range(6):
        engine.add_conversation(prompt_token_ids=prefix + [int(t) for t in rng.integers(3, 200, 5 + 7 * i)],
                                max_new_tokens=12 + 9 * i, ignore_eos=True)
    snaps, records = [engine.snapshot()], [None]
    for step in range(60):
        if step == 8:
            engine.fork_conversation(engine.conversations()[0].conversation_id)
        if not engine.has_work():
            break
        engine.step()
        snaps.append(engine.snapshot())
        records.append(engine.change_record(snaps[-1]))  # what a feed's frame carries (FeedFrame.changes)
    geo = grid_geometry(num_blocks, block_size)
    partial = 0
    for mode, selected_block, selected_conversation, recorded in itertools.product(
            ("owner", "ref_count", "fill", "state"), (None, 3), (None, 1), (False, True)):
        book = palette.ColourBook()  # a source's book: live conversations keep their colours from frame to frame
        image = snapshot_to_rgba(snaps[0], mode, selected_conversation, selected_block, geo, book)
        for before, after, record in zip(snaps, snaps[1:], records[1:]):
            ids = changed_blocks(before, after, mode, selected_conversation, record) if recorded else \
                changed_blocks(before, after, mode, selected_conversation)
            whole = snapshot_to_rgba(after, mode, selected_conversation, selected_block, geo, book)
            if ids is None:
                image = whole
                continue
            redraw_blocks(image, after, ids, mode, selected_conversation, selected_block, geo, book)
            partial += 1
            assert np.array_equal(image, whole), (mode, selected_block, after.step_id)
    assert partial > 400  # most steps were drawn in part
    assert changed_blocks(snaps[0], snaps[1], "age") is None  # age colours move with every step: whole images


def test_the_grid_draws_what_the_frame_says_changed_and_compares_nothing():
    """With a frame's change record whose base is the image drawn, the blocks redrawn are the ones it names: an
    array that differs elsewhere is not even looked at. Without one (a frame of history, a stream), it compares."""
    from kvstream.views import BlockState, ChangeRecord, block_masks
    from explorer.render.grid import changed_blocks
    before = make_snapshot(num_blocks=64, used=[(0, 1, 4, 1), (2, 2, 4, 1), (5, 3, 2, 1)], tables={1: (0,), 2: (2,),
                                                                                                  3: (5,)})
    state = np.array(before.state)
    state[[2, 5]] = BlockState.FREE  # two blocks changed in the arrays
    after = dataclasses.replace(before, state=state, version=before.version + 1)
    named = np.zeros(before.num_blocks, bool)
    named[5] = True  # the record names one of them
    named.setflags(write=False)
    record = ChangeRecord(before, block_masks(after, before, named))
    assert list(changed_blocks(before, after, "state", changes=record)) == [5]
    assert list(changed_blocks(before, after, "state")) == [2, 5]  # no record: compared
    other = ChangeRecord(after, record.block_masks)  # a record from another frame than the one drawn: compared
    assert list(changed_blocks(before, after, "state", changes=other)) == [2, 5]


def test_the_grid_widget_draws_the_changed_blocks_and_shows_what_a_whole_redraw_would(qtbot):
    from engine import Engine, EngineConfig
    from explorer.widgets.grid_view import GridView
    engine = Engine(EngineConfig(model="builtin", num_blocks=1024, block_size=16))
    for i in range(4):  # the first finishes early: when the book starts over, the others' entries move up
        engine.add_conversation(prompt_token_ids=list(range(3, 40 + 9 * i)), max_new_tokens=6 if i == 0 else 40,
                                ignore_eos=True)
    view = GridView()
    qtbot.addWidget(view)
    view.resize(500, 500)
    view.show()
    for step in range(30):
        if step in (10, 15):  # newcomers: the colour book hands out entries while the image is drawn in part
            engine.add_conversation(prompt_token_ids=list(range(5, 30 + step)), max_new_tokens=8, ignore_eos=True)
        if step == 25:  # the book starts over (the newcomers have finished): live ones get other entries
            view.colours.clear()
        engine.step()
        snap = engine.snapshot()
        view.set_snapshot(snap, engine.change_record(snap))  # with its frame's record, as the pane hands it on
        if step % 3 == 1:  # a frame taken but not drawn (the grid draws at most once a tick): records chain
            engine.step()
            snap = engine.snapshot()
            view.set_snapshot(snap, engine.change_record(snap))
        if step == 20:
            view.set_selected_block(int(next(iter(snap.block_tables.values()))[0]))
        assert view.render()
        whole = snapshot_to_rgba(snap, view.color_by, view.selected_conversation, view.selected_block,
                                 view.geometry_, view.colours)
        assert np.array_equal(view.image, whole), step
    assert view.partial_draws >= 20


def test_hover_line_forgets_a_block_a_smaller_pool_lacks(qtbot, shown, small):
    """Found in the X window: after a restart to a smaller pool the hover line kept describing block 7."""
    from explorer.widgets.grid_view import HOVER_HINT
    snap, _ = small
    view = hovered_grid(shown, snap, 7)
    assert view.hover_label.text().startswith("block 7")
    view.set_snapshot(make_snapshot(num_blocks=4))
    view.render()
    assert view.hover_label.text() == HOVER_HINT and view.hovered_block is None
    view._on_mouse_moved(view.view.mapToScene(view.cell_center(3)))
    assert view.hover_label.text().startswith("block 3")
    view.reset_view()  # an engine restart
    assert view.hover_label.text() == HOVER_HINT


def _zoomed_grid(qtbot, shown, snap, cells: int):
    """A shown GridView of ``snap``, zoomed to ``cells`` x ``cells`` cells (so the cells carry labels)."""
    from PySide6 import QtCore
    from explorer.widgets.grid_view import GridView
    view = shown(GridView(), 500, 400)
    view.set_snapshot(snap)
    view.render()
    view.box.setRange(QtCore.QRectF(0, 0, cells, cells), padding=0)
    view.render()
    return view


def test_cell_labels_are_not_drawn_again_when_only_the_colours_under_them_change(qtbot, shown, monkeypatch):
    """Each cell label (block id, ×N) was drawn anew on every repaint of the grid: 128 labels at 10 redraws a second
    were a tenth of the GUI thread in the serve demo. A new frame that changes colours but no label must take the
    labels from Qt's cache."""
    import pyqtgraph as pg
    snap = make_snapshot(num_blocks=64, block_size=16, used=[(0, 1, 16, 1), (33, 2, 16, 2)], tables={2: (33,)})
    view = _zoomed_grid(qtbot, shown, snap, 4)
    labels = [label for label in view._labels if label.isVisible()]
    assert labels
    drawn = []
    for label in labels:
        monkeypatch.setattr(label, "paint", lambda *a, label=label: drawn.append(label) or type(label).paint(label, *a))
    view.view.viewport().update()
    qtbot.waitUntil(lambda: set(drawn) == set(labels), timeout=2000)  # each drawn once (into its cache)
    qtbot.wait(100)
    drawn.clear()
    images = []
    image_item = view.item
    monkeypatch.setattr(image_item, "paint", lambda *a: images.append(1) or pg.ImageItem.paint(image_item, *a))
    view.set_snapshot(make_snapshot(num_blocks=64, block_size=16, used=[(0, 1, 9, 1), (33, 2, 16, 2)],
                                    cached=[(5, 1)], tables={2: (33,)}, step_id=11))  # colours change, ids do not
    view.render()
    qtbot.waitUntil(lambda: bool(images), timeout=2000)
    qtbot.wait(50)
    assert drawn == []


def test_cached_cell_labels_keep_their_dark_box(qtbot, shown):
    """Found on screen at 1920 x 1080: with the labels cached, pyqtgraph's first paint of a TextItem moved the
    painter, so the box landed outside the cache and white ids stood bare on bright cells. The pixels just inside a
    label's box must be darker than the same cell away from the label."""
    from PySide6 import QtCore
    snap = make_snapshot(num_blocks=16, block_size=16, used=[(b, 1, 16, 1) for b in range(16)],
                         tables={1: tuple(range(16))})
    view = _zoomed_grid(qtbot, shown, snap, 3)
    qtbot.waitUntil(lambda: "5" in view.label_texts(), timeout=2000)
    qtbot.wait(100)
    image = view.view.viewport().grab().toImage()
    geo = view.geometry_
    x, y = geo.cell_origin(5)

    def pixel(dx, dy):
        point = view.view.mapFromScene(view.box.mapViewToScene(QtCore.QPointF(x + dx, y + dy)))
        colour = image.pixelColor(point)
        return colour.red() + colour.green() + colour.blue()
    inside_box, away = pixel(0.07, 0.07), pixel(0.8, 0.8)  # the box's corner (its margin: no glyph there)
    assert inside_box < away - 60, (inside_box, away)

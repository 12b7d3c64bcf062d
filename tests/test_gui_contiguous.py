"""The contiguous view draws the allocator's memory at the paged grid's scale, in distinct colours per role."""
import numpy as np

from explorer.model import palette
from explorer.widgets.contiguous_view import GAP, ContiguousView, contiguous_rgba, describe_slot
from explorer.render.grid import grid_geometry
from kvstream.views import Status
from test_contiguous import conv, snap


def pixel(image, geo, slot, bs):
    """RGB in the middle of a slot's stripe."""
    cell, within = divmod(slot, bs)
    x, y = geo.cell_origin(cell)
    t = geo.tile
    columns = [px for px in range(1, t) if int((px - 1) * bs / (t - 1)) == within]
    px = columns[len(columns) // 2]
    return tuple(int(c) for c in image[y * t + t // 2, x * t + px, :3])


def test_roles_have_distinct_colours_on_the_grid_layout(qtbot, shown):
    view = shown(ContiguousView(), 600, 500)
    # 32 slots: A (0) at 0..16 with 6 filled, B (1) at 16..24 with 4 filled; B ends, then C (2) wants 20 and waits
    view.set_snapshot(snap(1, [conv(0, 6, 10, 6), conv(1, 4, 4, 4, arrival=1)]))
    assert view.render() and not view.render()
    view.set_snapshot(snap(2, [conv(0, 6, 10, 6), conv(1, 4, 4, 4, Status.ENDED, 1), conv(3, 2, 2, 2, arrival=2),
                               conv(2, 10, 10, 0, Status.WAITING, 3)]))
    assert view.render()
    geo = grid_geometry(8, 4)
    assert view.geometry_ == geo and geo.striped  # the paged grid's layout for 8 blocks of 4
    image = view.image
    a = tuple(int(c) for c in palette.conversation_colours(np.array([0]), view.colours)[0][:3])
    a_dark = tuple(int(c) for c in palette.scale(palette.conversation_colours(np.array([0]), view.colours)[0],
                                                 palette.EMPTY_SLOT_LEVEL)[:3])
    assert pixel(image, geo, 1, 4) == a and pixel(image, geo, 5, 4) == a  # filled
    assert pixel(image, geo, 6, 4) == a_dark and pixel(image, geo, 15, 4) == a_dark  # reserved, empty
    # D (3, 4 slots) came first and took 16..20; C (20 slots) waits, since only 20..32 is left: free, not a gap
    d = tuple(int(c) for c in palette.conversation_colours(np.array([3]), view.colours)[0][:3])
    assert pixel(image, geo, 17, 4) == d
    assert pixel(image, geo, 22, 4) == tuple(palette.FREE[:3])
    roles = {pixel(image, geo, s, 4) for s in (1, 6, 22)}
    assert len(roles) == 3
    assert view.summary_text() == ("paged: 2 running, 1 waiting; contiguous: 2 running, 1 waiting, "
                                   "38% of its memory reserved but empty")  # (10 + 2) of 32
    assert "reserved but empty" in describe_slot(view.layout_, 6) and describe_slot(view.layout_, 30).endswith("free")


def test_gap_between_reservations_is_drawn_as_a_gap():
    from explorer.model.contiguous import ContiguousAllocator
    model = ContiguousAllocator()
    model.update(snap(1, [conv(0, 4, 4, 4), conv(1, 4, 4, 4, arrival=1), conv(2, 4, 4, 4, arrival=2)]))
    layout = model.update(snap(2, [conv(0, 4, 4, 4), conv(1, 4, 4, 4, Status.FINISHED, 1),
                                   conv(2, 4, 4, 4, arrival=2)]))
    geo = grid_geometry(8, 4)
    image = contiguous_rgba(layout, geo)
    x, y = geo.cell_origin(2)  # slots 8..12: freed between 0..8 and 16..24, hatched
    t = geo.tile
    region = image[y * t + 1:(y + 1) * t, x * t + 1:(x + 1) * t, :3].reshape(-1, 3)
    seen = {tuple(int(c) for c in p) for p in region}
    allowed = {tuple(int(c) for c in col[:3]) for col in (GAP, palette.FREE, palette.scale(GAP, 0.85),
                                                           palette.scale(palette.FREE, 0.85))}  # slot separators
    assert tuple(GAP[:3]) in seen and tuple(palette.FREE[:3]) in seen and seen <= allowed
    assert "gap of 8 free slots" in describe_slot(layout, 9)


def test_large_pool_draws_mean_colours_quickly():
    from explorer.model.contiguous import ContiguousAllocator
    model = ContiguousAllocator()
    convs = [conv(i, 300, 700, 500, arrival=i) for i in range(200)]
    layout = model.update(snap(1, convs, num_blocks=65536, block_size=16))
    geo = grid_geometry(65536, 16)
    assert not geo.striped
    image = contiguous_rgba(layout, geo)
    assert image.shape == (geo.rows * geo.tile, geo.cols * geo.tile, 4)
    assert layout.num_running == 200 and layout.num_reserved_slots == 200_000


def test_linked_view_draws_at_the_grids_scale_whatever_its_width(qtbot):
    from PySide6 import QtCore, QtWidgets
    from explorer.widgets.grid_view import GridView
    from test_gui_grid import make_snapshot
    holder = QtWidgets.QWidget()
    qtbot.addWidget(holder)
    row = QtWidgets.QHBoxLayout(holder)
    grid, view = GridView(), ContiguousView()
    row.addWidget(grid, 1)
    row.addWidget(view, 2)  # twice as wide: pyqtgraph's own x link would draw it at twice the scale
    holder.resize(1200, 500)
    holder.show()
    qtbot.waitExposed(holder)
    pool = make_snapshot(num_blocks=1024, block_size=16)
    grid.set_snapshot(pool)
    grid.render()
    view.link_to(grid.box)
    view.set_snapshot(snap(1, [conv(0, 30, 90, 30)], num_blocks=1024, block_size=16))
    view.render()
    qtbot.wait(50)

    def scale(box):
        return box.viewRect().width() / box.width()

    def corner(box):
        return round(box.viewRect().left(), 6), round(box.viewRect().top(), 6)

    assert abs(scale(view.box) - scale(grid.box)) < 1e-6 and corner(view.box) == corner(grid.box)
    grid.box.setRange(QtCore.QRectF(4, 2, 8, 8), padding=0)  # zoom the grid: the contiguous view follows
    assert abs(scale(view.box) - scale(grid.box)) < 1e-6 and corner(view.box) == corner(grid.box)
    view.box.setRange(QtCore.QRectF(10, 6, 4, 4), padding=0)  # the user zooms the contiguous view ...
    view.box.sigRangeChangedManually.emit([True, True])  # ... with the mouse: the grid follows
    assert abs(scale(view.box) - scale(grid.box)) < 1e-6 and corner(view.box) == corner(grid.box)


def test_side_by_side_shows_every_row_of_both_at_the_default_dock_height(qtbot):
    """Issue 33: in the window, View > Contiguous side by side drew its memory at the grid's scale in a shorter box
    (title, summary and legend above and below it): the bottom row was cut off. Both now zoom out to show all."""
    from PySide6 import QtWidgets
    from test_gui_support import make_config
    from engine import Engine, EngineRunner
    from explorer.window.main_window import MainWindow
    for size in ((1600, 1000), (1024, 640)):
        cfg = make_config(64, 4)
        engine = Engine(cfg)
        engine.add_conversation("Contiguous side by side.", max_new_tokens=60)
        window = MainWindow(EngineRunner(engine, start_paused=True).start(), cfg, size=size)
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        qtbot.waitUntil(lambda: window.snapshot is not None, timeout=3000)
        window.set_contiguous(True)
        pane = window.pane
        qtbot.waitUntil(lambda: pane.contiguous.geometry_ is not None, timeout=3000)
        for _ in range(5):  # the frame timer renders and fits
            qtbot.wait(60)
            QtWidgets.QApplication.processEvents()
        for box, geo in ((pane.contiguous.box, pane.contiguous.geometry_), (pane.grid.box, pane.grid.geometry_)):
            rect = box.viewRect()
            assert rect.top() <= 0 and rect.bottom() >= geo.rows, (size, rect, geo.rows)
            assert rect.left() <= 0 and rect.right() >= geo.cols, (size, rect, geo.cols)
        grid_scale = pane.grid.box.viewRect().width() / pane.grid.box.width()
        assert abs(pane.contiguous.box.viewRect().width() / pane.contiguous.box.width() - grid_scale) < 1e-6
        window.close()

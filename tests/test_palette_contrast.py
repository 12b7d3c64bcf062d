"""Issue 33: owner colouring's marks must be told apart at a glance. Cached blocks looked brighter than used ones
(a grey mix of a deep blue is lighter than the blue), the legend's "dimmed" swatch was nearly its "cached" one, and
two live conversations read as the same blue. Distances are CIELAB (D65) Euclidean: about 2.3 is just noticeable,
over 20 is a different colour at a glance."""
import random
from types import SimpleNamespace

import numpy as np
import pytest

from explorer.model import palette

LIVE = len(palette.LIVE_COLOURS)


def distance(a, b):
    return np.linalg.norm(palette.cielab(a) - palette.cielab(b), axis=-1)


def used_colours(count):
    return palette.conversation_colours(np.arange(count), palette.ColourBook())  # a fresh book: entry i for id i


def test_the_cielab_helper_agrees_with_known_values():
    assert np.allclose(palette.cielab(np.array([255, 255, 255])), [100, 0, 0], atol=0.05)
    assert np.allclose(palette.cielab(np.array([255, 0, 0])), [53.24, 80.09, 67.20], atol=0.05)
    assert np.allclose(palette.lightness(np.array([[0, 0, 255], [128, 128, 128]])), [32.30, 53.59], atol=0.05)


def test_cached_blocks_are_darker_than_used_and_apart_from_dimmed_and_free():
    used = used_colours(LIVE)
    cached = palette.cached(used)
    dimmed = palette.scale(used, palette.DIM_LEVEL)
    assert (palette.lightness(used) - palette.lightness(cached) >= 10).all()  # never brighter than used
    assert distance(used, cached).min() >= 25
    assert distance(cached, dimmed).min() >= 20
    assert distance(cached, palette.FREE).min() >= 18
    assert distance(dimmed, palette.FREE).min() >= 10
    more = used_colours(256)  # past sixteen, the hue walk: still never brighter when cached
    assert (palette.lightness(more) - palette.lightness(palette.cached(more)) >= 5).all()


def test_the_grid_draws_cached_blocks_with_that_colour():
    from explorer.render.grid import block_colours
    from test_gui_grid import make_snapshot
    snap = make_snapshot(used=[(0, 1, 4, 1)], cached=[(3, 1)], tables={1: (0,)})
    fill, _ = block_colours(snap, "owner")
    assert tuple(fill[3]) == tuple(palette.cached(fill[0]))
    assert palette.lightness(fill[3]) < palette.lightness(fill[0]) - 10


def test_the_sixteen_live_colours_are_far_apart_and_none_is_dark():
    colours = palette.LIVE_COLOURS
    d = distance(colours[:, None], colours[None])
    np.fill_diagonal(d, np.inf)
    assert d.min() >= 30
    assert palette.lightness(colours).min() >= 47.5  # room for a darker cached form above a free block


def test_legend_swatches_for_cached_and_dimmed_differ(qapp):
    from explorer.widgets.legend import legend_entries
    rows = {text.split(":")[0]: pixmap for pixmap, text in legend_entries("owner")}

    def centre(pixmap):
        colour = pixmap.toImage().pixelColor(pixmap.width() // 2, pixmap.height() // 2)
        return np.array([colour.red(), colour.green(), colour.blue()])
    cached, dimmed, used = centre(rows["cached"]), centre(rows["dimmed"]), centre(rows["used"])
    assert distance(cached, dimmed) >= 20 and distance(cached, used) >= 25
    assert palette.lightness(cached) < palette.lightness(used)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_conversations_live_at_once_get_distinct_colours_up_to_the_palette_size(seed):
    """Arrivals and endings at random, as in a crowd: whenever at most sixteen are live, no two share a colour,
    and any two of them are at least the palette's spacing apart."""
    rng = random.Random(seed)
    book, live, ended, next_id = palette.ColourBook(), [], [], 0
    for step in range(600):
        if len(live) < LIVE and rng.random() < 0.5:
            live.append(next_id)
            next_id += 1
        if live and rng.random() < 0.3:
            ended.append(live.pop(rng.randrange(len(live))))
        convs = [SimpleNamespace(conversation_id=c, arrival_step=c, is_live=True) for c in live]
        convs += [SimpleNamespace(conversation_id=c, arrival_step=c, is_live=False) for c in ended]
        book.observe(SimpleNamespace(conversations=convs, version=step))
        colours = palette.conversation_colours(np.array(live, np.int64), book)
        if len(live) > 1:
            d = distance(colours[:, None], colours[None])
            np.fill_diagonal(d, np.inf)
            assert d.min() >= 30, (step, live)


def test_past_sixteen_the_next_32_colours_stay_apart():
    """A crowd of 21 live conversations: the 17th colour came from a hue walk at CIELAB distance 7 from the 16th
    (two conversations read as one). The first 48 entries are at least 20 apart, and from the marks."""
    colours = used_colours(48)
    d = distance(colours[:, None], colours[None])
    np.fill_diagonal(d, np.inf)
    assert d.min() >= 20
    marks = np.array([palette.FREE, palette.UNOWNED, palette.SHARED_RING, palette.SELECTED_RING, palette.BACKGROUND])
    assert distance(colours[:, None], marks[None]).min() >= 20
    assert (palette.lightness(colours) - palette.lightness(palette.cached(colours)) >= 10).all()


def test_a_crowd_of_up_to_48_live_conversations_gets_distinct_colours():
    book = palette.ColourBook()
    convs = [SimpleNamespace(conversation_id=c, arrival_step=c, is_live=True) for c in range(48)]
    book.observe(SimpleNamespace(conversations=convs, version=1))
    colours = palette.conversation_colours(np.arange(48), book)
    d = distance(colours[:, None], colours[None])
    np.fill_diagonal(d, np.inf)
    assert d.min() >= 20

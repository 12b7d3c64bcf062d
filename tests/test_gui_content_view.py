"""The content view of KV-event sources, offscreen: the prefix tree, the placement notice, stream status, the
cross-instance view and the router box; once with indexes fed directly, once following a real stream."""
from __future__ import annotations

import shutil
import tempfile

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from explorer.widgets.content_view import PLACEMENT_UNKNOWN, ContentView, load_tokenizer
from kvstream.kv_events import (BlockRemoved, BlockStored, KVCacheIndex, KVEventEndpoint, KVEventPublisher,
                                KVEventSubscriber, make_batch)

WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far"]


@pytest.fixture
def tokenizer(tmp_path):
    """A real word-level tokenizer, written to tokenizer.json and read back as --tokenizer DIR would."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    return load_tokenizer(tmp_path)


def ids(text):
    return tuple(WORDS.index(w) for w in text.split())


def stored(hashes, tokens, parent=None):
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens), block_size=2,
                       lora_id=None, medium="GPU", lora_name=None)


def two_instances():
    a, b = KVCacheIndex("node-a"), KVCacheIndex("node-b")
    a.apply_batch(make_batch([stored([2**64 - 1, 2], ids("the cat sat on"))], 1.0), 0)  # uint64 hashes: all bits
    a.apply_batch(make_batch([stored([3], ids("a dog"), parent=2**64 - 1)], 2.0), 1)
    b.apply_batch(make_batch([stored([11, 12], ids("the cat ran far"))], 1.0), 0)
    b.apply_batch(make_batch([BlockRemoved(block_hashes=(12,), medium="GPU")], 3.0), 1)
    return a, b


def texts(model, parent=None):
    """(text, children) of every row of a QStandardItemModel tree."""
    from PySide6 import QtCore
    parent = parent or QtCore.QModelIndex()
    out = []
    for r in range(model.rowCount(parent)):
        idx = model.index(r, 0, parent)
        out.append((model.data(idx), texts(model, idx)))
    return out


def test_tree_placement_text_and_expand(qtbot, shown, tokenizer):
    a, b = two_instances()
    view = shown(ContentView([a, b], tokenizer=tokenizer), 900, 700)
    assert view.placement_label.text() == PLACEMENT_UNKNOWN and "no block grid" in PLACEMENT_UNKNOWN
    assert [view.tabs.tabText(i) for i in range(view.tabs.count())] == ["node-a", "node-b", "Across instances"]
    pane = view.panes[0]
    assert texts(pane.model) == [("the cat", [("sat on", []), ("a dog", [])])]  # tokens as text, parent chains
    root = pane.model.index(0, 0)
    assert not pane.tree.isExpanded(root)
    pane.tree.expand(root)
    assert pane.model.data(pane.model.index(0, 2)) == "GPU"
    assert pane.model.data(pane.model.index(0, 1)) == str(2**64 - 1)[:16]  # the tooltip has all of it
    assert "3 live blocks" in pane.counts_label.text() and "block size 2" in pane.counts_label.text()
    # a new batch: the tree is rebuilt, the row the user expanded stays expanded
    a.apply_batch(make_batch([stored([4], ids("the mat"))], 4.0), 2)
    assert view.refresh() and not view.refresh()  # nothing changed the second time
    assert [t for t, _ in texts(pane.model)] == ["the cat", "the mat"]
    assert pane.tree.isExpanded(pane.model.index(0, 0))
    x, y = pane.curves["live"].getData()
    assert list(y) == [2, 3, 4] and list(x) == [0.0, 1.0, 3.0]
    # across instances: "the cat" is on both, the rest on one each
    across = view.across
    rows = texts(across.model)
    assert rows[0][0] == "the cat" and across.model.data(across.model.index(0, 1)) == "2 of 2"
    assert sorted(t for t, _ in rows[0][1]) == ["a dog", "sat on"]
    across.prompt.setText("the cat sat on the")
    assert "node-a: 2 blocks; node-b: 1 block" in across.route_label.text()
    assert "router sends it to node-a" in across.route_label.text()
    across.prompt.setText("dog dog")
    assert "no instance holds its first block" in across.route_label.text()
    view.grab()  # renders


def test_without_tokenizer_shows_ids_and_orphans(qtbot):
    index = KVCacheIndex("solo")
    index.apply_batch(make_batch([stored([5], (7, 8), parent=999)], 1.0), 0)  # its parent was never seen
    view = ContentView([index])
    qtbot.addWidget(view)
    (row,) = texts(view.panes[0].model)
    assert row == ("(parent not cached) 7 8", [])
    view.across.prompt.setText("not numbers")
    assert "Not token ids" in view.across.route_label.text()
    assert "not followed" in view.panes[0].status_label.text()
    with pytest.raises(ValueError):
        ContentView([])


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizer file"):
        load_tokenizer(tmp_path)


def test_follows_a_live_stream_and_shows_its_status(qtbot, tokenizer):
    sockdir = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    try:
        with KVEventPublisher(f"ipc://{sockdir}/p", f"ipc://{sockdir}/r", buffer_size=2) as pub:
            for h in (1, 2, 3):  # only the last 2 stay in the replay buffer: the first is lost
                pub.publish([stored([h], ids("the cat"))] if h == 1 else [stored([h], ids("a dog"), parent=h - 1)])
            ep = KVEventEndpoint(pub.endpoint, pub.replay_endpoint, name="vllm-0")
            with KVEventSubscriber([ep, f"ipc://{sockdir}/nobody"], silent_after_s=60) as sub:
                view = ContentView(sub.indexes, tokenizer=tokenizer)
                qtbot.addWidget(view)
                view.attach(sub, interval_ms=20)
                pane, nobody = view.panes
                qtbot.waitUntil(lambda: "lost 1 batch" in pane.status_label.text(), timeout=5000)
                assert "older than the replay buffer" in pane.status_label.text()
                assert nobody.status_label.text() == "Stream: connecting"
                assert texts(pane.model) == [("(parent not cached) a dog", [("a dog", [])])]
                pub.publish([stored([9], ids("sat on"))])
                qtbot.waitUntil(lambda: len(texts(pane.model)) == 2, timeout=5000)
                assert "seq 3" in pane.status_label.text() and pane.status_label.text().startswith("Stream: live")
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_cached_blocks_prefix_is_copied_and_routed_from_the_tree(qtbot, tokenizer):
    """Issue 33: the router box took typed token ids only. A row's menu copies the prefix it stands for (its
    ancestors' tokens, then its own) and routes it across instances."""
    from PySide6 import QtCore, QtWidgets
    from explorer.widgets.content_view import copy_token_ids, prefix_token_ids
    a, b = two_instances()
    view = ContentView([a, b], tokenizer=tokenizer)
    qtbot.addWidget(view)
    pane = view.panes[0]
    assert pane.tree.contextMenuPolicy() == QtCore.Qt.ContextMenuPolicy.CustomContextMenu
    root = pane.model.index(0, 0)
    child = next(pane.model.index(r, 0, root) for r in range(pane.model.rowCount(root))
                 if pane.model.data(pane.model.index(r, 0, root)) == "sat on")
    assert prefix_token_ids(child) == list(ids("the cat sat on"))
    assert prefix_token_ids(child.siblingAtColumn(2)) == list(ids("the cat sat on"))  # any cell of the row
    assert copy_token_ids(prefix_token_ids(child)) == "1 2 3 4" == QtWidgets.QApplication.clipboard().text()
    view.route_prefix(prefix_token_ids(child))
    assert view.tabs.currentWidget() is view.across and view.across.prompt.text() == "1 2 3 4"
    assert "node-a: 2 blocks; node-b: 1 block" in view.across.route_label.text()
    across = view.across  # the merged tree's rows carry their tokens too
    first = across.model.index(0, 0)
    assert prefix_token_ids(first) == list(ids("the cat"))


def test_the_route_box_takes_text_with_the_builtin_tokenizer(qtbot):
    """--tokenizer builtin (the project's byte tokenizer): text typed in the box is routed."""
    index = KVCacheIndex("solo")
    index.apply_batch(make_batch([stored([5], tuple(b"ab")), stored([6], tuple(b"cd"), parent=5)], 1.0), 0)
    view = ContentView([index], tokenizer=load_tokenizer("builtin"))
    qtbot.addWidget(view)
    assert [t for t, _ in texts(view.panes[0].model)] == ["ab"]
    view.across.prompt.setText("abcx")
    assert "solo: 1 block" in view.across.route_label.text(), view.across.route_label.text()
    view.across.prompt.setText("abcd")
    assert "solo: 2 blocks" in view.across.route_label.text()

"""The fp8 KV cache in the window: the status bar names the pool's dtype and a block's bytes, the inspector shows a
block's stored fp8 bytes beside the values attention reads, the restart dialog says what a pool of that size takes
and how many blocks the same memory holds in each dtype, and the pool stream carries the dtype."""
import dataclasses

import numpy as np
import pytest
import torch

from explorer.window.dialogs import pool_memory_text
from kvstream.poolstream import StreamDecoder, StreamEncoder
from kvstream.poolstream.schema import StreamError
from test_gui_support import wait_for_snapshot


def test_status_bar_and_memory_readout_name_the_pool_dtype_and_a_blocks_bytes(qtbot, make_window):
    window = make_window(paused=True, kv_cache_dtype="fp8_e5m2")
    snap = window.snapshot
    assert snap.kv_cache_dtype == "fp8_e5m2"
    per_block = snap.memory.bytes_per_block
    qtbot.waitUntil(lambda: "KV fp8_e5m2" in window.status.labels["model"].text(), timeout=3000)
    assert f"{per_block / 1024:.0f} KiB a block" in window.status.labels["model"].toolTip()
    qtbot.waitUntil(lambda: "stored as fp8_e5m2" in window.relocation.memory_text().get(
        "A block (K and V, every layer)", ""), timeout=3000)  # the memory readout says it too
    plain = make_window(paused=True)
    assert plain.snapshot.memory.bytes_per_block == 4 * per_block  # float32: four bytes a value
    qtbot.waitUntil(lambda: "KV float32" in plain.status.labels["model"].text(), timeout=3000)


def test_inspector_shows_the_stored_bytes_beside_the_values_read(qtbot, make_window):
    """An fp8 block: the left heatmap is the stored codes' values, the right those values times the layer's scale
    (here 1, so the same numbers); the readout names a cell's byte, its value and what attention reads. A float32
    pool has no stored codes to show."""
    window = make_window(paused=True, kv_cache_dtype="fp8")
    window.runner.submit("add_conversation", prompt_token_ids=[5, 6, 7, 8, 9, 10], max_new_tokens=4).result(10)
    window.runner.step_once().result(10)
    snap = wait_for_snapshot(qtbot, window, lambda s: bool(s.block_tables))
    block = next(iter(snap.block_tables.values()))[0]
    info = window.runner.submit("inspect_block", block).result(timeout=10)
    assert info.kv_cache_dtype == "fp8_e4m3" and info.stored_keys.dtype == np.uint8
    assert info.stored_keys.shape == info.keys.shape and info.kv_scales == ((1.0, 1.0),) * info.keys.shape[0]
    codes = torch.from_numpy(info.stored_keys.copy()).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(codes, info.keys)  # scale 1: the values read are the codes' own
    inspector = window.inspector
    inspector.select(block, snap)
    inspector.show_block(info)
    assert inspector.stored_plot.isVisible() and "fp8_e4m3 bytes stored" in inspector.heat_title.text()
    assert np.array_equal(inspector.stored_heat.image, codes[0, :, 0, :])
    code = int(info.stored_keys[0, 1, 0, 2])
    text = inspector.stored_cell(1, 2)
    assert f"byte 0x{code:02x}" in text and f"read as {float(info.keys[0, 1, 0, 2]):g}" in text
    inspector.kind.setCurrentText("V")
    assert np.array_equal(inspector.stored_heat.image, torch.from_numpy(info.stored_values[0, :, 0, :].copy())
                          .view(torch.float8_e4m3fn).float().numpy())
    plain = make_window(paused=True)
    plain.runner.submit("add_conversation", prompt_token_ids=[5, 6, 7], max_new_tokens=4).result(10)
    plain.runner.step_once().result(10)
    snap = wait_for_snapshot(qtbot, plain, lambda s: bool(s.block_tables))
    block = next(iter(snap.block_tables.values()))[0]
    info = plain.runner.submit("inspect_block", block).result(timeout=10)
    assert info.stored_keys is None and info.kv_cache_dtype == "float32"
    plain.inspector.select(block, snap)
    plain.inspector.show_block(info)
    assert not plain.inspector.stored_plot.isVisible() and plain.inspector.stored_cell(0, 0) == ""


def test_restart_dialog_says_what_the_memory_holds_in_each_dtype(qtbot, make_window):
    window = make_window(paused=True)
    dialog = window.open_restart_dialog()
    values = window.snapshot.memory.bytes_per_token // 4  # float32 pool: K and V values of one slot
    dialog.num_blocks.setText("1024")
    dialog.block_size.setText("16")
    total = 1024 * 16 * values * 4
    assert "1,024 blocks of 16 slots in float32" in dialog.memory.text()
    assert f"holds 1,024 in float32, 2,048 in bfloat16, 4,096 in fp8" in dialog.memory.text()
    dialog.kv_cache_dtype.setCurrentText("fp8")
    assert "in fp8_e4m3" in dialog.memory.text() and "256 in float32, 512 in bfloat16, 1,024 in fp8" in \
        dialog.memory.text()
    assert f"{total / 4 / (1 << 20):.1f} MiB" in dialog.memory.text()
    dialog.num_blocks.setText("many")
    assert dialog.memory.text() == ""
    dialog.num_blocks.setText("32")
    dialog.block_size.setText("4")
    dialog.try_accept()
    qtbot.waitUntil(lambda: window.snapshot is not None and window.snapshot.kv_cache_dtype == "fp8_e4m3",
                    timeout=20000)
    assert window.snapshot.num_blocks == 32
    assert pool_memory_text(None, "16", "8", "auto", "float32") == ""


def test_the_pool_stream_carries_the_dtype_and_refuses_a_name_it_does_not_know(qtbot, make_window):
    window = make_window(paused=True, kv_cache_dtype="fp8")
    snap = window.snapshot
    decoded, _, _ = StreamDecoder().feed(StreamEncoder().encode(snap).payload)
    assert decoded.kv_cache_dtype == "fp8_e4m3"
    bad = dataclasses.replace(snap, kv_cache_dtype="int3")
    with pytest.raises(StreamError, match="kv_cache_dtype"):
        StreamDecoder().feed(StreamEncoder().encode(bad).payload)

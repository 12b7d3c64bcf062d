"""What a restart does to the engine's outputs, in the window (offscreen, real engines, real sockets and files):
KV events on the same endpoint go on from the new engine, --publish goes on, recordings end and say so, and the
controls a read-only source disabled get their own tooltips back."""
import socket

import msgspec
import pytest
import zmq

from engine import Engine, EngineConfig
from explorer.window import files
from explorer.feeds.engine_feed import EngineFeed
from explorer.window.main_window import MainWindow
from kvstream.history import History
from kvstream.poolstream.publisher import PoolStreamPublisher
from kvstream.poolstream.subscriber import PoolStreamSubscriber
from kvstream.recording import Recorder, open_recording
from tests.helpers import joined, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_window(qtbot, cfg, sinks=(), prompt="Outputs of a restart.", tokens=200):
    engine = Engine(cfg)
    engine.add_conversation(prompt, max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    feed = EngineFeed.start(engine, cfg, max_steps_per_second=40, extra_sinks=list(sinks))
    window = MainWindow(feed=feed, config=cfg)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    qtbot.waitUntil(lambda: window.snapshot is not None, timeout=3000)
    return window


def restart(qtbot, window, cfg):
    old = window.runner
    window.restart_engine(cfg)
    qtbot.waitUntil(lambda: window.errors or (window.runner is not None and window.runner is not old),
                    timeout=20000)
    assert window.errors == []
    assert old is None or not old.alive  # None: a recording was on view
    return old


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_restart_with_kv_events_on_the_same_endpoint(qtbot, tmp_path, transport):
    """The new engine binds the endpoint the old one held (tcp failed with "address in use"), and its KV events
    reach a subscriber that was listening to the old one."""
    endpoint = f"tcp://*:{free_port()}" if transport == "tcp" else f"ipc://{tmp_path / 'kv-events'}"
    cfg = EngineConfig(model="builtin", num_blocks=64, block_size=4, kv_events_endpoint=endpoint)
    window = open_window(qtbot, cfg)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint.replace("*", "127.0.0.1"))
    try:
        old = restart(qtbot, window, cfg)
        assert window.errors == [] and old.engine.kv_events_endpoints is None  # released, then stopped
        assert window.runner.engine.kv_events_endpoints[0].endswith(endpoint.rsplit(":", 1)[-1])
        # the subscriber reconnects to the new engine's socket: the empty pool's prefix cache reset (AllBlocksCleared)
        # until one of them comes through (what the old engine sent is dropped on the way)
        joined(sub, lambda: window.runner.submit("reset_prefix_cache"),
               accept=lambda message: b"AllBlocksCleared" in message[-1])
        window.runner.submit("add_conversation", prompt="The new engine stores blocks of its own.",
                             max_new_tokens=4, temperature=0.0)

        def stored():
            while sub.poll(0):
                _topic, _seq, payload = sub.recv_multipart()
                _ts, events, *_ = msgspec.msgpack.decode(payload)
                if any((e.get("type") if isinstance(e, dict) else e[0]) == "BlockStored" for e in events):
                    return True
            return False
        wait_until(stored, what="a BlockStored from the new engine")
    finally:
        sub.close()
        window.close()


def test_restart_keeps_publishing_and_ends_recordings_saying_so(qtbot, tmp_path):
    cfg = EngineConfig(model="builtin", num_blocks=64, block_size=4)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    recorder, publisher = Recorder(tmp_path / "cli.kvrec"), PoolStreamPublisher(endpoint)
    window = open_window(qtbot, cfg, sinks=[recorder, publisher])
    subscriber = PoolStreamSubscriber(endpoint, History())
    try:
        qtbot.waitUntil(lambda: (subscriber.latest() or window.snapshot).num_blocks == 64
                        and subscriber.status.state == "live", timeout=10000)
        assert files.start_recording(window, str(tmp_path / "menu.kvrec"))
        assert window.window_actions.stop_record.isEnabled()
        qtbot.wait(200)
        restart(qtbot, window, EngineConfig(model="builtin", num_blocks=32, block_size=4))
        message = window.statusBar().currentMessage()
        assert f"Still publishing the pool stream on {endpoint}" in message
        assert f"Recording {recorder.path} ended" in message and "menu.kvrec ended" in message
        assert not window.window_actions.stop_record.isEnabled()
        assert recorder.closed and not publisher._closed
        for path in (recorder.path, tmp_path / "menu.kvrec"):
            assert open_recording(path).latest().num_blocks == 64  # each holds the old engine's run, and opens
        window.runner.submit("add_conversation", prompt="Published from the new engine.", max_new_tokens=8)
        qtbot.waitUntil(lambda: subscriber.latest() is not None and subscriber.latest().num_blocks == 32,
                        timeout=10000)  # the subscriber followed the restarted source
        assert subscriber.status.restarts >= 1 and window.errors == []
    finally:
        subscriber.close()
        window.close()
    assert publisher._closed  # closing the window closes what it carried over


def test_controls_get_their_own_tooltips_back_after_a_read_only_source(qtbot, tmp_path):
    """Record, open the recording (read-only: "Unavailable: ..."), restart a local engine: every control is usable
    again with its own tooltip, and "Recording saved" was said once the file was closed."""
    cfg = EngineConfig(model="builtin", num_blocks=64, block_size=4)
    window = open_window(qtbot, cfg)
    try:
        scramble, speed = window.relocation.scramble, window.controls.speed
        tips = {id(w): w.toolTip() for w in window.window_actions.commands + [scramble, speed]}
        path = str(tmp_path / "run.kvrec")
        assert files.start_recording(window, path)
        qtbot.wait(300)
        assert files.stop_recording(window) == path
        assert "Recording saved" not in window.statusBar().currentMessage()  # not before it is closed
        qtbot.waitUntil(lambda: "Recording saved" in window.statusBar().currentMessage(), timeout=3000)
        assert files.open_recording(window, path)
        assert not scramble.isEnabled() and scramble.toolTip().startswith("Unavailable: ")
        assert all(w.toolTip().startswith("Unavailable: ") for w in window.window_actions.commands + [speed])
        restart(qtbot, window, cfg)
        acts = window.window_actions
        for widget in window.window_actions.commands + [scramble, speed]:
            if widget in (acts.fork, acts.reply, acts.end):  # these follow the selected conversation: none now
                assert not widget.isEnabled() and widget.toolTip() == tips[id(widget)], widget
                continue
            assert widget.isEnabled() and widget.toolTip() == tips[id(widget)], widget
        assert window.errors == []
    finally:
        window.close()

"""Issue 48, the command line and starting without a display: one test per flag that was taken wrongly.

Empty values were taken as absent (``--make-keys ''`` opened the window), a screenshot that could not be written
exited 0, ``--attach-kv-events`` wrapped port 99999 around to 34463 and took port 0, the busy demo refused a small
pool, and with no display Qt aborted the process with a core dump and a hint that was not the cause.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from explorer.cli import UsageError, display_problem, parse_args

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None, timeout=300, code=None):
    command = [sys.executable, "-c", code] if code else [sys.executable, str(ROOT / "main.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, QT_QPA_PLATFORM="offscreen") if env is None else env)


def _one_error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


# ---- empty values -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--make-keys", "--record", "--open", "--publish", "--screenshot", "--attach",
                                  "--attach-kv-events", "--kv-events", "--tokenizer", "--model", "--geometry",
                                  "--disk-tier-path"])
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_value_is_a_mistake_not_an_absent_flag(flag, empty):
    with pytest.raises(UsageError, match=f"{flag} needs a value, got an empty one"):
        parse_args([flag, empty])


def test_make_keys_with_an_empty_directory_exits_2_instead_of_opening_the_window():
    done = _run("--make-keys", "", "--quit-after", "1")
    assert done.returncode == 2
    assert "--make-keys needs a value" in _one_error_line(done)


# ---- screenshots --------------------------------------------------------------------------------------------------
def test_a_screenshot_into_a_device_is_refused_at_once():
    with pytest.raises(UsageError, match="--screenshot /dev/full exists and is not a regular file"):
        parse_args(["--screenshot", "/dev/full"])


def test_a_screenshot_that_cannot_be_written_exits_1(tmp_path):
    """Qt's save refusing (a full disk, a file that cannot be made): said on stderr and in the exit status."""
    shot = tmp_path / "shot.png"
    code = ("import sys\nfrom PySide6 import QtGui\nQtGui.QPixmap.save = lambda self, *a, **k: False\n"
            "sys.argv = ['main.py']\nimport main\n"
            f"sys.exit(main.main(['--screenshot', {str(shot)!r}, '--quit-after', '2']))\n")
    done = _run(code=code)
    assert done.returncode == 1, done.stderr
    assert f"error: could not save the screenshot to {shot}" in done.stderr and not shot.exists()


# ---- KV-event endpoints -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    ("tcp://127.0.0.1:99999", "port 99999 is out of range"),
    ("tcp://127.0.0.1:0", "give the port it listens on"),
    ("tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:70000", "port 70000 is out of range"),
    ("tcp://127.0.0.1:65535,dp=2", "past 65535"),
])
def test_attach_kv_events_ports_are_checked_as_everywhere_else(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_args(["--attach-kv-events", spec])


def test_the_kv_event_reader_never_wraps_a_port():
    """A library watcher says so for that endpoint (and follows the others) instead of connecting to 34463."""
    from kvstream.kv_events import KVEventSubscriber
    from tests.helpers import wait_until
    with KVEventSubscriber(["tcp://127.0.0.1:99999", "tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:0"]) as sub:
        wait_until(lambda: all(x.state == "failed" for x in sub.status()), what="both endpoints refused")
        wrapped, zero = sub.status()
    assert "port 99999 is out of range" in wrapped.text and not wrapped.connected
    assert "the replay endpoint 'tcp://127.0.0.1:0' connects to a server" in zero.text


# ---- demos fit any pool -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("demo", ["busy", "crowd", "serve"])
def test_demos_fit_themselves_to_a_tiny_pool(demo):
    from engine import Engine, EngineConfig
    from explorer.feeds.demo import DEMOS
    eng = Engine(EngineConfig(model="builtin", num_blocks=16, block_size=4))
    seeded = DEMOS[demo](eng)
    assert len(seeded) > 0
    if demo == "busy":  # its system prompt alone is more than the pool's 64 slots
        assert any("system prompt left out" in note or "prompt cut" in note for note in seeded.notes), seeded.notes
    eng.run_until_idle(max_steps=400)
    eng.check_invariants()


def test_the_busy_demo_runs_on_16_blocks_of_4_from_the_command_line():
    done = _run("--headless", "--demo", "busy", "--num-blocks", "16", "--block-size", "4", "--model", "builtin")
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr


# ---- no display ---------------------------------------------------------------------------------------------------
def _no_display_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(extra)
    return env


def test_without_a_display_the_window_says_what_to_do_and_exits_2():
    done = _run(env=_no_display_env(), timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])  # not -6: no SIGABRT, no core dump
    line = _one_error_line(done)
    assert "--headless" in line and "QT_QPA_PLATFORM=offscreen" in line and "libxcb" not in line


def test_a_display_nobody_serves_is_said_as_such():
    done = _run("--demo", "busy", env=_no_display_env(DISPLAY=":4711"), timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "cannot reach the X display ':4711'" in _one_error_line(done)


def test_the_display_check_accepts_what_qt_can_draw_on():
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}) is None
    assert display_problem({"QT_QPA_PLATFORM": "minimal"}) is None
    assert "WAYLAND_DISPLAY is not set" in display_problem({"QT_QPA_PLATFORM": "wayland"})
    assert "neither DISPLAY nor WAYLAND_DISPLAY" in display_problem({})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:  # an X server's socket, as Xorg binds it
        server.bind("\0/tmp/.X11-unix/X4712")  # (the abstract name: no file left behind)
        server.listen(1)
        assert display_problem({"DISPLAY": ":4712"}) is None
        assert display_problem({"DISPLAY": ":4712.0", "QT_QPA_PLATFORM": "xcb"}) is None
    assert "cannot reach" in display_problem({"DISPLAY": ":4712"})
    assert "cannot reach" in display_problem({"DISPLAY": "not a display"})

"""main.py end to end: one clear line and exit 2 for bad input; headless runs, JSON lines, record/open, publish/attach
between two processes, screenshots taken once the window is drawn. Subprocesses with a temporary settings home."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstream.summary import fixed_part
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("--num-blocks", "64", "--block-size", "4")


def run_main(*args, timeout=90, home=None):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    if home is not None:  # QSettings and everything else under XDG_CONFIG_HOME: never the user's own
        env["XDG_CONFIG_HOME"] = str(home)
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_missing_checkpoint_is_one_line_and_exit_2(tmp_path):
    for extra in ((), ("--headless",)):
        result = run_main("--model", str(tmp_path / "no-such-checkpoint"), *extra, home=tmp_path)
        assert result.returncode == 2
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in result.stderr
        assert "does not exist" in lines[0]


def test_a_file_given_as_model_is_called_a_file_not_a_missing_directory(tmp_path):
    """Issue 13: a file passed as --model (a checkpoint's model.safetensors, say) was reported as a missing
    directory."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a checkpoint directory")
    for extra in (("--headless",), ()):
        result = run_main("--model", str(weights), *extra, home=tmp_path, timeout=60)
        assert result.returncode == 2, (extra, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), (extra, result.stderr)
        assert "is a file" in result.stderr and str(weights) in result.stderr, (extra, result.stderr)
        assert "does not exist" not in result.stderr and "no such" not in result.stderr.lower()


def test_a_zero_geometry_is_out_of_range_not_misformatted():
    from explorer.cli import parse_geometry
    for text in ("0x0", "1x1", "0x480", "99999x768"):
        with pytest.raises(ValueError, match="out of range"):
            parse_geometry(text)
    for text in ("wide", "x768", "1024x", "-5x7", "1e3x800"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
            parse_geometry(text)
    assert parse_geometry(" 1024 x 640 ") == (1024, 640)


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    for args, words in ((("--block-size", "0", "--headless"), "block_size"),
                        (("--json",), "add --headless"),
                        (("--geometry", "wide"), "WIDTHxHEIGHT"),
                        (("--open", str(tmp_path / "missing.kvrec"), "--headless"), "no such file"),
                        (("--attach", "localhost:5560"), "ZMQ endpoint"),
                        (("--no-such-flag",), "unrecognized arguments")):
        result = run_main(*args, home=tmp_path, timeout=60)
        assert result.returncode == 2, args
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and words in result.stderr, \
            (args, result.stderr)


def test_headless_busy_demo_runs_until_idle_and_shows_generated_text(tmp_path):
    result = run_main("--headless", "--demo", "busy", *SMALL, home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "idle after" in result.stdout and "finished" in result.stdout
    texts = [line for line in result.stdout.splitlines() if line.startswith("  conversation ")]
    assert len(texts) == 5 and all(re.search(r"\b1 token\): '|\d tokens\): '", line) for line in texts)
    assert any(len(re.split(r"tokens?\): ", line, maxsplit=1)[1]) > 6 for line in texts)  # real generated text
    assert "lowered from" in result.stdout  # the demo says what it shrank to fit 64 blocks


def test_headless_with_compiled_attention_runs_until_idle(tmp_path):
    result = run_main("--headless", "--demo", "busy", *SMALL, "--compile-attention", timeout=300, home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "idle after" in result.stdout and "finished" in result.stdout
    assert "eager path" not in result.stderr  # the compiled kernel did not fall back


def test_record_then_open_headless_json_ends_on_the_same_line(tmp_path):
    path = tmp_path / "busy.kvrec"
    recorded = run_main("--headless", "--json", "--demo", "busy", *SMALL, "--record", str(path), home=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    lines = json_lines(recorded.stdout)
    assert len(lines) >= 2 and path.stat().st_size > 0
    last = lines[-1]
    assert set(last) >= {"source", "step", "num_blocks", "block_size", "used", "cached", "free", "block_tables",
                         "stored_hashes"}
    assert last["source"] == "engine" and last["num_blocks"] == 64 and last["step"] > 0
    replay = run_main("--open", str(path), "--headless", "--json", home=tmp_path, timeout=60)
    assert replay.returncode == 0, replay.stderr
    assert fixed_part(json_lines(replay.stdout)[-1]) == fixed_part(last)
    cut = tmp_path / "cut.kvrec"  # a recording cut off mid-frame opens up to its last complete frame
    cut.write_bytes(path.read_bytes()[:-7])
    partial = run_main("--open", str(cut), "--headless", "--json", home=tmp_path, timeout=60)
    assert partial.returncode == 0 and "cut off" in partial.stderr
    assert json_lines(partial.stdout)[-1]["step"] <= last["step"]
    (tmp_path / "foreign.kvrec").write_bytes(b"PK\x03\x04 not a recording")
    foreign = run_main("--open", str(tmp_path / "foreign.kvrec"), "--headless", home=tmp_path, timeout=60)
    assert foreign.returncode == 2 and foreign.stderr.startswith("error: ") and "Traceback" not in foreign.stderr


def test_publish_and_attach_between_two_processes(tmp_path):
    """One process decodes and publishes over ipc; another attaches headless, watches it unfold, and ends on the
    publisher's state. Each step waits for what the other process says (a loaded machine takes seconds to start
    them), never for a time."""
    import signal
    import threading
    endpoint = f"ipc://{tmp_path}/pool"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(tmp_path))

    def start(*args):  # a headless process, and what it prints so far (read by threads: it runs meanwhile)
        proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--headless", "--json", *args], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = [], []
        proc.readers = [threading.Thread(target=lines.extend, args=(stream,), daemon=True)
                        for stream, lines in ((proc.stdout, out), (proc.stderr, err))]
        for reader in proc.readers:
            reader.start()
        return proc, out, err

    def done(lines):
        seen = json_lines("".join(lines))
        return bool(seen) and seen[-1]["step"] and seen[-1]["used"] == 0
    # the attacher first, connecting until the publisher binds: the paced demo (10 steps/s) is over in about 3 s,
    # and a loaded machine can take that long to start a process, so one started after the publisher missed it
    attacher, seen_out, seen_err = start("--attach", endpoint, "--quit-after", "120")
    publisher = None
    try:
        wait_until(lambda: bool(json_lines("".join(seen_out))) or attacher.poll() is not None, 120,
                   what="the attacher to start connecting")
        assert attacher.poll() is None, "".join(seen_err)
        publisher, out, err = start("--demo", "busy", *SMALL, "--publish", endpoint, "--quit-after", "120")
        # the attacher follows the publisher until the demo's work is done (each prints a line about once a second)
        wait_until(lambda: done(seen_out), 120, what="the attacher to see the work done",
                   seen=lambda: ("".join(seen_err), seen_out[-1:]))
        for proc in (attacher, publisher):  # headless stops cleanly on SIGTERM, with its last line
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, ("".join(seen_err), "".join(err))
            for reader in proc.readers:
                reader.join(timeout=60)
    finally:
        for proc in (attacher, publisher):
            if proc is not None and proc.poll() is None:
                proc.kill()
    seen = json_lines("".join(seen_out))
    final = json_lines("".join(out))[-1]
    assert final["used"] == 0 and final["cached"] > 0  # the publisher finished its work before the attacher left
    assert fixed_part(seen[-1]) == fixed_part(final)
    assert seen[-1]["endpoint"] == endpoint
    assert any(line["step"] is not None and line["step"] < final["step"] for line in seen)  # it watched it unfold


def test_the_apps_own_kv_events_watched_headless_from_another_process(tmp_path):
    """Issue 11: the engine publishing --kv-events (ipc:// binds, as in vLLM) is watched by a headless
    --attach-kv-events --json in another process, whose last line has DESIGN.md's keys with null for what a KV-event
    stream cannot know. The flag takes no replay endpoint, so the watcher starts once the publisher says it is
    publishing; a demo that others watch is paced and keeps publishing until --quit-after or SIGTERM."""
    import signal
    endpoint = f"ipc://{tmp_path}/kv"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(tmp_path))
    errors = tmp_path / "publisher.err"
    with open(errors, "w") as err_file:
        publisher = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--headless", "--demo", "busy",
                                      "--kv-events", endpoint, "--quit-after", "40"], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=err_file, text=True)
    try:
        wait_until(lambda: "publishing" in errors.read_text() or publisher.poll() is not None, 60)
        assert publisher.poll() is None, (publisher.returncode, errors.read_text())  # still running for watchers
        assert f"KV events on {endpoint}" in errors.read_text()
        watched = run_main("--attach-kv-events", endpoint, "--headless", "--json", "--quit-after", "6",
                           home=tmp_path, timeout=60)
        assert publisher.poll() is None, errors.read_text()  # the demo (24 s at its pace) outlived the watcher
        publisher.send_signal(signal.SIGTERM)  # headless stops cleanly on SIGTERM, exit 0
        out, _ = publisher.communicate(timeout=60)
    finally:
        publisher.kill()
    assert watched.returncode == 0 and publisher.returncode == 0, (watched.stderr, errors.read_text())
    assert "Traceback" not in watched.stderr + errors.read_text()
    last = json_lines(watched.stdout)[-1]
    assert set(last) >= {"source", "step", "num_blocks", "block_size", "used", "cached", "free", "block_tables",
                         "stored_hashes"}
    assert last["source"] == "kv-events" and last["name"] == endpoint  # the stream it watched
    assert last["num_blocks"] is None and last["block_tables"] is None
    assert last["used"] is None and last["cached"] is None and last["free"] is None
    assert last["block_size"] == 16 and last["stored_hashes"] > 0 and last["step"] is not None
    assert "step " in out  # the publisher's own progress lines: it decoded while watched



def test_a_late_kv_event_watcher_catches_up_through_the_replay_socket(tmp_path):
    """--kv-events ENDPOINT,replay=ADDR (as --attach-kv-events reads it): a watcher started once the engine has
    decoded 10 steps and published their batches still gets every batch from sequence 0, through the replay
    socket (without one it would miss them: its first batch would be a later one)."""
    import re
    import signal
    kv, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(tmp_path))
    out_path = tmp_path / "publisher.out"
    with open(out_path, "w") as out_file:
        publisher = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "--headless", "--demo", "busy",
                                      "--kv-events", f"{kv},replay={replay}", "--quit-after", "40"], cwd=ROOT,
                                     env=env, stdout=out_file, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: publisher.poll() is not None or
                   max(map(int, re.findall(r"^step +(\d+):", out_path.read_text(), re.M)), default=0) >= 10, 60)
        assert publisher.poll() is None, out_path.read_text()
        assert f"KV events on {kv} (replay on {replay})" in out_path.read_text()
        watched = run_main("--attach-kv-events", f"{kv},replay={replay}", "--headless", "--json", "--quit-after",
                           "4", home=tmp_path, timeout=60)
        publisher.send_signal(signal.SIGTERM)
        publisher.wait(timeout=60)
    finally:
        publisher.kill()
    assert watched.returncode == 0 and publisher.returncode == 0, (watched.stderr, out_path.read_text())
    last = json_lines(watched.stdout)[-1]
    assert last["step"] is not None and last["step"] >= 1
    assert last["batches"] == last["step"] + 1  # every batch from sequence 0: nothing the watcher came late for
    assert last["stored_hashes"] > 0 and last["stored_total"] >= last["stored_hashes"]


def test_kv_events_flag_options_are_checked(tmp_path):
    result = run_main("--headless", "--kv-events", "tcp://*:5557,replays=tcp://*:5558", home=tmp_path, timeout=60)
    assert result.returncode == 2 and "unknown option 'replays=tcp://*:5558'" in result.stderr
    result = run_main("--headless", "--kv-events", "tcp://*:5557,replay=nowhere", home=tmp_path, timeout=60)
    assert result.returncode == 2 and "--kv-events replay needs a ZMQ endpoint" in result.stderr

def test_screenshot_is_saved_once_drawn_at_the_given_size(tmp_path):
    from PySide6 import QtGui
    path = tmp_path / "shot.png"
    result = run_main("--demo", "busy", *SMALL, "--geometry", "1024x640", "--screenshot", str(path), home=tmp_path)
    assert result.returncode == 0, result.stderr  # no --quit-after: it saved once drawn, then closed by itself
    image = QtGui.QImage(str(path))
    assert (image.width(), image.height()) == (1024, 640)


def test_screenshot_of_the_lesson_demo_is_the_lesson_window(tmp_path, qtbot):
    """Issue 13: --screenshot with --demo lesson captured the main window. The PNG has the lesson window's size
    (one built here, on the same offscreen platform) and is mostly what only the lesson draws: its pool's cells of
    the other conversations, in the lesson's tenant colour."""
    import numpy as np
    from PySide6 import QtGui

    from explorer.window.lesson import TENANT_COLOUR, LessonWindow
    lesson = LessonWindow()
    qtbot.addWidget(lesson)
    lesson.show()
    qtbot.waitExposed(lesson)
    expected = (lesson.width(), lesson.height())
    assert expected != (1024, 640)  # else the size could not tell the two windows apart
    path = tmp_path / "lesson.png"
    result = run_main("--demo", "lesson", "--geometry", "1024x640", "--screenshot", str(path), home=tmp_path)
    assert result.returncode == 0, result.stderr
    shot = QtGui.QImage(str(path)).convertToFormat(QtGui.QImage.Format.Format_RGBA8888)
    assert not shot.isNull() and (shot.width(), shot.height()) == expected
    pixels = np.frombuffer(shot.constBits(), np.uint8).reshape(shot.height(), shot.bytesPerLine() // 4, 4)
    tenant = (pixels[:, :shot.width(), :3] == np.asarray(TENANT_COLOUR[:3])).all(axis=-1)
    assert tenant.mean() > 0.05, tenant.mean()  # the lesson's pool: blocks 2, 3, 5, 6, 7 held by B and D


def test_a_bad_tokenizer_directory_is_one_clear_error(tmp_path):
    """--tokenizer DIR whose tokenizer.json is not one: a ValueError naming the file (the CLI prints it as one
    line and exits 2), not the tokenizers library's traceback."""
    from explorer.feeds.sources import WatchSpec
    from explorer.feeds.stream_feed import open_feeds
    (tmp_path / "tokenizer.json").write_text("{not json")
    watch = WatchSpec(tokenizer=str(tmp_path), attach_kv_events=("tcp://127.0.0.1:1",))
    with pytest.raises(ValueError, match=r"cannot read tokenizer .*tokenizer\.json: not a tokenizer file"):
        open_feeds(watch)


def test_headless_closes_the_engine_when_an_output_cannot_start(tmp_path, monkeypatch, capsys):
    """A --publish that cannot bind after the engine was built (its KV-event socket bound): exit 2 with the
    reason, and the engine's sockets are closed (the endpoint can be bound again at once)."""
    from engine import EngineConfig
    from explorer import cli, headless
    kv = f"ipc://{tmp_path / 'kv'}"
    taken = f"tcp://127.0.0.1:{_free_port()}"
    import zmq
    blocker = zmq.Context.instance().socket(zmq.PUB)
    blocker.bind(taken)
    closed = []
    import engine as engine_module
    real_close = engine_module.Engine.close
    monkeypatch.setattr(engine_module.Engine, "close", lambda self: (closed.append(self), real_close(self)))
    try:
        opts = cli.parse_args(["--headless", "--num-blocks", "16", "--kv-events", kv, "--publish", taken])
        cfg = EngineConfig(model="builtin", num_blocks=16, block_size=16, kv_events_endpoint=kv)
        assert headless.run_headless_cli(opts, cfg, cli.source_spec(opts)) == 2
    finally:
        blocker.close(0)
    assert "error: cannot publish on" in capsys.readouterr().err
    assert len(closed) == 1 and closed[0].kv_events_endpoints is None


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_negative_quit_after_exits_2():
    """"--quit-after -1" was accepted (exit 0) while every other bad value exits 2."""
    from explorer.cli import parse_or_exit
    for bad in ("-1", "nan", "abc"):
        with pytest.raises(SystemExit) as exit_info:
            parse_or_exit(["--quit-after", bad])
        assert exit_info.value.code == 2
    assert parse_or_exit(["--quit-after", "0"]).quit_after == 0
    assert parse_or_exit(["--demo", "serve", "--headless", "--quit-after", "20"]).demo == "serve"

"""Issue 32, finding 13: who may watch. With CURVE (``ENDPOINT,curve=DIR``) only a watcher holding an authorized
key receives frames; without a key, or with a key the publisher does not know, nothing arrives. A publisher bound
beyond loopback without CURVE says once that anyone who can reach the port can read the prompts."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from kvstream.curve import CurveError, make_keys
from kvstream.poolstream.publisher import PoolStreamPublisher
from kvstream.poolstream.subscriber import PoolStreamSubscriber
from kvstream.poolstream.transport import PublishError
from tests.helpers import holds_for, wait_until
from tests.poolstream_helpers import assert_same_snapshot, encode_all, install_fake_tap, workload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys") / "curve")


def test_make_keys_makes_both_pairs_and_never_overwrites(keys):
    for role in ("server_public", "server_secret", "client_public", "client_secret"):
        assert os.path.isfile(keys[role])
    assert os.listdir(keys["authorized"]) == ["client.key"]
    assert oct(os.stat(keys["client_secret"]).st_mode & 0o777) == "0o600"
    with pytest.raises(CurveError, match="already holds keys"):
        make_keys(keys["directory"])


def test_only_holders_of_an_authorized_key_receive_frames(keys, tmp_path):
    snaps = workload()[:6]
    _, frames = encode_all(snaps)
    stranger = tmp_path / "stranger"  # a key pair the publisher never authorized, with the right server key
    make_keys(stranger)
    (stranger / "server.key").write_bytes(Path(keys["server_public"]).read_bytes())
    with PoolStreamPublisher(f"tcp://127.0.0.1:0,curve={keys['directory']}", heartbeat_seconds=0.2) as pub:
        assert pub.curve == keys["directory"]
        allowed = PoolStreamSubscriber(f"{pub.bound},curve={keys['directory']}")
        plain = PoolStreamSubscriber(pub.bound)
        unknown = PoolStreamSubscriber(pub.bound, curve=str(stranger))
        try:
            wait_until(lambda: allowed.status.connected and pub.subscriptions >= 1)
            for f in frames:
                pub.write(f)
            wait_until(lambda: allowed.status.last_seq == len(frames) - 1)
            assert_same_snapshot(snaps[-1][0], allowed.latest())
            # heartbeats and catch-ups would have reached the others by now
            holds_for(lambda: plain.status.frames == unknown.status.frames == 0, 1.5, what="nothing reaches a stranger")
            for other in (plain, unknown):
                assert other.status.frames == 0 and other.latest() is None, other.status
                assert other.status.silent_seconds is None  # not even a heartbeat got through
        finally:
            for s in (allowed, plain, unknown):
                s.close()


def test_curve_directories_are_checked(tmp_path, keys):
    with pytest.raises(PublishError, match="does not exist"):
        PoolStreamPublisher(f"tcp://127.0.0.1:0,curve={tmp_path / 'none'}")
    with pytest.raises(PublishError, match="only option is curve"):
        PoolStreamPublisher("tcp://127.0.0.1:0,cruve=x")
    half = tmp_path / "half"  # a watcher's copy: no server secret, so it cannot publish with it
    half.mkdir()
    for name in ("server.key", "client.key", "client.key_secret"):
        (half / name).write_bytes((Path(keys["directory"]) / name).read_bytes())
    with pytest.raises(PublishError, match="server.key_secret"):
        PoolStreamPublisher(f"tcp://127.0.0.1:0,curve={half}")
    PoolStreamSubscriber(f"tcp://127.0.0.1:5,curve={half}").close()  # but it can watch


def test_a_publisher_beyond_loopback_without_curve_warns_once(caplog, keys):
    with caplog.at_level(logging.WARNING, logger="kvstream.curve"):
        with PoolStreamPublisher("tcp://127.0.0.1:0"):
            pass
        assert "anyone who can reach" not in caplog.text  # loopback: only this machine
        with PoolStreamPublisher(f"tcp://*:0,curve={keys['directory']}"):
            pass
        assert "anyone who can reach" not in caplog.text  # CURVE: only authorized keys
        for _ in range(2):
            with PoolStreamPublisher("tcp://*:0"):
                pass
    assert caplog.text.count("anyone who can reach this port can read every conversation's tokens") == 1


def test_the_command_line_makes_keys_and_checks_curve_specs(tmp_path):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")

    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                              timeout=60, env=env, cwd=ROOT)

    made = run("--make-keys", str(tmp_path / "k"))
    assert made.returncode == 0 and "curve=" in made.stdout, made.stderr
    assert zmq.auth.load_certificate(str(tmp_path / "k" / "client.key_secret"))[1] is not None
    again = run("--make-keys", str(tmp_path / "k"))
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "already holds keys" in again.stderr
    for args, words in ((("--attach", f"tcp://127.0.0.1:5560,curve={tmp_path / 'missing'}", "--headless"),
                         "does not exist"),
                        (("--publish", "tcp://*:5560,curve", "--headless"), "only option is curve"),
                        (("--publish", "tcp://*:99999", "--headless"), "out of range")):
        result = run(*args)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and words in result.stderr, \
            (args, result.stderr)


def test_the_plugin_takes_curve_from_its_environment(monkeypatch, caplog, keys):
    import types

    from kvstream.vllm import plugin
    install_fake_tap(monkeypatch)
    monkeypatch.setenv(plugin.ENV_ENDPOINT, "tcp://127.0.0.1:0")
    monkeypatch.setenv(plugin.ENV_CURVE, keys["directory"])
    with caplog.at_level("INFO", logger="vllm.paged_kv_explorer"):
        publisher = plugin.attach(types.SimpleNamespace())
    try:
        assert publisher is not None, caplog.text
        assert publisher.sink.publisher.curve == keys["directory"] and "CURVE" in caplog.text
        watcher = PoolStreamSubscriber(publisher.sink.bound, curve=keys["directory"])
        try:
            wait_until(lambda: watcher.status.connected)
            publisher.publish()
            wait_until(lambda: watcher.latest() is not None)
        finally:
            watcher.close()
    finally:
        publisher.close()

"""The vLLM plugin's parts that need no vLLM: the hash digest, endpoints per rank, the frame gate, and that the
plugin is inert (and imports neither vLLM nor torch) unless PAGED_KV_EXPLORER_PUBLISH is set. The plugin against a
real vLLM: tests/vllm_live (run in the vLLM venv)."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from kvstream.vllm.hash import hash64, key_hash64
from kvstream.vllm.plugin import FrameGate, rank_endpoint


def test_hash64_is_vllms_integer_form_of_its_hash():
    digest = hashlib.sha256(b"a block").digest()
    # vLLM's maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (its default):
    assert hash64(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert hash64(digest) == int.from_bytes(digest[-8:], "big")
    assert hash64(123) == 123 and hash64((1 << 70) + 5) == 5  # integer hashes: low 64 bits
    assert key_hash64(digest + (3).to_bytes(4, "big")) == hash64(digest)  # the group id is not part of it
    assert hash64(b"\x01" * 24 + b"\x00" * 8) == 1  # 0 means "no hash" in the views, so it is never produced


def test_rank_endpoints():
    assert rank_endpoint("tcp://*:5561", 0) == "tcp://*:5561"
    assert rank_endpoint("tcp://*:5561", 2) == "tcp://*:5563"
    assert rank_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert rank_endpoint("ipc:///tmp/pool.sock", 1) == "ipc:///tmp/pool.sock_dp1"


def test_frame_gate_caps_rate_and_share_of_time():
    gate = FrameGate(max_hz=20.0, budget=0.02)
    assert gate.due(0.0)
    gate.spent(0.0, 0.0001)  # a cheap frame: the rate cap decides (50 ms)
    assert not gate.due(0.04) and gate.due(0.0502)
    gate.spent(1.0, 1.004)  # a 4 ms frame may come again only after 4 ms / 2% = 200 ms
    assert not gate.due(1.15) and gate.due(1.2041)


@pytest.mark.parametrize("endpoint", ["", "ipc:///tmp/never-bound.sock"])
def test_register_imports_nothing_heavy(endpoint):
    """Without an endpoint register() changes nothing; with one it only installs an import hook, so that the API
    server and the workers never import vLLM's scheduler for it, and the plugin itself never imports torch."""
    code = ("import os, sys\n"
            f"os.environ['PAGED_KV_EXPLORER_PUBLISH'] = {endpoint!r}\n"
            "hooks = len(sys.meta_path)\n"
            "from kvstream.vllm import plugin as vllm_plugin\n"
            "vllm_plugin.register(); vllm_plugin.register()\n"
            "print(len(sys.meta_path) - hooks, any(m.split('.')[0] in ('torch', 'vllm') for m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == (["0", "False"] if not endpoint else ["1", "False"])

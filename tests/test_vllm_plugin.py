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


# ---- the tap's one wrapper (kvstream.vllm.tap.VllmPoolTap._wrap), without vLLM -----------------------------------
class _Pool:
    """Stands in for a vLLM object whose methods the tap wraps (the wrapper only needs the calls)."""

    def __init__(self):
        self.calls = []

    def free_blocks(self, ordered_blocks):
        self.calls.append(ordered_blocks)
        return "freed"

    def allocate_new_blocks(self, request_id, num_tokens, inner=None):
        self.calls.append((request_id, num_tokens))
        if inner is not None:
            return inner()
        raise ValueError("vLLM's own error")


def _bare_tap():
    """A VllmPoolTap with only what its wrapper and advice use (no scheduler, no vLLM)."""
    from kvstream.vllm.tap import VllmPoolTap
    tap = VllmPoolTap.__new__(VllmPoolTap)
    tap._wrapped, tap.failed, tap.errors = [], None, []
    tap._on_error = tap.errors.append
    tap._rid, tap._group, tap._reason, tap._stale = None, 0, "", set()
    return tap


def test_a_failure_before_the_call_still_makes_vllms_call_as_given_and_detaches():
    from kvstream.vllm.tap import VllmPoolTap
    tap, pool = _bare_tap(), _Pool()

    def broken(self, ordered_blocks):
        raise RuntimeError("injected before")
        yield  # an advice (a generator), failing before its yield

    tap._wrap(pool, "free_blocks", broken.__get__(tap, VllmPoolTap))
    blocks = iter([3, 4])
    assert pool.free_blocks(blocks) == "freed" and pool.calls == [blocks]  # the iterator itself, untouched
    assert [str(e) for e in tap.errors] == ["injected before"] and not tap.attached
    assert "free_blocks" not in vars(pool)  # the instance is as it was


def test_a_failure_after_the_call_keeps_its_result_and_vllm_got_the_list_read_once():
    tap, pool = _bare_tap(), _Pool()
    seen = []

    def broken(blocks):
        seen.append(blocks)
        raise RuntimeError("injected after")
    tap._on_freed = broken
    tap._wrap(pool, "free_blocks", tap._free_blocks)
    assert pool.free_blocks(reversed([1, 2, 3])) == "freed"
    assert pool.calls == [[3, 2, 1]] and seen == [[3, 2, 1]]  # vLLM's reversed() read once, the list handed on
    assert len(tap.errors) == 1 and not tap.attached and "free_blocks" not in vars(pool)


def test_vllms_exception_passes_through_and_the_request_context_is_put_back():
    from functools import partial
    tap, pool = _bare_tap(), _Pool()
    tap._wrap(pool, "allocate_new_blocks", partial(tap._for_request, 1, "sliding_window"))
    try:
        pool.allocate_new_blocks("req-1", 16)
    except ValueError as exc:  # while it is alive its traceback keeps the advice alive: the wrapper closed it
        assert str(exc) == "vLLM's own error" and exc.__traceback__ is not None
        assert (tap._rid, tap._group, tap._reason) == (None, 0, "") and tap._stale == {(1, "req-1")}
    else:
        raise AssertionError("vLLM's exception did not pass through")
    assert not tap.errors and tap.attached

    def inner():  # inside the call: the pool call is attributed to the request and its group
        assert (tap._rid, tap._group, tap._reason) == ("req-2", 1, "sliding_window")
        tap._fail(RuntimeError("the tap's bookkeeping failed inside"))
        return "blocks"
    assert pool.allocate_new_blocks("req-2", 1, inner=inner) == "blocks"  # its advice's finally still ran
    assert (tap._rid, tap._group, tap._reason) == (None, 0, "") and not tap.attached and len(tap.errors) == 1

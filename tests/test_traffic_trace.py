"""Trace readers: both formats told apart by content, kv-cache-tester's sub-agents flattened by absolute time, and
every broken file one clear line (and, on the command line, a non-zero exit)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.traffic.tokens import SynthesisError, TokenSynth
from engine.traffic.trace import TraceError, read_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
needs_traces = pytest.mark.skipif(not (TRACES / "mooncake_conversation.jsonl").exists(),
                                  reason=f"the shipped traces are not at {TRACES}")


def mooncake_line(ts=0, inp=1000, out=10, ids=(1, 2)):
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(ids)})


@needs_traces
def test_the_shipped_traces_read_with_their_documented_sizes():
    moon = read_trace(str(TRACES / "mooncake_conversation.jsonl"))
    assert (moon.format, moon.block_size, moon.num_requests, moon.num_blocks) == ("mooncake", 512, 12031, 288500)
    assert moon.nodes[1] == 182790 and moon.duration_s == pytest.approx(3536.999)
    tester = read_trace(str(TRACES / "kvcache_tester_trace_0010.json"))
    assert (tester.format, tester.block_size, tester.num_requests) == ("kv-cache-tester", 64, 172)
    assert (np.diff(tester.arrival_s) >= 0).all()  # flattened by absolute time
    assert set(tester.agents) == {"", "agent_001", "agent_002", "agent_003", "agent_004"}


def test_sub_agent_times_count_from_their_parent_entry(tmp_path):
    doc = {"block_size": 4, "requests": [
        {"t": 0.0, "type": "n", "in": 8, "out": 1, "hash_ids": [1, 2]},
        {"t": 10.0, "type": "subagent", "agent_id": "a", "requests": [
            {"t": 0.0, "type": "n", "in": 4, "out": 1, "hash_ids": [7]},
            {"t": 5.0, "type": "subagent", "agent_id": "b", "requests": [
                {"t": 1.0, "type": "n", "in": 4, "out": 1, "hash_ids": [9]}]},
            {"t": 30.0, "type": "n", "in": 4, "out": 1, "hash_ids": [8]}]},
        {"t": 12.0, "type": "n", "in": 12, "out": 2, "hash_ids": [1, 2, 3]}]}
    path = tmp_path / "session.json"
    path.write_text(json.dumps(doc))
    trace = read_trace(str(path))
    assert trace.arrival_s.tolist() == [0.0, 10.0, 12.0, 16.0, 40.0]
    assert list(trace.agents) == ["", "a", "", "b", "a"]
    assert [trace.request(i).hash_ids for i in range(5)] == [(1, 2), (7,), (1, 2, 3), (9,), (8,)]


def test_formats_are_told_apart_by_content_not_name(tmp_path):
    jsonl = tmp_path / "really_jsonl.json"
    jsonl.write_text(mooncake_line() + "\n" + mooncake_line(5, ids=(1, 3)) + "\n")
    assert read_trace(str(jsonl)).format == "mooncake"
    tester = tmp_path / "really_tester.jsonl"
    tester.write_text(json.dumps({"block_size": 64, "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [5]}]}))
    assert read_trace(str(tester)).format == "kv-cache-tester"


BROKEN = {
    "empty": ("", "is empty"),
    "blank": ("\n\n  \n", "is empty"),
    "cut line": (mooncake_line() + "\n" + mooncake_line()[:-9], "line 2 is not a JSON request (the line is cut short)"),
    "text for ids": (mooncake_line().replace("[1, 2]", '["a", "b"]'), "line 1"),
    "negative input": (mooncake_line(inp=-5), "input length"),
    "negative output": (mooncake_line(out=-1), "output length"),
    "negative id": (mooncake_line(ids=(1, -2)), "out of range"),
    "ids do not cover the prompt": (mooncake_line(inp=5000, ids=(1,)), "1 hash ids for 5000 prompt tokens"),
    "no prompt": (mooncake_line(inp=0, ids=()), "input length 0"),
    "negative time": (mooncake_line(ts=-3), "arrival time"),
    "not an object": ("[1, 2, 3]", "not a trace"),
    "an object without requests": ('{"hello": 1}', "neither Mooncake"),
    "an id past 64 bits": (mooncake_line(ids=(1, 2**70)), "line 1"),
    "tester block size": ('{"block_size": 0, "requests": []}', "block_size"),
    "tester bad entry": ('{"block_size": 4, "requests": [{"t": "soon", "in": 4, "out": 1, "hash_ids": [1]}]}',
                         "t must be a number"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_traces_are_one_clear_line(tmp_path, name):
    text, message = BROKEN[name]
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as err:
        read_trace(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_folder_a_binary_file_and_a_missing_file(tmp_path):
    with pytest.raises(TraceError, match="is a folder"):
        read_trace(str(tmp_path))
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"{\x00\x01\x02" * 100)
    with pytest.raises(TraceError, match="binary file"):
        read_trace(str(binary))
    with pytest.raises(TraceError, match="no such file"):
        read_trace(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("name", ["empty", "cut line", "text for ids", "negative input"])
def test_the_command_line_says_one_line_and_exits_non_zero(tmp_path, name):
    text, message = BROKEN[name]
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "--trace", str(path), "--sweep", "100",
                           "--headless", "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


def test_the_command_line_refuses_a_folder_as_a_trace(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "main.py"), "--trace", str(tmp_path), "--headless"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "is a folder" in done.stderr


@pytest.mark.parametrize("block_size, lo, hi", [(16, 1, 2**31 - 1), (4, 0, 256), (1, 0, 256), (2, 3, 49152),
                                                (64, 0, 256)])
def test_every_id_gets_its_own_tokens(block_size, lo, hi):
    n = min(200_000, (hi - lo) ** block_size)
    synth = TokenSynth(block_size, lo, hi, n)
    tokens = synth.tokens(np.arange(n)).reshape(n, block_size)
    assert len(np.unique(tokens, axis=0)) == n
    assert tokens.min() >= lo and tokens.max() < hi
    assert (synth.tokens(np.arange(n)[::-1]).reshape(n, block_size) == tokens[::-1]).all()  # deterministic
    with pytest.raises(SynthesisError, match="larger block size"):
        TokenSynth(block_size, lo, hi, (hi - lo) ** block_size + 1) if (hi - lo) ** block_size < 10**9 else \
            TokenSynth(1, 0, 2, 3)


def test_the_command_line_offers_every_eviction_policy():
    from engine import EVICTION_POLICIES
    from explorer.cli import POLICY_NAMES
    assert POLICY_NAMES == EVICTION_POLICIES

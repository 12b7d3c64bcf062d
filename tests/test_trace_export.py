"""--export-trace (explorer.feeds.trace_export): a run's own traffic as a Mooncake JSONL trace that engine.read_trace
reads back. Ids name prefixes as chained block hashes do (a reply's prompt starts with its first prompt's ids; a
prompt that differs in its first token shares nothing); a live replay, its recording and the window each export the
replayed trace's requests with the same sharing, lengths and outputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, EngineConfig, read_trace
from explorer.cli import UsageError, parse_args
from explorer.feeds.trace_export import TraceExport

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "resources" / "traces" / "mooncake_excerpt.jsonl"


def run_main(*args, home, timeout=180):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", XDG_CONFIG_HOME=str(home))
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def small_trace(tmp_path, count=30):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(EXCERPT.read_text().splitlines(keepends=True)[:count]))
    return path


def prefixes(trace):
    """Each request's ids relabelled by the prefix they end (first seen first): two traces with the same sharing
    give the same lists whatever numbers their ids are."""
    keys, out = {}, []
    for i in range(trace.num_requests):
        ids = trace.ids[trace.offsets[i]:trace.offsets[i + 1]].tolist()
        out.append([keys.setdefault(tuple(ids[:k + 1]), len(keys)) for k in range(len(ids))])
    return out


def test_ids_name_prefixes_and_a_reply_is_a_request_of_its_own(tmp_path):
    engine = Engine(EngineConfig(model="none", num_blocks=400, block_size=16))
    exporter = TraceExport()
    base = list(range(1, 601))  # one whole 512-token chunk and a partial one
    first = engine.add_conversation(prompt_token_ids=base, max_new_tokens=3, ignore_eos=True)
    engine.add_conversation(prompt_token_ids=base[:520] + [7] * 80, max_new_tokens=2, ignore_eos=True)
    engine.add_conversation(prompt_token_ids=[9] + base[1:], max_new_tokens=1, ignore_eos=True)
    clock = 0.0
    while engine.has_work():
        engine.step()
        clock += 0.25
        exporter.see(engine.snapshot(), clock)
    engine.continue_conversation(first, prompt_token_ids=[5] * 500, max_new_tokens=4)
    while engine.has_work():
        engine.step()
        clock += 0.25
        exporter.see(engine.snapshot(), clock)
    path = tmp_path / "out.jsonl"
    assert exporter.write(str(path)) == 4
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["hash_ids"] for line in lines] == [[0, 1], [0, 2], [3, 4], [0, 5, 6]]
    assert [line["input_length"] for line in lines] == [600, 600, 600, 600 + 3 + 500]
    assert [line["output_length"] for line in lines] == [3, 2, 1, 4]
    assert lines[0]["timestamp"] == 0 and lines[3]["timestamp"] > lines[2]["timestamp"]
    trace = read_trace(str(path))  # the engine's own reader takes it
    assert trace.num_requests == 4 and trace.ids.tolist() == [0, 1, 0, 2, 3, 4, 0, 5, 6]


def test_a_live_replay_and_its_recording_export_the_trace_they_replayed(tmp_path):
    """Round trip: the engine (block size 512, one block an id) replays a trace, timed, outputs decoded; its export
    and its recording's export are the trace again: the same sharing, prompts of whole blocks, the same outputs,
    arrivals in order."""
    source = small_trace(tmp_path)
    live, recorded, recording = tmp_path / "live.jsonl", tmp_path / "recorded.jsonl", tmp_path / "run.kvpool"
    done = run_main("--model", "none", "--block-size", "512", "--num-blocks", "2000", "--trace", str(source),
                    "--replay", "timed", "--trace-speed", "20", "--record", str(recording), "--export-trace",
                    str(live), "--headless", home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"exported 30 requests to {live}" in done.stderr
    done = run_main("--open", str(recording), "--export-trace", str(recorded), "--headless", home=tmp_path)
    assert done.returncode == 0, done.stderr
    original = read_trace(str(source))
    for path in (live, recorded):
        exported = read_trace(str(path))
        assert prefixes(exported) == prefixes(original)
        assert exported.input_length.tolist() == (np.diff(original.offsets) * 512).tolist()
        assert exported.output_length.tolist() == original.output_length.tolist()
        assert exported.arrival_s[0] == 0 and (np.diff(exported.arrival_s) >= 0).all()
    assert read_trace(str(live)).ids.tolist() == read_trace(str(recorded)).ids.tolist()


def test_the_window_replays_a_trace_given_on_the_command_line_and_exports_it(tmp_path):
    """--trace without --headless: the window's engine (the built-in model, 16-token blocks) is fed the trace's
    requests, each prompt its ids' blocks (cut to the model's context); --export-trace writes them when the window
    closes."""
    source = small_trace(tmp_path, 12)
    out = tmp_path / "window.jsonl"
    done = run_main("--trace", str(source), "--num-blocks", "256", "--trace-speed", "50", "--trace-scale", "0.02",
                    "--export-trace", str(out), "--quit-after", "8", home=tmp_path)
    assert done.returncode == 0, done.stderr
    exported, original = read_trace(str(out)), read_trace(str(source))
    assert 1 <= exported.num_requests <= original.num_requests
    blocks = np.minimum(np.diff(original.offsets), 1024 // 16 - 1)[:exported.num_requests]  # the context, less one
    assert exported.input_length.tolist() == (blocks * 16).tolist()
    assert np.diff(exported.offsets).tolist() == (-(-blocks * 16 // 512)).tolist()


@pytest.mark.parametrize("args, words", [
    (["--attach", "tcp://127.0.0.1:5599", "--export-trace", "OUT"], "record it (--record)"),
    (["--trace", "TRACE", "--sweep", "100", "--headless", "--export-trace", "OUT"], "--sweep runs none"),
    (["--open", "TRACE", "--export-trace", "TRACE"], "would overwrite the file --open names"),
    (["--trace", "TRACE", "--export-trace", "TRACE"], "would overwrite the trace --trace reads"),
])
def test_export_trace_is_refused_where_it_has_nothing_to_write(tmp_path, args, words):
    trace = small_trace(tmp_path, 3)
    argv = [str(trace) if a == "TRACE" else str(tmp_path / "out.jsonl") if a == "OUT" else a for a in args]
    with pytest.raises(UsageError, match=None) as refused:
        parse_args(argv)
    assert words in str(refused.value)

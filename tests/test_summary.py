"""The --json object: DESIGN.md's keys from any snapshot, equal for the engine's snapshot and the one rebuilt from
its stream, null where the source cannot know."""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from kvstream.poolstream import StreamDecoder
from kvstream.summary import FIXED_KEYS, fixed_part, json_summary
from tests.poolstream_helpers import encode_all, workload


def test_summary_of_engine_snapshots():
    snaps = workload()
    _, frames = encode_all(snaps)
    dec = StreamDecoder()
    seen_shared = False
    for (snap, _), frame in zip(snaps, frames):
        out = json_summary(snap)
        assert list(out)[:len(FIXED_KEYS)] == list(FIXED_KEYS)
        assert json.loads(json.dumps(out)) == out
        assert out["source"] == "engine" and out["step"] == snap.step_id
        assert out["used"] + out["cached"] + out["free"] == out["num_blocks"] == snap.num_blocks
        assert out["used"] == int(np.sum(snap.state == 1)) and out["cached"] == int(np.sum(snap.state == 2))
        assert out["block_tables"] == {str(c): list(t) for c, t in snap.block_tables.items()}
        if snap.block_hash is not None:
            hashed = {int(h) for h in snap.block_hash if h}
            assert out["stored_hashes"] == len(hashed)
        seen_shared |= out["shared_blocks"] > 0
        assert json_summary(dec.feed(frame.payload)[0]) == out  # what --open prints equals what the run printed
    assert seen_shared and snaps[-1][0].block_hash is not None and json_summary(snaps[-1][0])["stored_hashes"] > 0


def test_summary_says_null_where_the_source_cannot_know():
    snap = workload()[50][0]
    out = json_summary(dataclasses.replace(snap, block_hash=None, memory=None), source="tcp://host:5560")
    assert out["stored_hashes"] is None and out["filled_slots"] is None and out["source"] == "tcp://host:5560"
    empty = json_summary(None, source="tcp://host:5560")
    assert fixed_part(empty) == {**{k: None for k in FIXED_KEYS}, "source": "tcp://host:5560"}
    assert fixed_part(json_summary(snap)) == {k: json_summary(snap)[k] for k in FIXED_KEYS}

"""Recordings: written and flushed per frame, reopened exactly; cut-off files open up to their last complete frame;
foreign, corrupt, empty and newer files get a clear error."""
from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import pytest

from kvstream.poolstream import FORMAT_VERSION, StreamEncoder, StreamError
from kvstream.recording import (MAGIC, Recorder, RecordingError, RecordingHeader, RecordingTruncated, open_recording,
                                read_frames, read_snapshots)
from tests.poolstream_helpers import (assert_same_snapshot, assert_scrubs_forward_through_bridges,
                                      count_keyframe_decodes, encode_all, workload)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The shared workload recorded to a file: (snapshots, frames, path, byte offset where each frame ends)."""
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=24)
    path = tmp_path_factory.mktemp("rec") / "run.kvpool"
    ends = []
    with Recorder(path) as rec:
        for f in frames:
            rec.write(f)
            ends.append(os.path.getsize(path))  # flushed per frame: the file already holds it
    assert rec.frames_written == len(frames) and rec.bytes_written == ends[-1]
    return snaps, frames, path, ends


def test_recording_reopens_every_frame_exactly(recorded):
    snaps, frames, path, ends = recorded
    with open_recording(path) as history:
        info = history.recording
        assert not info.truncated and info.note == "" and info.num_frames == len(frames)
        assert info.header.format_version == FORMAT_VERSION and info.header.pool.num_blocks == snaps[0][0].num_blocks
        assert history.read_only and (history.first_seq, history.last_seq) == (0, len(frames) - 1)
        assert history.events() == [(f.seq, e) for f in frames for e in f.events]
        order = list(range(len(frames)))
        random.Random(0).shuffle(order)
        for seq in order:
            assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")
        with pytest.raises(StreamError, match="read from disk"):
            history.write(frames[0])
    for (seq, snap, events), (want, want_events) in zip(read_snapshots(path), snaps):
        assert events == want_events
        assert_same_snapshot(want, snap, f"read_snapshots {seq}")
    assert [f.payload for f in read_frames(path)] == [f.payload for f in frames]


def test_cut_at_any_byte_opens_up_to_the_last_complete_frame(recorded, tmp_path):
    snaps, frames, path, ends = recorded
    data = path.read_bytes()
    rng = random.Random(7)
    cuts = sorted(set(rng.sample(range(ends[0], len(data)), 40) + ends[:3] + [e + 1 for e in ends[:3]] + [len(data) - 1]))
    cut_file = tmp_path / "cut.kvpool"
    for cut in cuts:
        cut_file.write_bytes(data[:cut])
        complete = sum(1 for e in ends if e <= cut)
        with open_recording(cut_file) as history:
            assert len(history) == complete, cut
            info = history.recording
            assert info.truncated == (cut not in ends), cut
            if info.truncated:
                assert "cut off" in info.note and f"{complete} complete frames" in info.note
            assert_same_snapshot(snaps[complete - 1][0], history.snapshot_at(complete - 1), f"cut {cut}")
        assert len(list(read_frames(cut_file, truncated_ok=True))) == complete
        if cut not in ends:  # issue 32: a script reading a cut-off file cannot miss that it is cut off
            with pytest.raises(RecordingTruncated, match="cut off") as info:
                list(read_snapshots(cut_file))
            assert info.value.frames == complete
    for cut in (1, len(MAGIC), len(MAGIC) + 5, ends[0] - ends[0] // 2, ends[0] - 1):  # before the first frame ends
        cut_file.write_bytes(data[:cut])
        with pytest.raises(RecordingError, match="cut off before|no complete frame"):
            open_recording(cut_file)


def test_a_killed_recorder_leaves_a_file_that_opens(recorded, tmp_path):
    """A real process writes frames with a Recorder and is killed with SIGKILL mid-run."""
    snaps, frames, path, ends = recorded
    out = tmp_path / "killed.kvpool"
    script = (  # killed while it writes the frames after the 100th, or while it waits with the file open
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from kvstream.recording import Recorder, read_frames\n"
        f"frames = list(read_frames({str(path)!r}))\n"
        f"rec = Recorder({str(out)!r})\n"
        "for i, f in enumerate(frames):\n"
        "    rec.write(f)\n"
        "    if i == 100:\n"
        "        print('ready', flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    with open_recording(out) as history:
        assert len(history) > 100
        last = history.last_seq
        assert_same_snapshot(snaps[last][0], history.snapshot_at(last))


def _header_bytes(header: bytes) -> bytes:
    return MAGIC + struct.pack("<II", len(header), zlib.crc32(header)) + header


def test_bad_files_get_a_clear_error(recorded, tmp_path):
    snaps, frames, path, ends = recorded
    data = path.read_bytes()
    bad = tmp_path / "bad.kvpool"
    first = open_recording(path).recording.header
    newer = msgspec.msgpack.encode(msgspec.structs.replace(first, format_version=FORMAT_VERSION + 1))
    flipped = bytearray(data)
    flipped[ends[5] + 20] ^= 0x40  # inside frame 6's payload
    cases = {
        b"": "is empty",
        b"\x89PNG\r\n\x1a\n" + b"\0" * 64: "not a pool-stream recording",
        b"seq,step\n1,2\n": "not a pool-stream recording",
        _header_bytes(newer) + data[len(_header_bytes(msgspec.msgpack.encode(first))):]:
            "newer than this program reads",
        _header_bytes(b"\x93\x01\x02\x03"): "corrupt header",
        bytes(flipped): "frame 6 at byte .* is corrupt",
        data[:ends[2]] + struct.pack("<II", 2 ** 31, 0) + b"x" * 16: "corrupt",
    }
    for content, words in cases.items():
        bad.write_bytes(content)
        with pytest.raises(RecordingError, match=words) as err:
            open_recording(bad)
        assert isinstance(err.value, ValueError) and str(bad) in str(err.value)
    with pytest.raises(RecordingError, match="cannot open"):
        open_recording(tmp_path / "missing.kvpool")
    garbage = data[:ends[0]] + struct.pack("<II", 5, zlib.crc32(b"hello")) + b"hello"
    bad.write_bytes(garbage)
    with pytest.raises(RecordingError, match="frame 1 .* corrupt"):
        open_recording(bad)
    bad.write_bytes(_header_bytes(msgspec.msgpack.encode(first)) + data[ends[0]:ends[3]])  # starts with a delta
    with pytest.raises(RecordingError, match="not a keyframe"):
        open_recording(bad)
    assert isinstance(first, RecordingHeader)


def test_recorder_refuses_what_would_make_a_bad_file(tmp_path):
    snaps = workload()[:30]
    enc, frames = encode_all(snaps, keyframe_interval=10)
    out = tmp_path / "r.kvpool"
    rec = Recorder(out)
    with pytest.raises(RecordingError, match="start with a keyframe"):
        rec.write(frames[1])
    assert out.read_bytes() == b""
    rec.write(frames[0])
    for bad, words in ((frames[2], "does not follow"), (encode_all(snaps)[1][1], "stream changed")):
        with pytest.raises(RecordingError, match=words):
            rec.write(bad)
    size = out.stat().st_size
    with pytest.raises(TypeError):
        rec.write(b"payload")
    assert out.stat().st_size == size
    rec.close()
    with pytest.raises(RecordingError, match="closed"):
        rec.write(frames[1])
    with pytest.raises(RecordingError, match="cannot write"):
        Recorder(tmp_path / "no" / "such" / "dir.kvpool")
    # a recorder that joins a running stream starts from the encoder's keyframe
    joined = tmp_path / "joined.kvpool"
    with Recorder(joined, start=enc.keyframe()) as late:
        for snap, events in workload()[30:40]:
            late.write(enc.encode(snap, events))
    with open_recording(joined) as history:
        assert (history.first_seq, history.last_seq) == (29, 39)
        assert_same_snapshot(workload()[39][0], history.snapshot_at(39))
        assert_same_snapshot(snaps[29][0], history.snapshot_at(29))


def test_recording_bigger_than_a_budget_stays_on_disk(recorded):
    snaps, frames, path, ends = recorded
    with open_recording(path) as history:
        history.budget_bytes = 1000  # a recording read from disk keeps every frame: payloads stay in the file
        assert len(history) == len(frames)
        assert_same_snapshot(snaps[-1][0], history.latest())
    with pytest.raises(RecordingError, match="closed"):
        history.snapshot_at(3)


def test_encoder_keyframe_matches_stream_encoder(recorded):
    snaps, frames, path, ends = recorded
    enc = StreamEncoder(keyframe_interval=24, stream_id=frames[0].stream_id)
    assert [enc.encode(s, e).payload for s, e in snaps[:30]] == [f.payload for f in frames[:30]]  # deterministic


def test_an_open_recording_is_kept_out_of_full_collections_until_closed(recorded):
    """The app's recording feed freezes what the recording holds (full collections skip it while the user scrubs)
    and gives it back to the collector when closed."""
    import gc

    from explorer.feeds.stream_feed import RecordingFeed
    path = recorded[2]
    gc.unfreeze()
    feed = RecordingFeed.open(str(path))
    feed.started()  # the one watched now
    try:
        assert gc.get_freeze_count() > 0
        assert feed.history.snapshot_at(feed.history.last_seq).step_id == feed.latest().step_id
    finally:
        feed.close()
    assert gc.get_freeze_count() == 0
    feed.close()  # idempotent
    assert gc.get_freeze_count() == 0


def test_a_recording_and_its_frames_read_back_keep_their_bridges(tmp_path, monkeypatch):
    """Periodic keyframes carry a bridge; the frames read back from a file (and frame_from_payload) say so, and the
    opened recording's history goes on through them instead of decoding each keyframe."""
    from kvstream import poolstream as ps
    snaps = workload()
    _, frames = encode_all(snaps, keyframe_interval=8)
    path = tmp_path / "bridged.kvpool"
    with Recorder(path) as recorder:
        for f in frames:
            recorder.write(f)
    bridged = [f.seq for f in frames if f.bridged]
    assert bridged and bridged == [f.seq for f in frames if f.keyframe and f.seq > 0]
    assert [f.seq for f in read_frames(path) if f.bridged] == bridged
    assert [f.seq for f in map(ps.frame_from_payload, (f.payload for f in frames)) if f.bridged] == bridged
    history = open_recording(path)
    assert_scrubs_forward_through_bridges(history, snaps, count_keyframe_decodes(monkeypatch))


def test_a_recording_of_tiers_and_groups_reads_back_exactly(tmp_path):
    """Format 2 in a file: every frame of the synthetic two-group, two-tier pool, at random and in order."""
    from kvstream.recording import Recorder, open_recording, read_snapshots
    from tests.poolstream_helpers import assert_same_v2, encode_all, synthetic_v2
    snaps = synthetic_v2(frames=40, seed=9)
    _, frames = encode_all(snaps, keyframe_interval=8)
    path = tmp_path / "v2.kvrec"
    with Recorder(path) as rec:
        for f in frames:
            rec.write(f)
    for (want, _), (_seq, got, _events) in zip(snaps, read_snapshots(path)):
        assert_same_v2(want, got, f"step {want.step_id}")
    history = open_recording(path)
    order = list(range(len(frames)))
    random.Random(2).shuffle(order)
    for seq in order:
        assert_same_v2(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")

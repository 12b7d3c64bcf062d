"""Issue 32: no recording can kill, freeze or fool a reader (findings 2, 4, 6, 7 and 11).

Files are made from real frames of the engine workload, then damaged the way disks and attackers do: a header that
claims a huge pool, an impossible pool recorded with valid checksums, a bit flip in a length field, a FIFO, a full
disk."""
from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import msgspec
import pytest

from kvstream.poolstream import StreamEncoder
from kvstream.recording import (MAGIC, Recorder, RecordingError, RecordingFull, RecordingHeader, RecordingTruncated,
                                check_recording, open_recording, read_frames, read_snapshots)
from kvstream.views import frozen_array
from tests.poolstream_helpers import encode_all, workload
from tests.test_trust_stream import _forge

ROOT = Path(__file__).resolve().parents[1]
_PREFIX = struct.Struct("<II")


def _raw_file(path, header: RecordingHeader, payloads) -> None:
    """A recording written by hand (what a foreign or malicious writer can make): magic, header, frames."""
    raw = msgspec.msgpack.encode(header)
    parts = [MAGIC, _PREFIX.pack(len(raw), zlib.crc32(raw)), raw]
    for p in payloads:
        parts += [_PREFIX.pack(len(p), zlib.crc32(p)), p]
    Path(path).write_bytes(b"".join(parts))


def _main(*args, timeout=120):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def frames():
    return encode_all(workload()[:40], keyframe_interval=8)[1]


# ---- finding 2: a small file claiming a huge pool ---------------------------------------------------------------
def test_a_recording_claiming_a_huge_pool_is_a_recording_error_and_one_line(tmp_path, frames):
    path = tmp_path / "huge.kvpool"
    with open_recording(_write(tmp_path / "ok.kvpool", frames)) as history:
        header = history.recording.header
    huge = _forge(frames[0], header={"num_blocks": 10 ** 11})
    _raw_file(path, msgspec.structs.replace(header, pool=msgspec.structs.replace(header.pool, num_blocks=10 ** 11)),
              [huge])
    assert path.stat().st_size < 30_000
    with open_recording(path) as history:  # indexing reads envelopes only
        with pytest.raises(RecordingError, match="frame 0 cannot be shown.*more than what fits"):
            history.snapshot_at(0)
    with pytest.raises(RecordingError, match="frame 0 .*more than what fits"):
        list(read_snapshots(path))
    result = _main("--open", str(path), "--headless", "--json")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and "blocks" in result.stderr


def _write(path, frames) -> Path:
    with Recorder(path) as rec:
        for f in frames:
            rec.write(f)
    return Path(path)


# ---- finding 4 in files: an impossible pool with valid checksums ----------------------------------------------------
def test_an_impossible_pool_in_a_recording_is_refused_everywhere(tmp_path):
    """Frame 3 of 20 is impossible (a negative ref count); frames after the next keyframe are fine, so a reader
    that decoded only from the last keyframe (headless --open before) would say nothing."""
    snaps = [s for s, _ in workload()[:20]]
    enc = StreamEncoder(keyframe_interval=8)
    out = []
    for i, snap in enumerate(snaps):
        if i == 3:
            ref = snap.ref_count.copy()
            ref[0] = -2
            snap = dataclasses.replace(snap, ref_count=frozen_array(ref))
        out.append(enc.encode(snap))
    path = _write(tmp_path / "impossible.kvpool", out)
    with open_recording(path) as history:
        with pytest.raises(RecordingError, match=r"impossible\.kvpool: frame 3 cannot be shown.*\(ref counts\)"):
            history.snapshot_at(3)
        history.snapshot_at(19)  # after the next keyframe: a possible pool again
    with pytest.raises(RecordingError, match=r"frame 3 .*\(ref counts\)"):
        list(read_snapshots(path))
    with pytest.raises(RecordingError, match="frame 3"):
        check_recording(path)
    result = _main("--open", str(path), "--headless", "--json")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "frame 3" in result.stderr, result.stderr


def test_a_file_header_that_disagrees_with_its_frames_is_refused(tmp_path, frames):
    ok = _write(tmp_path / "ok.kvpool", frames)
    with open_recording(ok) as history:
        header = history.recording.header
    path = tmp_path / "lying.kvpool"
    _raw_file(path, msgspec.structs.replace(header, pool=msgspec.structs.replace(header.pool, num_blocks=4096)),
              [f.payload for f in frames])
    for read in (open_recording, lambda p: list(read_frames(p)), check_recording):
        with pytest.raises(RecordingError, match="header describes another pool"):
            read(path)


# ---- finding 6: a FIFO --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_library_readers_refuse_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "pipe.kvpool"
    os.mkfifo(fifo)
    outcomes = []

    def attempt(read):
        try:
            read(fifo)
        except RecordingError as exc:
            outcomes.append(str(exc))

    for read in (open_recording, lambda p: list(read_frames(p)), lambda p: list(read_snapshots(p))):
        t = threading.Thread(target=attempt, args=(read,), daemon=True)
        t.start()
        t.join(10)
        if t.is_alive():  # blocked on the FIFO: unblock it with a writer so the test process can end
            with open(fifo, "wb"):
                pass
            t.join(10)
            pytest.fail("a reader blocked on a FIFO")
    assert len(outcomes) == 3 and all("not a regular file" in o for o in outcomes), outcomes


# ---- finding 7: corruption in the middle is not a cut-off tail -----------------------------------------------------
def test_a_bit_flip_in_a_length_field_is_corruption_with_its_frame_number(tmp_path, frames):
    path = _write(tmp_path / "run.kvpool", frames)
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    at = len(MAGIC) + _PREFIX.size + hlen
    for _ in range(5):  # the start of frame 5
        (length,) = struct.unpack_from("<I", data, at)
        at += _PREFIX.size + length
    data[at + 3] ^= 0x01  # the length's high byte: it now claims 16 MiB more, past the end of the file
    flipped = tmp_path / "flipped.kvpool"
    flipped.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match="frame 5 at byte .* is corrupt") as info:
        open_recording(flipped)
    assert not isinstance(info.value, RecordingTruncated)
    for read in (read_frames, read_snapshots):
        with pytest.raises(RecordingError, match="frame 5 at byte .* is corrupt") as info:
            list(read(flipped))
        assert not isinstance(info.value, RecordingTruncated)
    result = _main("--open", str(flipped), "--headless")
    assert result.returncode == 2 and "frame 5" in result.stderr and result.stderr.count("\n") == 1
    # a genuine cut inside frame 5 is still a cut-off tail, said as such
    cut = tmp_path / "cut.kvpool"
    cut.write_bytes(path.read_bytes()[:at + 20])
    with open_recording(cut) as history:
        assert history.recording.truncated and len(history) == 5
    with pytest.raises(RecordingTruncated, match="cut off") as info:
        list(read_snapshots(cut))
    assert info.value.frames == 5
    assert len(list(read_snapshots(cut, truncated_ok=True))) == 5
    assert check_recording(cut).truncated


# ---- finding 11: a full disk during --record -----------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_stops_the_recording_and_says_so(tmp_path, frames):
    with pytest.raises(RecordingFull, match="disk is full"):
        with Recorder("/dev/full") as rec:
            for f in frames:
                rec.write(f)
    link = tmp_path / "full.kvpool"
    link.symlink_to("/dev/full")  # every write: ENOSPC
    result = _main("--headless", "--demo", "busy", "--num-blocks", "64", "--block-size", "4", "--record", str(link),
                   timeout=300)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "disk is full" in result.stderr

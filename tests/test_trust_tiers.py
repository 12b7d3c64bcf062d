"""Issue 48, files the engine writes: the disk tier never destroys a file, never adopts one someone else planted, and
never loads K/V it did not write itself in this run.

Each test puts the fault in place (a symlink, a stranger's file, a checkpoint, a planted tier file, forged slots
whose CRC-32 still matches) and checks the engine refuses with one line, or drops and recomputes, while every byte of
the files it was pointed at stays as it was.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from engine import BlockState, Engine, EngineConfig, EngineError
from engine.kv import tiers as tiers_mod
from engine.kv.tiers import HEADER_BYTES, TIER_MAGIC
from kvstream.events import EventKind
from tests.helpers import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _engine(path, disk=16, host=2, num_blocks=12, model="builtin") -> Engine:
    return Engine(EngineConfig(model=model, block_size=4, num_blocks=num_blocks, host_tier_blocks=host,
                               disk_tier_blocks=disk, disk_tier_path=str(path), max_num_batched_tokens=128,
                               max_num_seqs=4, seed=0))


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * k) % 250 + 2 for i in range(length)] for k in range(n)]


def _fill_disk(eng: Engine) -> list[int]:
    """Conversations one after another on a small pool, so that the disk tier holds some of their blocks."""
    ids = []
    for p in _prompts(3, 24):
        ids.append(eng.add_conversation(prompt_token_ids=p, max_new_tokens=3))
        eng.run_until_idle()
    assert eng.tiers.tiers["disk"].num_cached, "the workload put nothing on disk"
    return ids


def _come_back(eng: Engine, ids: list[int]) -> list:
    eng.take_events()
    eng.continue_conversation(ids[0], prompt_token_ids=[9], max_new_tokens=3)
    eng.run_until_idle()
    return eng.take_events()


def _outputs(eng: Engine, ids) -> list:
    return [(eng.conversation(c).prompt_token_ids, eng.conversation(c).output_token_ids) for c in ids]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same workload without tiers: the tokens every tiered run must equal."""
    eng = Engine(EngineConfig(model="builtin", block_size=4, num_blocks=12, max_num_batched_tokens=128,
                              max_num_seqs=4, seed=0))
    ids = []
    for p in _prompts(3, 24):
        ids.append(eng.add_conversation(prompt_token_ids=p, max_new_tokens=3))
        eng.run_until_idle()
    eng.continue_conversation(ids[0], prompt_token_ids=[9], max_new_tokens=3)
    eng.run_until_idle()
    return _outputs(eng, ids)


def _snapshot(path: Path) -> tuple:
    info = os.stat(path)
    return path.read_bytes(), info.st_mode, info.st_size


# ---- never destroys a file ----------------------------------------------------------------------------------------
def test_a_symlink_is_refused_and_its_target_keeps_every_byte(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_bytes(b"the user's own notes\n" * 90)  # 1,890 bytes, as in the report
    before = _snapshot(target)
    link = tmp_path / "tier.bin"
    link.symlink_to(target)
    with pytest.raises(EngineError, match="symbolic link"):
        _engine(link)
    assert _snapshot(target) == before and link.is_symlink()


def test_a_dangling_symlink_is_refused_and_nothing_is_created(tmp_path):
    link = tmp_path / "tier.bin"
    link.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(EngineError, match="symbolic link"):
        _engine(link)
    assert not (tmp_path / "would-be-created").exists()


def test_an_unrelated_existing_file_is_refused_untouched(tmp_path):
    other = tmp_path / "results.csv"
    other.write_bytes(b"a,b\n1,2\n")
    os.chmod(other, 0o600)
    before = _snapshot(other)
    with pytest.raises(EngineError, match="not a disk tier file"):
        _engine(other)
    assert _snapshot(other) == before


def test_the_models_own_checkpoint_is_refused_untouched(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    before = _snapshot(weights)
    with pytest.raises(EngineError, match="the model's own file"):
        _engine(weights, model=str(ckpt))
    assert _snapshot(weights) == before
    eng = Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=16))  # the checkpoint still loads
    assert eng.generate([[1, 2, 3]], max_new_tokens=2)


def test_the_command_line_refuses_the_checkpoint_with_one_line_and_keeps_it(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    before = _snapshot(weights)
    done = subprocess.run([sys.executable, "main.py", "--headless", "--model", str(ckpt), "--disk-tier-blocks", "4",
                           "--disk-tier-path", str(weights)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the model's own file" in lines[0], done.stderr
    assert _snapshot(weights) == before


def test_the_command_line_refuses_a_tier_path_that_is_the_recording(tmp_path):
    from explorer.cli import UsageError, parse_args
    path = tmp_path / "run.kvrec"
    with pytest.raises(UsageError, match="--disk-tier-path .* is the file --record writes"):
        parse_args(["--disk-tier-blocks", "4", "--disk-tier-path", str(path), "--record", str(path)])
    (tmp_path / "alias.kvrec").symlink_to(path)  # the same file under another name
    with pytest.raises(UsageError, match="is the file --record writes"):
        parse_args(["--disk-tier-blocks", "4", "--disk-tier-path", str(tmp_path / "alias.kvrec"), "--record",
                    str(path)])


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "tier.bin"
    os.mkfifo(fifo)
    with pytest.raises(EngineError, match="not a regular file"):
        _engine(fifo)


def test_a_hard_link_is_refused(tmp_path):
    first = tmp_path / "tier.bin"
    _engine(first).close()  # a genuine tier file of this user's ...
    os.link(first, tmp_path / "elsewhere.bin")  # ... that is also another name
    before = _snapshot(first)
    with pytest.raises(EngineError, match="hard links"):
        _engine(first)
    assert _snapshot(first) == before


# ---- never adopts a planted file ----------------------------------------------------------------------------------
def _planted(path: Path, mode: int) -> Path:
    """A file that carries the tier header, as someone else could write one."""
    path.write_bytes(TIER_MAGIC + b"\0" * (HEADER_BYTES - len(TIER_MAGIC)) + b"\x7f" * 4096)
    os.chmod(path, mode)
    return path


def test_a_tier_file_others_may_write_is_refused(tmp_path):
    planted = _planted(tmp_path / "tier.bin", 0o666)
    before = _snapshot(planted)
    with pytest.raises(EngineError, match=r"may be read or written by others \(mode 0666\)"):
        _engine(planted)
    assert _snapshot(planted) == before


def test_a_tier_file_of_another_user_is_refused(tmp_path, monkeypatch):
    planted = _planted(tmp_path / "tier.bin", 0o600)
    before = _snapshot(planted)
    owner = os.stat(planted).st_uid
    monkeypatch.setattr(tiers_mod.os, "geteuid", lambda: owner + 1)  # the engine runs as someone else
    with pytest.raises(EngineError, match=f"belongs to another user \\(uid {owner}\\)"):
        _engine(planted)
    assert _snapshot(planted) == before


def test_a_tier_file_of_an_earlier_run_is_reused_and_its_slots_never_read(tmp_path, reference):
    path = tmp_path / "tier.bin"
    first = _engine(path)
    _fill_disk(first)
    first.close()
    assert os.stat(path).st_mode & 0o777 == 0o600
    second = _engine(path)  # reused: the same user's tier file
    ids = _fill_disk(second)
    events = _come_back(second, ids)
    assert _outputs(second, ids) == reference
    assert second.tiers.tiers["disk"].num_corrupt == 0
    assert any(e.kind == EventKind.LOADED and e.tier == "disk" for e in events), "nothing came back from disk"


def test_a_file_another_process_holds_is_refused(tmp_path):
    path = _planted(tmp_path / "tier.bin", 0o600)
    holder = os.open(path, os.O_RDWR)  # another engine's open file (flock locks are per open file)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        before = _snapshot(path)
        with pytest.raises(EngineError, match="in use by another engine"):
            _engine(path)
        assert _snapshot(path) == before
    finally:
        os.close(holder)


def test_a_newer_engine_of_this_process_takes_the_file_over_and_the_older_still_answers_right(tmp_path, reference):
    """The window's restart builds the new engine while the old one runs, with the same settings: the new one gets
    the file; the old one recomputes what it had on disk instead of reading the new one's bytes."""
    path = tmp_path / "tier.bin"
    old = _engine(path)
    ids = _fill_disk(old)
    new = _engine(path)
    assert old.tiers.tiers["disk"].handed_over
    events = _come_back(old, ids)
    assert _outputs(old, ids) == reference
    assert not any(e.kind == EventKind.LOADED and e.tier == "disk" for e in events)
    ids_new = _fill_disk(new)
    _come_back(new, ids_new)
    assert _outputs(new, ids_new) == reference


# ---- never loads K/V it did not write -----------------------------------------------------------------------------
def _crc_fixup(data: bytearray, at: int, crc: int) -> None:
    """Set the 4 bytes at ``at`` so that ``zlib.crc32(data) == crc``: what anyone who can write the file can do to
    a CRC-32 (it is affine in the data's bits; 32 free bits solve it)."""
    data[at:at + 4] = b"\0\0\0\0"
    base = zlib.crc32(data)
    columns = []
    for bit in range(32):
        probe = bytearray(len(data))
        probe[at + bit // 8] = 1 << (bit % 8)
        columns.append(zlib.crc32(probe) ^ zlib.crc32(bytes(len(data))))
    rows = [(columns[b], 1 << b) for b in range(32)]  # Gaussian elimination over GF(2)
    want, solution, basis = base ^ crc, 0, []
    for value, mask in rows:
        for bv, bm in basis:
            if value ^ bv < value:
                value, mask = value ^ bv, mask ^ bm
        if value:
            basis.append((value, mask))
            basis.sort(reverse=True)
    for bv, bm in basis:
        if want ^ bv < want:
            want, solution = want ^ bv, solution ^ bm
    assert want == 0, "no CRC fix-up found"
    data[at:at + 4] = solution.to_bytes(4, "little")
    assert zlib.crc32(data) == crc


def test_forged_slots_whose_crc_still_matches_are_dropped_and_recomputed(tmp_path, reference):
    eng = _engine(tmp_path / "tier.bin")
    ids = _fill_disk(eng)
    disk = eng.tiers.tiers["disk"]
    held = np.flatnonzero(disk.state == BlockState.CACHED).tolist()
    with open(disk.path, "r+b") as f:
        for slot in held:  # K/V replaced by other numbers, the CRC-32 of each slot kept as it was
            f.seek(disk.offset(slot))
            original = f.read(disk.bytes_per_block)
            forged = bytearray(np.full(disk.bytes_per_block // 4, 3.0, np.float32).tobytes())
            _crc_fixup(forged, len(forged) - 4, zlib.crc32(original))
            f.seek(disk.offset(slot))
            f.write(forged)
    events = _come_back(eng, ids)
    assert not [e for e in events if e.kind == EventKind.LOADED and e.tier == "disk"], "forged K/V was loaded"
    assert [e for e in events if e.kind == EventKind.DROPPED and e.tier == "disk"]
    assert disk.num_corrupt >= 1
    assert _outputs(eng, ids) == reference
    eng.check_invariants()


def test_swapped_slots_are_dropped_and_recomputed(tmp_path, reference):
    eng = _engine(tmp_path / "tier.bin")
    ids = _fill_disk(eng)
    disk = eng.tiers.tiers["disk"]
    held = np.flatnonzero(disk.state == BlockState.CACHED).tolist()
    assert len(held) >= 2
    with open(disk.path, "r+b") as f:
        blobs = []
        for slot in held:
            f.seek(disk.offset(slot))
            blobs.append(f.read(disk.bytes_per_block))
        for slot, blob in zip(held, blobs[1:] + blobs[:1]):  # each slot gets the next one's genuine bytes
            f.seek(disk.offset(slot))
            f.write(blob)
    events = _come_back(eng, ids)
    assert not [e for e in events if e.kind == EventKind.LOADED and e.tier == "disk"]
    assert _outputs(eng, ids) == reference

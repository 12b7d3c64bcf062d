"""Host and disk tiers of the KV cache (engine/kv/tiers.py): blocks the device pool evicts go down, come back on a
prefix hit, and nothing about them changes the tokens; every move is an event; every failure leaves every tier as
it was (or, for a failed disk write or a damaged disk block, drops the block and recomputes it)."""
from __future__ import annotations

import errno
import os

import msgspec
import numpy as np
import pytest
import torch

from engine import BlockState, Engine, EngineConfig, EngineError
from engine.kv.kv_events import to_kv_events
from engine.kv.tiers import DiskTier, HostTier, TierStore
from kvstream.events import EventKind, PoolModel
from kvstream.kv_events.codec import BlockRemoved, BlockStored, decode_batch, encode_batch, make_batch
from kvstream.rules import group_key, raw_hash
from kvstream.summary import json_summary
from kvstream.views import NO_HASH


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * k) % 250 + 2 for i in range(length)] for k in range(n)]


_MODEL = ["builtin"]  # the model _engine builds (the ``model`` fixture switches it to a grouped checkpoint)


@pytest.fixture(scope="module")
def grouped_checkpoint(tmp_path_factory) -> str:
    """Two KV cache groups (sliding-window layers 0 and 2, full attention layer 1; a window of 8 tokens), with the
    built-in model's vocabulary size, so the same prompts run on it."""
    from tests.test_groups import write_mixed_checkpoint
    return str(write_mixed_checkpoint(tmp_path_factory.mktemp("grouped"), vocab_size=258))


@pytest.fixture(params=["builtin", "grouped"])
def model(request, grouped_checkpoint):
    """Runs a test on the built-in model (one KV cache group) and on a checkpoint of two groups, whose pool
    offloads and loads each group's blocks under its own cache key (twice the device and tier blocks: each
    conversation holds a table per group, and both groups' blocks go down)."""
    _MODEL[0] = "builtin" if request.param == "builtin" else grouped_checkpoint
    yield request.param
    _MODEL[0] = "builtin"


def _engine(tmp_path, block_size=4, num_blocks=None, host=0, disk=0, name="tier.bin", **kw) -> Engine:
    path = str(tmp_path / name) if disk else None
    blocks = num_blocks or max(8, 64 // block_size)
    scale = 1 if _MODEL[0] == "builtin" else 2
    return Engine(EngineConfig(model=_MODEL[0], block_size=block_size, num_blocks=scale * blocks,
                               host_tier_blocks=scale * host, disk_tier_blocks=scale * disk, disk_tier_path=path,
                               max_num_batched_tokens=128, max_num_seqs=4, seed=0, **kw))


def _returning_workload(eng: Engine, n=3, length=24, new=4, temps=(0.0, 0.9, 0.0)) -> tuple[list[int], list]:
    """Conversations that run one after another on a small pool, then each comes back with a reply (its earlier
    blocks long evicted from the device): (ids, every event)."""
    events = []
    ids = []
    for k, prompt in enumerate(_prompts(n, length)):
        ids.append(eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=new, temperature=temps[k % len(temps)]))
        eng.run_until_idle()
        events += eng.take_events()
    for k, cid in enumerate(ids):
        eng.continue_conversation(cid, prompt_token_ids=[3, 4 + k], max_new_tokens=new)
        eng.run_until_idle()
        events += eng.take_events()
    return ids, events


def _outputs(eng: Engine, ids) -> list:
    return [(eng.conversation(c).prompt_token_ids, eng.conversation(c).output_token_ids) for c in ids]


def _count(events, kind, tier) -> int:
    return sum(len(e.block_hashes) for e in events if e.kind == kind and e.tier == tier)


# ---- tokens -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size, host, disk, n, length", [(1, 32, 128, 4, 24), (4, 8, 32, 4, 24),
                                                               (16, 3, 8, 4, 48)])
def test_tokens_identical_with_tiers_on_and_off(model, tmp_path, block_size, host, disk, n, length):
    """Greedy and sampled conversations give the same tokens whether their prefixes come back from host and disk
    or are recomputed; and blocks really went down to both tiers and came back from both."""
    off = _engine(tmp_path, block_size)
    on = _engine(tmp_path, block_size, host=host, disk=disk)
    ids_off, _ = _returning_workload(off, n=n, length=length)
    ids_on, events = _returning_workload(on, n=n, length=length)
    assert _outputs(on, ids_on) == _outputs(off, ids_off)
    for tier in ("host", "disk"):
        assert _count(events, EventKind.OFFLOADED, tier) > 0, tier
        assert _count(events, EventKind.LOADED, tier) > 0, tier
    sources = [on.prompt_token_sources(c) for c in ids_on]
    assert sum(s["host"] for s in sources) > 0 and sum(s["disk"] for s in sources) > 0
    for cid, s in zip(ids_on, sources):
        assert sum(s.values()) == len(on.conversation(cid).prompt_token_ids)
        assert set(s) == {"device", "host", "disk", "computed"}
    for s in (off.prompt_token_sources(c) for c in ids_off):  # tiers off: device hits or computed, nothing else
        assert s["host"] == s["disk"] == 0
    on.check_invariants()


def test_prompt_token_sources_count_each_tier(tmp_path):
    eng = _engine(tmp_path, 4, num_blocks=12, host=4, disk=16)
    a = eng.add_conversation(prompt_token_ids=_prompts(1, 24)[0], max_new_tokens=2)
    eng.run_until_idle()
    assert eng.prompt_token_sources(a) == {"device": 0, "host": 0, "disk": 0, "computed": 24}
    for prompt in _prompts(3, 24)[1:]:  # push a's blocks down: the most recent 4 in host, the older ones on disk
        eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=2)
        eng.run_until_idle()
    eng.take_events()
    eng.continue_conversation(a, prompt_token_ids=[9], max_new_tokens=2)
    eng.run_until_idle()
    s = eng.prompt_token_sources(a)
    assert s["host"] > 0 and s["disk"] > 0 and s["device"] == 0
    assert sum(s.values()) == 27
    loaded = [e for e in eng.take_events() if e.kind == EventKind.LOADED]
    assert sum(len(e.block_hashes) for e in loaded) * 4 == s["host"] + s["disk"]
    assert {e.tier for e in loaded} == {"host", "disk"} and all(e.conversation_id == a for e in loaded)


# ---- bytes --------------------------------------------------------------------------------------------------------
def test_loaded_kv_is_bit_identical_to_what_was_offloaded(model, tmp_path):
    """Every device block's bytes are noted while it is cached (what an eviction will take); every block loaded
    back holds exactly the bytes its hash had then, and inspect_block shows the same K/V. In a grouped pool a block
    id is a slot in every layer plane and a group of fewer layers leaves the last planes unused (what an earlier
    owner left there, never read): the K/V compared are its group's planes."""
    eng = _engine(tmp_path, 4, num_blocks=12, host=4, disk=12, dtype="bfloat16")
    groups = eng.snapshot().kv_cache_groups
    seen: dict[int, bytes] = {}
    checked = 0

    def kv_of(data: np.ndarray, group: int) -> bytes:
        used = 2 * len(groups[group].layers) if len(groups) > 1 else eng.kv.num_planes  # K and V per layer
        return data.reshape(eng.kv.num_planes, -1)[:used].tobytes()

    def note():
        nonlocal checked
        snap = eng.snapshot()
        for b in np.flatnonzero(snap.state == BlockState.CACHED):
            group = int(snap.block_group[b]) if snap.block_group is not None else 0
            seen.setdefault(int(snap.block_hash[b]), kv_of(eng.kv.read_block_bytes(int(b)), group))
        for e in eng.take_events():
            if e.kind == EventKind.LOADED:
                for b, h in zip(e.block_ids, e.block_hashes):  # events: the plain hash; the pool: its group's key
                    assert kv_of(eng.kv.read_block_bytes(b), e.group) == seen[group_key(h, e.group)]
                    checked += 1

    prompts = _prompts(4, 20)
    ids = []
    for p in prompts:
        ids.append(eng.add_conversation(prompt_token_ids=p, max_new_tokens=3))
        while eng.has_work():
            eng.step()
            note()
    for cid in ids:
        eng.continue_conversation(cid, prompt_token_ids=[5], max_new_tokens=1)
        eng.step()  # the admission: loads, and the first token (nothing is written into loaded blocks)
        note()
        eng.run_until_idle()
        note()
    assert checked > 0
    # what the tiers hold is what the device held
    compared = 0
    for tier in eng.tiers.order:
        for slot in np.flatnonzero(tier.state == BlockState.CACHED):
            h = int(tier.block_hash[slot])
            if h in seen:
                assert kv_of(tier.read(int(slot)), int(tier.group[slot])) == seen[h]
                compared += 1
    assert compared > 0


def test_a_grouped_pool_loads_every_full_attention_block_and_only_the_windows_sliding_blocks(tmp_path,
                                                                                            grouped_checkpoint):
    """A returning conversation whose blocks all went to the host tier: the full-attention group loads every block
    of its prefix, the sliding group (window 8) only the two blocks its next token's window reads; the blocks
    before stay -1 in its table, never loaded. Its prompt tokens all came from host."""
    eng = Engine(EngineConfig(model=grouped_checkpoint, block_size=4, num_blocks=24, host_tier_blocks=64,
                              max_num_batched_tokens=128, max_num_seqs=4, seed=0))
    a = eng.add_conversation(prompt_token_ids=_prompts(1, 32)[0], max_new_tokens=2)
    eng.run_until_idle()
    for prompt in _prompts(4, 32)[1:]:  # push a's blocks out of the device pool
        eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=2)
        eng.run_until_idle()
    events = eng.take_events()
    mine = {(h, e.group) for e in events if e.kind == EventKind.STORED and e.conversation_id == a
            for h in e.block_hashes}
    assert len(mine) == 16  # 8 full blocks (33 tokens computed) in each group
    snap = eng.snapshot()
    assert not {group_key(h, g) for h, g in mine} & set(snap.block_hash.tolist())  # none left on the device
    eng.continue_conversation(a, prompt_token_ids=[9], max_new_tokens=2)  # 35 tokens: a hit of 8 blocks
    eng.step()
    loaded = [e for e in eng.take_events() if e.kind == EventKind.LOADED and e.conversation_id == a]
    by_group = {g: sum(len(e.block_ids) for e in loaded if e.group == g) for g in (0, 1)}
    assert by_group == {0: 8, 1: 2}
    sliding = eng.conversation(a).group_block_tables[1]  # after the step's 3 tokens the window starts in block 7
    assert sliding[:7] == (-1,) * 7 and -1 not in sliding[7:] and len(sliding) == 9
    assert eng.prompt_token_sources(a) == {"device": 0, "host": 32, "disk": 0, "computed": 3}
    eng.run_until_idle()
    eng.check_invariants()


# ---- damaged disk blocks ------------------------------------------------------------------------------------------
def test_corrupt_disk_block_is_recomputed_with_identical_tokens(model, tmp_path, caplog):
    def run(eng, damage):
        ids = []
        for p in _prompts(3, 24):
            ids.append(eng.add_conversation(prompt_token_ids=p, max_new_tokens=3))
            eng.run_until_idle()
        eng.take_events()
        if damage:
            disk = eng.tiers.tiers["disk"]
            held = np.flatnonzero(disk.state == BlockState.CACHED)
            assert held.size
            with open(disk.path, "r+b") as f:  # flip bytes in every block the disk tier holds
                for slot in held:
                    f.seek(disk.offset(int(slot)) + 100)
                    f.write(b"\xff\x00\xff\x00")
        eng.continue_conversation(ids[0], prompt_token_ids=[9], max_new_tokens=3)
        eng.run_until_idle()
        return ids, eng.take_events()

    off = _engine(tmp_path, 4, num_blocks=12)
    ids_off, _ = run(off, False)
    on = _engine(tmp_path, 4, num_blocks=12, host=2, disk=16)
    ids_on, events = run(on, True)
    assert _outputs(on, ids_on) == _outputs(off, ids_off)
    dropped = [e for e in events if e.kind == EventKind.DROPPED and e.tier == "disk"]
    assert dropped, "the damaged block was not dropped"
    assert not [e for e in events if e.kind == EventKind.LOADED and e.tier == "disk"]
    assert on.prompt_token_sources(ids_on[0])["disk"] == 0
    assert on.tiers.tiers["disk"].num_corrupt >= 1
    assert "checksum" in caplog.text
    on.check_invariants()


def test_checksum_failure_falls_back_to_recompute(tmp_path, monkeypatch):
    """The tag itself disagreeing (monkeypatched) is treated like a damaged block."""
    eng = _engine(tmp_path, 4, num_blocks=12, host=2, disk=16)
    ids = []
    for p in _prompts(3, 24):
        ids.append(eng.add_conversation(prompt_token_ids=p, max_new_tokens=3))
        eng.run_until_idle()
    import engine.kv.tiers as tiers_mod
    monkeypatch.setattr(tiers_mod.DiskTier, "_tag", lambda self, slot, block_hash, data: b"x" * 32)
    eng.take_events()
    eng.continue_conversation(ids[0], prompt_token_ids=[9], max_new_tokens=3)
    eng.run_until_idle()
    events = eng.take_events()
    assert not [e for e in events if e.kind == EventKind.LOADED and e.tier == "disk"]
    assert eng.prompt_token_sources(ids[0])["disk"] == 0
    off = _engine(tmp_path, 4, num_blocks=12)
    ids_off = []
    for p in _prompts(3, 24):
        ids_off.append(off.add_conversation(prompt_token_ids=p, max_new_tokens=3))
        off.run_until_idle()
    off.continue_conversation(ids_off[0], prompt_token_ids=[9], max_new_tokens=3)
    off.run_until_idle()
    assert _outputs(eng, ids) == _outputs(off, ids_off)


# ---- faults: whole or nothing -------------------------------------------------------------------------------------
def _fingerprint(eng: Engine):
    snap = eng.snapshot()
    return (eng.tiers.fingerprint(), snap.state.tobytes(), snap.ref_count.tobytes(), snap.block_hash.tobytes(),
            snap.num_filled.tobytes(), tuple(eng.manager.events), repr(sorted(eng.manager.prompt_sources.items())),
            eng.tiers.num_offloaded, eng.tiers.num_loaded, eng.tiers.num_dropped, eng.step_id,
            {t: v.block_hash.tobytes() for t, v in snap.tiers.items()})


def _primed(tmp_path) -> tuple[Engine, list[int]]:
    """An engine whose next steps load from host and disk, offload to host and move host blocks on to disk."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    eng = _engine(tmp_path, 4, num_blocks=10, host=4, disk=6)
    ids = []
    for p in _prompts(4, 16):
        ids.append(eng.add_conversation(prompt_token_ids=p, max_new_tokens=3))
        eng.run_until_idle()
    host = eng.tiers.tiers["host"]
    assert host.num_cached == host.num_blocks and eng.tiers.tiers["disk"].num_cached > 0
    eng.continue_conversation(ids[0], prompt_token_ids=[9], max_new_tokens=3)
    return eng, ids


def _next_step_moves(tmp_path) -> dict:
    eng, _ = _primed(tmp_path)
    eng.take_events()
    eng.step()
    kinds = {}
    for e in eng.take_events():
        kinds[(e.kind, e.tier)] = kinds.get((e.kind, e.tier), 0) + 1
    return kinds


def test_primed_step_moves_blocks_every_way(model, tmp_path):
    """The fault tests below fail the step that loads from both tiers, offloads and moves host blocks to disk."""
    kinds = _next_step_moves(tmp_path)
    for key in ((EventKind.LOADED, "host"), (EventKind.LOADED, "disk"), (EventKind.OFFLOADED, "host"),
                (EventKind.OFFLOADED, "disk"), (EventKind.DROPPED, "host")):
        assert kinds.get(key), key


def _kv(eng):
    return eng.kv.data.clone()


@pytest.mark.parametrize("where", ["device_read", "disk_write", "load_copy", "forward", "host_write"])
def test_failed_step_leaves_every_tier_as_it_was(model, tmp_path, monkeypatch, where):
    eng, ids = _primed(tmp_path)
    before, kv = _fingerprint(eng), _kv(eng)
    fault = RuntimeError(f"injected fault in {where}")

    def boom(*a, **k):
        raise fault

    if where == "device_read":
        monkeypatch.setattr(eng.manager, "read_device_blocks", boom)
    elif where == "disk_write":
        monkeypatch.setattr(DiskTier, "_write_raw", boom)
    elif where == "host_write":
        real = HostTier._write_raw
        calls = []

        def second(self, slot, data, block_hash=None):  # the first write happens, the second fails: undone
            calls.append(slot)
            if len(calls) == 2:
                raise fault
            real(self, slot, data, block_hash)
        monkeypatch.setattr(HostTier, "_write_raw", second)
    elif where == "load_copy":
        monkeypatch.setattr(eng.kv, "write_blocks_bytes", boom)
    elif where == "forward":
        monkeypatch.setattr(eng.runner, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert _fingerprint(eng) == before
    assert torch.equal(_kv(eng), kv)
    eng.check_invariants()
    monkeypatch.undo()
    # and it goes on exactly as an engine that never failed
    eng.run_until_idle()
    ref, ref_ids = _primed(tmp_path / "ref")
    ref.run_until_idle()
    assert _outputs(eng, ids) == _outputs(ref, ref_ids)
    assert _fingerprint(eng)[0] == _fingerprint(ref)[0]


def test_failed_generate_rolls_back_tiers(model, tmp_path, monkeypatch):
    """A multi-step operation (generate) that fails late undoes the moves of its earlier steps too."""
    eng, _ = _primed(tmp_path)
    eng.run_until_idle()
    before, kv = _fingerprint(eng), _kv(eng)
    real, calls = eng.runner.forward, []

    def forward(prepared):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("injected fault on the sixth forward")
        return real(prepared)
    monkeypatch.setattr(eng.runner, "forward", forward)
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate(_prompts(4, 16), max_new_tokens=4)
    assert len(calls) == 6
    assert _fingerprint(eng) == before
    assert torch.equal(_kv(eng), kv)


def test_disk_full_drops_the_block_and_goes_on(tmp_path, monkeypatch, caplog):
    """A disk write that fails with an OS error (disk full) drops the block being written (logged, DROPPED from
    host with no tier below named); the step succeeds and the tokens are those of an engine without tiers."""
    eng, ids = _primed(tmp_path)

    def full(self, slot, data, block_hash=None):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(DiskTier, "_write_raw", full)
    disk_before = eng.tiers.tiers["disk"].num_cached
    eng.take_events()
    eng.run_until_idle()
    events = eng.take_events()
    assert not [e for e in events if e.kind == EventKind.OFFLOADED and e.tier == "disk"]
    lost = [e for e in events if e.kind == EventKind.DROPPED and e.tier == "host"]
    assert lost and all(e.reason == "" for e in lost)
    assert "No space left" in caplog.text
    assert eng.tiers.tiers["disk"].num_cached <= disk_before
    eng.check_invariants()
    monkeypatch.undo()
    ref, ref_ids = _primed(tmp_path / "ref")
    ref.run_until_idle()
    assert _outputs(eng, ids) == _outputs(ref, ref_ids)


# ---- copies: one pass each way ------------------------------------------------------------------------------------
def _returning_over_cached(tmp_path, **kw) -> tuple[Engine, int]:
    """A pool that holds one conversation: a's blocks went to host when b took the pool; a's return loads them back
    into b's cached (evicted, offloaded) blocks. The engine stands before that step."""
    eng = _engine(tmp_path, 4, num_blocks=8, host=16, **kw)
    a, b = (eng.add_conversation(prompt_token_ids=p, max_new_tokens=2) for p in _prompts(2, 24))
    eng.run_until_idle()  # a, then b (one at a time: 7 blocks each of 8)
    eng.continue_conversation(a, prompt_token_ids=[9], max_new_tokens=2)
    eng.take_events()
    return eng, a


def test_an_admission_reads_evicted_blocks_once_and_writes_loads_once(tmp_path, monkeypatch):
    """The blocks an admission evicts are read from the device in one gather (not one per block), the tier hits
    are written in one scatter, and the rollback copy of the evicted targets is that gather's copy: nothing of
    theirs is read a second time (save_blocks only for targets that were not cached)."""
    eng, a = _returning_over_cached(tmp_path)
    reads, writes, saved = [], [], []
    real_read, real_write, real_save = eng.manager.read_device_blocks, eng.kv.write_blocks_bytes, eng.kv.save_blocks
    monkeypatch.setattr(eng.manager, "read_device_blocks", lambda blocks, out: (reads.append(list(blocks)),
                                                                                  real_read(blocks, out))[1])
    monkeypatch.setattr(eng.kv, "write_blocks_bytes", lambda blocks, data: (writes.append(list(blocks)),
                                                                            real_write(blocks, data))[1])
    monkeypatch.setattr(eng.kv, "save_blocks", lambda blocks: (saved.extend(blocks), real_save(blocks))[1])
    eng.step()
    events = eng.take_events()
    loaded = [b for e in events if e.kind == EventKind.LOADED for b in e.block_ids]
    evicted = [b for e in events if e.kind == EventKind.EVICTED for b in e.block_ids]
    offloaded = [b for e in events if e.kind == EventKind.OFFLOADED and e.tier == "host" for b in e.block_ids]
    assert eng.prompt_token_sources(a)["host"] >= 16 and len(loaded) >= 4
    into_evicted = set(loaded) & set(evicted)
    assert len(into_evicted) >= 4 and into_evicted <= set(offloaded)
    # one gather per taking of blocks (the load's, the computed tokens'), not one per block
    assert sorted(b for r in reads for b in r) == sorted(offloaded) and len(reads) <= 2 < len(offloaded)
    assert writes == [loaded]  # one scatter for every hit of the admission
    assert set(saved) == set(loaded) - into_evicted  # the evicted ones' rollback copy is the gather's


def test_load_rolled_back_restores_the_evicted_and_the_never_used_targets(tmp_path, monkeypatch):
    """A step that loaded into evicted blocks (restored from the offload's copy) and into a free block (restored
    from save_blocks), then failed: the K/V tensor is exactly as before, free blocks' bytes included."""
    eng, a = _returning_over_cached(tmp_path)
    snap = eng.snapshot()
    free_before = {int(b) for b in np.flatnonzero(snap.state == BlockState.FREE)}
    cached_before = {int(b) for b in np.flatnonzero(snap.state == BlockState.CACHED)}
    eng.kv.data[:, :, sorted(free_before)] = 7.0  # a free block holds something too; it must come back
    kv, before = _kv(eng), _fingerprint(eng)
    targets = []
    real_write = eng.kv.write_blocks_bytes
    monkeypatch.setattr(eng.kv, "write_blocks_bytes", lambda blocks, data: (targets.extend(blocks),
                                                                            real_write(blocks, data))[1])

    def boom(*_):
        raise RuntimeError("injected fault after the load")
    monkeypatch.setattr(eng.runner, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert set(targets) & free_before and len(set(targets) & cached_before) >= 4
    assert torch.equal(_kv(eng), kv)
    assert _fingerprint(eng) == before
    eng.check_invariants()


def test_staging_arrays_are_lent_per_transaction_and_reused(tmp_path):
    """Two arrays lent in one transaction never share memory; after it ends the same memory is lent again
    (allocated once, at start: the first returning conversation pays no page faults)."""
    store = TierStore(4, 0, None, 64, staging_blocks=8)
    kept = {buf.ctypes.data for buf in store._staging_free}
    assert len(kept) == 2
    store.begin()
    x, y = store.staging(8), store.staging(8)
    assert x.shape == (8, 64) and not np.shares_memory(x, y)
    assert {x.ctypes.data, y.ctypes.data} == kept
    store.end()
    store.begin()
    assert store.staging(3).ctypes.data in kept
    big = store.staging(100)  # more than was allocated at start: a new array
    assert big.shape == (100, 64) and big.ctypes.data not in kept
    store.rollback()
    assert len(store._staging_free) == 3  # all kept (under STAGING_KEEP_BYTES)


def test_lendings_go_on_in_the_last_array_lent_without_overlapping(tmp_path):
    """Small lendings of one transaction share an array (each its own rows); a returning conversation's admission
    (its loads, then the blocks it evicts twice) lends only the two arrays made at the start: a third, made then,
    faulted ~94 MB of fresh pages in during the step (135M shape; about 0.9 s of a 1 s first token here)."""
    store = TierStore(4, 0, None, 64, staging_blocks=8)
    store.begin()
    x, y, z = store.staging(3), store.staging(4), store.staging(2)
    assert not np.shares_memory(x, y) and not np.shares_memory(y, z) and not np.shares_memory(x, z)
    assert y.ctypes.data == x.ctypes.data + 3 * 64  # the rows after x's, in the same array
    assert store.num_staging_made == 2
    store.end()
    eng, a = _returning_over_cached(tmp_path)
    made = eng.tiers.num_staging_made
    eng.step()
    events = eng.take_events()
    assert eng.prompt_token_sources(a)["host"] >= 16
    assert sum(len(e.block_ids) for e in events if e.kind == EventKind.OFFLOADED) >= 4  # it evicted, too
    assert eng.tiers.num_staging_made == made == 2


# ---- events -------------------------------------------------------------------------------------------------------
def _replay(eng: Engine, events) -> PoolModel:
    model = PoolModel(eng.cfg.num_blocks, {t.name: t.num_blocks for t in eng.tiers.order})
    for e in events:
        model.apply(e)
    return model


def test_events_replay_every_tier(model, tmp_path):
    eng = _engine(tmp_path, 4, num_blocks=12, host=4, disk=8)
    ids, events = _returning_workload(eng, n=4, length=20)
    eng.relocate_blocks(seed=3)
    events += eng.take_events()
    model = _replay(eng, events)
    snap = eng.snapshot()
    assert (model.state == snap.state).all() and (model.ref_count == snap.ref_count).all()
    for name, view in snap.tiers.items():
        assert (model.tier_hash[name] == view.block_hash).all(), name
        assert ((view.state == BlockState.CACHED) == (view.block_hash != NO_HASH)).all()
    # a reset of the prefix cache empties every tier, in events too
    eng.reset_prefix_cache()
    more = eng.take_events()
    model = _replay(eng, events + more)
    snap = eng.snapshot()
    assert all((v.state == BlockState.FREE).all() for v in snap.tiers.values())
    assert all((model.tier_hash[name] == 0).all() for name in snap.tiers)
    assert {e.tier for e in more if e.kind == EventKind.DROPPED} == {"host", "disk"}
    assert ids


def test_replay_refuses_impossible_tier_events(tmp_path):
    eng = _engine(tmp_path, 4, num_blocks=12, host=4)
    _ids, events = _returning_workload(eng, n=3, length=20)
    offloaded = next(e for e in events if e.kind == EventKind.OFFLOADED)
    model = _replay(eng, [])
    model.apply(offloaded)
    with pytest.raises(AssertionError):
        model.apply(offloaded)  # the slot is taken
    dropped = msgspec.structs.replace(offloaded, kind=EventKind.DROPPED, block_hashes=(offloaded.block_hashes[0] + 1,))
    with pytest.raises(AssertionError):
        model.apply(dropped)  # the slot holds another hash


def test_kv_events_carry_every_medium(model, tmp_path):
    """The engine's block events as vLLM-format KV events, through the codec: a subscriber rebuilds the hashes of
    the device pool ("GPU"), the host tier ("CPU") and the disk tier ("STORAGE") exactly, per KV cache group;
    tier stores carry the full payload (tokens, parent, block size) and name their group as the device's do."""
    eng = _engine(tmp_path, 4, num_blocks=12, host=4, disk=8)
    _ids, events = _returning_workload(eng, n=4, length=20)
    groups = eng.snapshot().kv_cache_groups
    decoded = decode_batch(encode_batch(make_batch(to_kv_events(events, 4, groups), 0.0)))
    held: dict[str, set] = {"GPU": set(), "CPU": set(), "STORAGE": set()}  # (plain hash, group) per medium
    for ev in decoded.events:
        if isinstance(ev, BlockStored):
            held[ev.medium].update((h, ev.group_idx) for h in ev.block_hashes)
            assert ev.block_size == 4 and len(ev.token_ids) == 4 * len(ev.block_hashes)
            assert ev.kv_cache_spec_kind == groups[ev.group_idx].kind
        elif isinstance(ev, BlockRemoved):
            held[ev.medium].difference_update((h, ev.group_idx) for h in ev.block_hashes)
    snap = eng.snapshot()
    block_group = snap.block_group if snap.block_group is not None else np.zeros(snap.num_blocks, np.int8)
    assert held["GPU"] == {(raw_hash(int(k), int(g)), int(g)) for k, g in zip(snap.block_hash, block_group)
                           if k != NO_HASH}
    for medium, name in (("CPU", "host"), ("STORAGE", "disk")):
        tier = eng.tiers.tiers[name]  # the engine's own tier: the group of each slot
        expect = {(raw_hash(int(k), int(g)), int(g)) for k, g in zip(snap.tiers[name].block_hash, tier.group)
                  if k != NO_HASH}
        assert held[medium] == expect != set(), medium
    if model == "grouped":
        assert {g for _, g in held["CPU"] | held["STORAGE"]} == {0, 1}  # both groups went down
    stores = [ev for ev in decoded.events if isinstance(ev, BlockStored) and ev.medium != "GPU"]
    by_hash = {}
    for e in events:
        if e.kind == EventKind.STORED:
            for i, h in enumerate(e.block_hashes):
                by_hash[h] = tuple(e.token_ids[4 * i:4 * i + 4])
    for ev in stores:  # the tokens a tier store names are the ones the device stored under that hash
        assert tuple(ev.token_ids) == by_hash[ev.block_hashes[0]]


# ---- views --------------------------------------------------------------------------------------------------------
def test_snapshot_tiers_and_json(tmp_path):
    eng = _engine(tmp_path, 4, num_blocks=12, host=4, disk=8)
    assert set(eng.snapshot().tiers) == {"host", "disk"}
    _returning_workload(eng, n=3, length=20)
    snap = eng.snapshot()
    host = snap.tiers["host"]
    assert host.num_blocks == 4 and host.state.dtype == np.int8 and host.block_hash.dtype == np.uint64
    assert not host.state.flags.writeable
    assert (host.last_access[host.state == BlockState.CACHED] > 0).all()
    assert eng.snapshot() is snap  # nothing changed: the same snapshot, the same tier views
    out = json_summary(snap)
    assert out["stored_hashes_by_medium"] == {
        "GPU": int(np.unique(snap.block_hash[snap.block_hash != NO_HASH]).size),
        "CPU": int((host.state == BlockState.CACHED).sum()),
        "STORAGE": int((snap.tiers["disk"].state == BlockState.CACHED).sum())}
    assert out["tiers"]["host"] == {"num_blocks": 4, "used": int((host.state == BlockState.CACHED).sum())}
    assert _engine(tmp_path, 4).snapshot().tiers == {}
    assert json_summary(_engine(tmp_path, 4).snapshot())["stored_hashes_by_medium"]["CPU"] == 0


# ---- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    ({"host_tier_blocks": -1}, "host_tier_blocks"),
    ({"host_tier_blocks": True}, "host_tier_blocks must be an integer"),
    ({"disk_tier_blocks": 1.5, "disk_tier_path": "x"}, "disk_tier_blocks must be an integer"),
    ({"disk_tier_blocks": 4}, "needs disk_tier_path"),
    ({"disk_tier_path": "/tmp/x.bin"}, "disk_tier_blocks is 0"),
    ({"disk_tier_blocks": 4, "disk_tier_path": ""}, "disk_tier_path"),
    ({"disk_tier_blocks": 4, "disk_tier_path": 7}, "disk_tier_path"),
    ({"host_tier_blocks": 4, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"host_tier_blocks": 1 << 30}, "host_tier_blocks"),
])
def test_bad_tier_config(kw, words):
    with pytest.raises(EngineError, match=words):
        EngineConfig(**kw)


def test_disk_tier_path_refused_at_construction(tmp_path):
    with pytest.raises(EngineError, match="folder"):
        _engine(tmp_path, 4, disk=4, name="")  # the path is the folder itself
    with pytest.raises(EngineError, match="does not exist"):
        _engine(tmp_path, 4, disk=4, name="no/such/dir/tier.bin")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(EngineError):
        _engine(tmp_path, 4, disk=4, name="file/tier.bin")  # a file where the folder should be
    with pytest.raises(EngineError, match="GiB free"):
        _engine(tmp_path, 4, disk=(1 << 24))  # 16M blocks of 16 KiB: more than the disk holds
    with pytest.raises(EngineError, match="host tier"):
        _engine(tmp_path, 4, host=(1 << 24))  # 256 GiB of host memory


def test_unwritable_disk_tier_path(tmp_path, monkeypatch):
    real = os.open

    def refuse(path, flags, *a):
        if str(path).endswith("tier.bin"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, flags, *a)
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(EngineError, match="cannot create the disk tier file"):
        _engine(tmp_path, 4, disk=4)


def test_disk_file_synced_and_closed(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    import engine.kv.tiers as tiers_mod
    monkeypatch.setattr(tiers_mod, "FSYNC_EVERY", 2)
    eng = _engine(tmp_path, 4, num_blocks=10, disk=8)
    _returning_workload(eng, n=3, length=16)
    assert len(synced) >= 1
    n = len(synced)
    fd = eng.tiers.tiers["disk"].fd
    eng.close()
    assert len(synced) == n + 1 and synced[-1] == fd
    with pytest.raises(OSError):
        os.fstat(fd)
    assert eng.snapshot().tiers == {}  # the engine stays usable after close, without tiers
    cid = eng.add_conversation(prompt_token_ids=[5, 6, 7], max_new_tokens=2)
    eng.run_until_idle()
    assert len(eng.conversation(cid).output_token_ids) == 2


def test_tier_store_without_engine(tmp_path):
    """The bookkeeping alone (no torch): LRU order down the tiers, a hash once per tier, pinned slots kept."""
    from engine.kv.pool import HashedBlock, hash_block_tokens
    events = []

    def emit(kind, cid=-1, **f):
        events.append((kind, f.get("tier"), f.get("block_hashes"), f.get("reason")))
    store = TierStore(2, 2, str(tmp_path / "t.bin"), 8)
    rec = {i: HashedBlock((i, 2), 0, None) for i in range(11, 16)}  # content i: tokens (i, 2)
    key = {i: hash_block_tokens(None, (i, 2)) for i in rec}  # its prefix hash (the key, in group 0)
    held = lambda tier: {i for i in rec if key[i] in tier.hash_to_slot}  # noqa: E731
    for i in (11, 12, 13):
        store.offload(key[i], rec[i], lambda i=i: np.full(8, i, np.uint8), 0, 1, emit)
    host, disk = store.tiers["host"], store.tiers["disk"]
    assert held(host) == {12, 13} and held(disk) == {11}
    assert disk.read(disk.lookup(key[11])).tolist() == [11] * 8
    store.offload(key[12], rec[12], lambda: pytest.fail("a hash the host holds is not copied again"), 0, 2, emit)
    store.pin([store.lookup(key[13])])
    store.offload(key[14], rec[14], lambda: np.full(8, 14, np.uint8), 0, 3, emit)  # 13 is the LRU one, but pinned
    assert held(host) == {13, 14} and held(disk) == {11, 12}
    store.unpin()
    store.offload(key[15], rec[15], lambda: np.full(8, 15, np.uint8), 0, 4, emit)  # disk full: its LRU (11) goes
    assert held(host) == {14, 15} and held(disk) == {12, 13}
    assert (EventKind.DROPPED, "disk", (key[11],), "") in events
    assert (EventKind.DROPPED, "host", (key[13],), "disk") in events
    store.check_invariants()
    host.records[key[14]] = rec[13]  # a slot whose key is not its content's
    with pytest.raises(AssertionError, match="not its content's"):
        store.check_invariants()
    store.close()


# ---- command line -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--host-tier-blocks", "-1"], "--host-tier-blocks must be 0"),
    (["--disk-tier-blocks", "4"], "needs --disk-tier-path"),
    (["--disk-tier-path", "x.bin"], "needs --disk-tier-blocks"),
    (["--disk-tier-blocks", "4", "--disk-tier-path", "/no/such/folder/x.bin"], "does not exist"),
    (["--attach", "tcp://127.0.0.1:5560", "--host-tier-blocks", "4"], "--host-tier-blocks run the local engine"),
])
def test_cli_refuses_bad_tier_flags(argv, words):
    from explorer.cli import UsageError, parse_args
    with pytest.raises(UsageError, match=words):
        parse_args(argv)


def test_cli_tier_flags_reach_the_config(tmp_path, capsys):
    from explorer.cli import parse_args
    opts = parse_args(["--host-tier-blocks", "8", "--disk-tier-blocks", "4", "--disk-tier-path",
                       str(tmp_path / "t.bin")])
    assert (opts.host_tier_blocks, opts.disk_tier_blocks, opts.disk_tier_path) == (8, 4, str(tmp_path / "t.bin"))
    import main
    with pytest.raises(SystemExit) as exit_info:  # too large for EngineConfig: one line, exit 2
        raise SystemExit(main.main(["--headless", "--host-tier-blocks", str(1 << 30)]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host_tier_blocks" in err[0]

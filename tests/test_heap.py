"""The engine thread gives freed heap back to the system on a schedule (engine/heap.py): a long served run's
resident memory creeps up from allocator fragmentation otherwise (bench/soak.py measures it)."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from engine import Engine, EngineConfig, EngineRunner
from engine import heap
from tests.helpers import wait_until


def test_the_trimmer_trims_once_per_interval():
    now = [100.0]
    trimmer = heap.HeapTrimmer(every_s=10.0, clock=lambda: now[0])
    assert not trimmer.maybe_trim()  # not before the first interval has passed
    now[0] += 9.9
    assert not trimmer.maybe_trim()
    now[0] += 0.2
    assert trimmer.maybe_trim() == heap.available()
    assert not trimmer.maybe_trim()  # the next one waits a whole interval again
    now[0] += 10.0
    trimmer.maybe_trim()
    assert trimmer.trims == (2 if heap.available() else 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is a Linux call")
def test_glibc_gives_freed_fragmented_heap_back():
    assert heap.available()
    keep, drop = [], []
    for i in range(20000):  # interleaved: the dropped ones leave holes the allocator keeps without a trim
        (keep if i % 64 == 0 else drop).append(np.empty(1000 + i % 97, np.uint8))
    del drop
    assert heap.trim_now()  # there were free pages to give back
    assert len(keep) == 313


def test_the_engine_thread_trims_between_steps():
    engine = Engine(EngineConfig(model="builtin", num_blocks=64, block_size=4))
    engine.add_conversation(prompt_token_ids=list(range(1, 20)), max_new_tokens=30, ignore_eos=True)
    runner = EngineRunner(engine, start_paused=True).start()
    try:
        runner.heap = heap.HeapTrimmer(every_s=0.0)  # after every step, for the test
        for _ in range(5):
            runner.step_once().result(timeout=30)
        assert runner.heap.trims >= (4 if heap.available() else 0)
    finally:
        runner.stop(timeout=10)


def test_an_engine_dropped_in_a_cycle_is_collected_before_the_next_one_is_made():
    """An engine is full of reference cycles, so dropping it frees its weights and KV cache only when the cyclic
    collector next reaches the oldest generation; a process making one engine after another (the window's restart,
    a benchmark's rounds) held every earlier one meanwhile (135M shape: about 2.2 GB each). Making an engine
    collects them first. The collector's own schedule is held off here, so only that collection can free it."""
    import gc
    import weakref
    first = Engine(EngineConfig(model="builtin", num_blocks=32, block_size=4))
    first.add_conversation(prompt_token_ids=[5, 6, 7, 8, 9], max_new_tokens=2)
    first.run_until_idle()
    gone = weakref.ref(first)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del first
        assert gone() is not None  # a cycle keeps it: reference counting alone does not free it
        Engine(EngineConfig(model="builtin", num_blocks=32, block_size=4))
        assert gone() is None
    finally:
        if was_enabled:
            gc.enable()


def _resident_bytes(array: np.ndarray) -> int:
    """Resident bytes of the mappings that hold ``array`` (/proc/self/smaps; the kernel may split one allocation
    into several mappings)."""
    lo_array, hi_array = array.ctypes.data, array.ctypes.data + array.nbytes
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < hi_array and hi > lo_array
            elif inside and head == "Rss:":
                resident += int(line.split()[1]) * 1024
    return resident


def _fresh_mapping(nbytes: int):
    """(a zeroed array of ``nbytes`` in a mapping of its own, never touched; the mapping): np.zeros could be served
    from heap memory earlier tests freed (the engine raises glibc's mmap threshold), which calloc zero-fills."""
    import mmap
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, np.uint8), mapping


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and /proc/self/smaps are Linux's")
def test_the_populator_faults_a_buffer_in_without_changing_a_byte():
    """The host tier's pages are faulted in on a thread of their own, ahead of the offloads that write them, and
    writes made meanwhile are kept (MADV_POPULATE_WRITE maps pages, it never writes them)."""
    flat, mapping = _fresh_mapping(64 << 20)
    array = flat.reshape(64, 1 << 20)
    assert _resident_bytes(array) < 8 << 20
    array[3, :4096] = 7  # a write before the thread starts ...
    populator = heap.Populator(array)
    array[40, 100:200] = 9  # ... and one while it runs
    assert populator.done.wait(60)
    if not populator.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert populator.error == "" and populator.populated == array.nbytes
    assert _resident_bytes(array) >= array.nbytes - (1 << 20)
    assert (array[3, :4096] == 7).all() and (array[40, 100:200] == 9).all()
    assert int(array.sum(dtype=np.int64)) == 7 * 4096 + 9 * 100
    del flat, array
    mapping.close()


def test_the_populator_stops_at_its_limit_and_when_told(monkeypatch):
    """Only the first ``limit`` bytes (the slots a tier hands out first); and stop() ends the thread between chunks,
    as closing the tier does, without waiting for the rest."""
    calls, populators = [], []

    def slow_madvise(address, size, advice):  # from the third chunk on, a chunk lasts until stop() is called
        calls.append(size)
        if populators and len(calls) >= 3:
            populators[-1]._stop.wait(30)
        return 0
    monkeypatch.setattr(heap, "_MADVISE", slow_madvise)
    monkeypatch.setattr(heap, "POPULATE_CHUNK", 1 << 16)
    flat, mapping = _fresh_mapping(16 << 20)
    limited = heap.Populator(flat, limit=1 << 20)
    assert limited.done.wait(30) and limited.populated == 1 << 20 and sum(calls) == 1 << 20
    calls.clear()
    stopped = heap.Populator(flat, start=False)  # 256 chunks unless stopped
    populators.append(stopped)
    stopped.start()
    wait_until(lambda: len(calls) >= 3)  # in its third chunk
    stopped.stop()
    assert stopped.done.is_set() and stopped.populated == 3 << 16 and len(calls) == 3
    del flat
    mapping.close()


def test_closing_an_engine_stops_its_host_tier_populating_and_lets_its_memory_go(monkeypatch):
    """Engine.close() ends the thread mid-way (it does not run on through the whole tier) and the tier's array goes
    with it, not when the engine's cycles are collected some time later."""
    calls, closing = [], threading.Event()

    def slow_madvise(address, size, advice):  # from the third chunk on, a chunk lasts until the engine closes
        calls.append(size)
        if len(calls) >= 3:
            closing.wait(30)
        return 0
    monkeypatch.setattr(heap, "_MADVISE", slow_madvise)
    monkeypatch.setattr(heap, "POPULATE_CHUNK", 1 << 16)
    eng = Engine(EngineConfig(model="builtin", num_blocks=32, block_size=4, host_tier_blocks=4096))
    host = eng.tiers.order[0]
    assert host.name == "host" and host.data.nbytes >= 16 << 20  # hundreds of chunks unless stopped
    wait_until(lambda: len(calls) >= 3)
    real_stop = host.populator.stop
    monkeypatch.setattr(host.populator, "stop", lambda *a, **kw: (host.populator._stop.set(), closing.set(),
                                                                  real_stop(*a, **kw))[-1])
    eng.close()
    assert host.populator.done.is_set() and 0 < host.populator.populated < 16 << 20
    assert host.data.nbytes == 0 and eng.tiers is None


@pytest.mark.parametrize("code, unsupported", [(22, True), (12, False)])  # EINVAL (before Linux 5.14), ENOMEM
def test_a_refused_madvise_stops_the_populator_and_says_why(monkeypatch, code, unsupported):
    """An injected failure of the call: EINVAL means the kernel lacks it (supported False, no error); anything else
    stops populating with its name (the rest of the pages fault in on first write); the bytes are untouched."""
    import ctypes
    calls = []

    def refusing(address, size, advice):
        calls.append(size)
        if len(calls) < 3:
            return 0
        monkeypatch.setattr(ctypes, "get_errno", lambda: code)
        return -1
    monkeypatch.setattr(heap, "_MADVISE", refusing)
    monkeypatch.setattr(heap, "POPULATE_CHUNK", 1 << 16)
    array = np.full(1 << 20, 5, np.uint8)
    populator = heap.Populator(array)
    assert populator.done.wait(10) and len(calls) == 3
    assert populator.supported is not unsupported
    assert populator.error == ("" if unsupported else "ENOMEM")
    assert populator.populated == 2 << 16 and (array == 5).all()


def test_the_disk_tier_is_closed_even_when_the_host_tier_fails_to_close(tmp_path, monkeypatch):
    from engine.kv.tiers import HostTier, TierStore

    def broken(self):
        raise RuntimeError("injected: the host tier failed to close")
    store = TierStore(8, 8, str(tmp_path / "tier.bin"), 64, staging_blocks=2)
    monkeypatch.setattr(HostTier, "close", broken)
    with pytest.raises(RuntimeError, match="injected"):
        store.close()
    assert store.tiers["disk"].fd == -1  # synced and closed all the same

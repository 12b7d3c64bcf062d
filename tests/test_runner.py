"""The engine thread: commands through a queue, snapshots published, failures surfaced, prompt stop."""
import shutil
import tempfile
import time

import pytest

from engine import Engine, EngineConfig, EngineError, EngineRunner
from tests.helpers import holds_for, wait_until, write_tiny_checkpoint


@pytest.fixture()
def runner(tmp_path):
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=64, block_size=4))
    r = EngineRunner(eng).start()
    yield r
    assert r.stop(timeout=1.0)


def engine_thread_done(runner):
    """Wait until the engine thread has finished everything queued before now, publishing included (a command's
    future resolves before the runner publishes what it changed; the next command waits for that publish)."""
    runner.remove_observer(engine_thread_done).result(5)  # an observer it never had: changes nothing


def test_commands_and_snapshots(runner):
    cid = runner.submit("add_conversation", prompt_token_ids=[1, 2, 3, 4, 5], max_new_tokens=8).result(5)
    wait_until(lambda: (c := runner.latest.conversation(cid)) is not None and c.status == "finished")
    assert len(runner.latest.conversation(cid).output_token_ids) == 8
    with pytest.raises(EngineError, match="no conversation"):
        runner.submit("end_conversation", 1234).result(5)
    assert runner.alive


def test_pause_step_and_resume(runner):
    runner.pause().result(5)
    cid = runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=20).result(5)
    step = runner.latest.step_id
    holds_for(lambda: runner.latest.step_id == step, 0.2, what="paused: nothing runs")
    runner.step_once().result(5)
    wait_until(lambda: runner.latest.step_id == step + 1)
    holds_for(lambda: runner.latest.step_id == step + 1, 0.1, what="one step, and no more")
    runner.resume().result(5)
    wait_until(lambda: runner.latest.conversation(cid).status == "finished")


def test_engine_exception_surfaces_and_thread_survives(runner):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")
    original = runner.engine.model.forward
    runner.engine.model.forward = broken
    runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=5).result(5)
    failures = []
    wait_until(lambda: failures.extend(runner.take_failures()) or failures)
    assert "simulated device failure" in failures[0].message and "Traceback" in failures[0].traceback
    assert runner.paused and runner.alive
    runner.engine.model.forward = original
    runner.resume().result(5)
    wait_until(lambda: not any(c.is_live for c in runner.latest.conversations))  # (one caller: not the engine)


def test_stop_is_prompt(tmp_path):
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=256, block_size=4))
    r = EngineRunner(eng).start()
    for _ in range(8):
        r.submit("add_conversation", prompt_token_ids=list(range(1, 60)), max_new_tokens=150)
    wait_until(lambda: r.latest.step_id >= 2)  # decoding: stop comes in the middle of the work
    start = time.perf_counter()
    assert r.stop(timeout=1.0)
    assert time.perf_counter() - start < 1.0


def test_observers_get_every_published_version_and_its_events(tmp_path):
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=64, block_size=4))
    seen = []
    r = EngineRunner(eng, observers=[lambda u: seen.append((u.snapshot, list(u.events)))]).start()
    try:
        cid = r.submit("add_conversation", prompt_token_ids=[1, 2, 3, 4, 5], max_new_tokens=6).result(5)
        wait_until(lambda: seen[-1][0].conversation(cid) is not None
                        and seen[-1][0].conversation(cid).status == "finished")
        versions = [s.version for s, _ in seen]
        assert versions == sorted(set(versions)), "a version was published twice, or out of order"
        steps = [s.step_id for s, _ in seen]
        assert steps[-1] == 6 and set(range(1, 7)) <= set(steps)
        kinds = [e.kind.value for _, events in seen for e in events]
        assert kinds[0] == "conversation_added" and "conversation_finished" in kinds and "allocated" in kinds
        published = len(seen)
        for _ in range(5):  # read-only queries publish nothing
            r.submit("inspect_block", 0).result(5)
            r.submit("conversation", cid).result(5)
            r.submit("tokenize", "x").exception(5)
        engine_thread_done(r)
        assert len(seen) == published and r.latest is seen[-1][0]
    finally:
        assert r.stop()


def test_a_broken_observer_is_reported_and_detached(runner):
    calls = []

    def broken(update):
        calls.append(update.snapshot.version)
        raise OSError("disk full")

    runner.add_observer(broken).result(5)
    runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=4).result(5)
    failures = []
    wait_until(lambda: failures.extend(runner.take_failures()) or failures)
    assert "disk full" in failures[0].message and len(calls) == 1 and runner.alive
    wait_until(lambda: not any(c.is_live for c in runner.latest.conversations))  # (one caller: not the engine)


def test_a_dying_loop_is_reported_and_every_future_resolves(runner, monkeypatch):
    def broken():
        raise RuntimeError("bug in the loop")

    runner.pause().result(5)
    monkeypatch.setattr(runner, "_publish", broken)  # runs after every command, outside the command's own guard
    pending = [runner.submit("conversation", 0) for _ in range(3)]
    failures = []
    wait_until(lambda: failures.extend(runner.take_failures()) or failures)
    assert failures[0].fatal and "bug in the loop" in failures[0].message
    wait_until(lambda: not runner.alive)
    for future in pending:
        assert future.done()
    late = runner.submit("conversation", 0)
    assert late.done() and "stopped" in str(late.exception())
    monkeypatch.undo()


def test_commands_queued_at_stop_fail_clearly(tmp_path):
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=64, block_size=4))
    r = EngineRunner(eng)  # never started: everything stays queued
    futures = [r.submit("add_conversation", prompt_token_ids=[1, 2], max_new_tokens=2) for _ in range(3)]
    assert r.stop()
    assert all("stopped" in str(f.exception(1)) for f in futures)
    assert "stopped" in str(r.submit("pause").exception(1))
    assert not eng.has_work()


def test_a_failing_kv_event_publish_is_reported_and_stepping_goes_on(tmp_path):
    """Publishing KV events happens after an operation commits, on the engine thread: when the publisher raises,
    the step still counts, the failure reaches take_failures() with the publisher's message (not fatal, the runner
    not paused), the engine thread keeps stepping to the end, and publishing works again once the fault is gone."""
    sockdir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # ipc paths must stay short
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=64, block_size=4,
                              kv_events_endpoint=f"ipc://{sockdir}/p"))
    publisher = eng._kv_events.publisher
    real, calls = publisher.publish, []

    def broken(events, ts=None):
        calls.append(len(events))
        raise OSError("the socket went away")

    publisher.publish = broken
    r = EngineRunner(eng).start()
    try:
        cid = r.submit("add_conversation", prompt_token_ids=[1, 2, 3, 4, 5], max_new_tokens=12).result(5)
        wait_until(lambda: r.latest.conversation(cid).status == "finished")
        failures = []
        wait_until(lambda: failures.extend(r.take_failures()) or len(failures) >= len(calls) > 1)
        assert all("publishing KV events failed" in f.message and "the socket went away" in f.message
                   and not f.fatal for f in failures)
        assert len(failures) == len(calls)  # one report per step whose batch was lost, none dropped
        assert r.alive and not r.paused and r.latest.step_id == 12
        assert len(r.latest.conversation(cid).output_token_ids) == 12
        publisher.publish = real
        sent = publisher.next_seq
        r.submit("add_conversation", prompt_token_ids=[9, 8, 7, 6, 5], max_new_tokens=4).result(5)
        wait_until(lambda: not any(c.is_live for c in r.latest.conversations) and publisher.next_seq > sent)
        assert r.take_failures() == []
    finally:
        assert r.stop()
        eng.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_observers_get_one_update_with_the_engines_change_record(tmp_path):
    """The runner hands each observer one PoolUpdate: the snapshot, its events and the engine's record of what
    changed since the snapshot before (the pool-stream encoder's fast path), handed beside the snapshot and never
    written onto it (it is frozen)."""
    from kvstream.views import PoolUpdate
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=64, block_size=4))
    seen = []
    r = EngineRunner(eng, observers=[seen.append]).start()
    try:
        cid = r.submit("add_conversation", prompt_token_ids=[1, 2, 3, 4, 5], max_new_tokens=6).result(5)
        wait_until(lambda: seen[-1].snapshot.conversation(cid).status == "finished")
    finally:
        assert r.stop()
    assert all(isinstance(u, PoolUpdate) for u in seen)
    recorded = [(before, u) for before, u in zip(seen, seen[1:]) if u.changes.block_masks is not None]
    assert len(recorded) >= 5
    for before, u in recorded:
        assert u.changes.base is before.snapshot  # the masks compare against the update before
        assert not {"_changed_blocks", "_output_prefixes"} & set(vars(u.snapshot))
    assert any(u.changes.output_prefixes for u in seen)

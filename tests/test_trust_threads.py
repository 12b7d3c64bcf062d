"""Issue 48, streams and threads: the engine's KV events can be kept to key holders, the runner's single step means
one step (after it ran, under the speed limit, never saved up), and every public method of an Engine keeps to one
caller at a time.

The faults are put in place: a step held open on the engine thread while a second thread calls every method; steps
asked for with nothing to do; a watcher without keys.
"""
from __future__ import annotations

import inspect
import logging
import threading
import time

import pytest

from engine import Engine, EngineConfig, EngineError
from engine.engine import ANY_THREAD
from engine.runner import EngineRunner
from kvstream.curve import make_keys
from kvstream.kv_events import KVEventSubscriber
from kvstream.views import Status
from tests.helpers import wait_until, write_tiny_checkpoint

WAIT_S = 30.0  # the longest any wait below may take (a bound, not a timing: each waits on its event)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("threads")))


class HeldStep:
    """An engine thread stopped inside a step (in the model's forward) until released."""

    def __init__(self, eng: Engine, monkeypatch):
        self.inside, self.release = threading.Event(), threading.Event()
        real = eng.runner.forward

        def forward(prepared):
            self.inside.set()
            assert self.release.wait(WAIT_S), "the held step was never released"
            return real(prepared)
        monkeypatch.setattr(eng.runner, "forward", forward)
        self.failure: list[BaseException] = []

        def run():
            try:
                eng.step()
            except BaseException as exc:  # noqa: BLE001 - read by the test
                self.failure.append(exc)
        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.inside.wait(WAIT_S)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive() and not self.failure, self.failure


def _calls(eng: Engine, cid: int, done: int, snap) -> dict:
    """One call of every public method that must keep to the one caller: name -> (args, kwargs)."""
    return {
        "changed": ((), {}), "on_rollback": ((lambda: None,), {}),
        "add_conversation": ((), {"prompt_token_ids": [1, 2, 3]}),
        "add_samples": ((), {"prompt_token_ids": [1, 2, 3], "n": 2}),
        "fork_conversation": ((cid,), {}), "end_conversation": ((cid,), {}),
        "continue_conversation": ((done,), {"prompt_token_ids": [4]}),
        "conversation": ((cid,), {}), "conversations": ((), {}), "has_work": ((), {}),
        "run_until_idle": ((), {}), "generate": (([[1, 2]],), {}), "step": ((), {}), "step_unprotected": ((), {}),
        "reset_prefix_cache": ((), {}), "relocate_blocks": ((), {"seed": 1}), "relocate_and_verify": ((), {}),
        "probe_attention": ((), {}), "snapshot": ((), {}), "change_record": ((snap,), {}), "metrics": ((), {}),
        "memory_stats": ((), {}), "inspect_block": ((0,), {}), "take_events": ((), {}),
        "check_invariants": ((), {}), "take_background_errors": ((), {}), "close": ((), {}),
        "prompt_token_sources": ((cid,), {}), "add_prefill": ((), {"prompt_token_ids": [1, 2, 3]}),
        "is_finished": ((cid,), {}), "prompt_block_outcomes": ((cid,), {}),
        "check_prompt": ((), {"prompt_token_ids": [3, 5, 7, 11]}),
    }


def test_every_public_method_refuses_a_second_thread_during_a_step(ckpt, tmp_path, monkeypatch):
    eng = Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=48, host_tier_blocks=8, disk_tier_blocks=8,
                              disk_tier_path=str(tmp_path / "tier.bin")))
    done = eng.add_conversation(prompt_token_ids=[9, 8, 7, 6, 5], max_new_tokens=2)
    eng.run_until_idle()
    cid = eng.add_conversation(prompt_token_ids=[3, 5, 7, 11, 13], max_new_tokens=6)
    eng.step()
    snap = eng.snapshot()
    calls = _calls(eng, cid, done, snap)
    public = {n for n, m in vars(Engine).items() if not n.startswith("_") and inspect.isfunction(m)}
    assert public - ANY_THREAD == set(calls), "a public method without a one-caller check here"
    pending = len(eng.manager.events)  # events the runner has not taken yet
    held = HeldStep(eng, monkeypatch)
    try:
        for name, (args, kwargs) in calls.items():
            with pytest.raises(EngineError, match="in use by another thread"):
                getattr(eng, name)(*args, **kwargs)
        assert isinstance(eng.token_text(5), str) and isinstance(eng.detokenize([5, 6]), str)  # any thread may
    finally:
        held.finish()
    assert eng.tiers is not None and eng.snapshot().tiers  # close() did not pull the tiers out of the step
    events = eng.take_events()
    assert len(events) >= pending and events[0].step_id <= snap.step_id  # nobody took them meanwhile
    assert eng.snapshot().step_id == snap.step_id + 1
    assert {c.conversation_id for c in eng.conversations()} == {done, cid}  # no conversation was added
    eng.check_invariants()
    eng.run_until_idle()
    assert eng.conversation(cid).status == Status.FINISHED


def test_close_from_a_second_thread_during_a_step_is_a_clear_error(ckpt, tmp_path, monkeypatch):
    """The reported case: AttributeError ('NoneType' object has no attribute 'offload') from the step."""
    eng = Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=16, host_tier_blocks=8))
    ids = [eng.add_conversation(prompt_token_ids=[k + 1] * 9, max_new_tokens=4) for k in range(3)]
    eng.step()
    held = HeldStep(eng, monkeypatch)
    try:
        with pytest.raises(EngineError, match="in use by another thread"):
            eng.close()
    finally:
        held.finish()
    eng.run_until_idle()
    assert all(eng.conversation(c).status == Status.FINISHED for c in ids)
    eng.close()  # and from the one caller, afterwards
    assert eng.tiers is None


# ---- the runner's single step -------------------------------------------------------------------------------------
def _runner(ckpt, **kw) -> tuple[EngineRunner, Engine]:
    eng = Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=48))
    return EngineRunner(eng, start_paused=True, **kw).start(), eng


def test_a_single_step_resolves_after_its_step_has_run(ckpt, monkeypatch):
    runner, eng = _runner(ckpt)
    try:
        runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=4).result(WAIT_S)
        before = runner.latest.step_id
        entered, release = threading.Event(), threading.Event()
        real = eng.runner.forward

        def forward(prepared):
            entered.set()
            assert release.wait(WAIT_S)
            return real(prepared)
        monkeypatch.setattr(eng.runner, "forward", forward)
        future = runner.step_once()
        assert entered.wait(WAIT_S)
        assert not future.done(), "the single step's future resolved before its step ran"
        release.set()
        assert future.result(WAIT_S) is True
        assert runner.latest.step_id == before + 1  # and its snapshot is published
    finally:
        release.set()
        runner.stop(WAIT_S)


def test_a_single_step_with_nothing_to_do_does_nothing_and_is_not_saved_up(ckpt):
    runner, eng = _runner(ckpt)
    try:
        idle = [runner.step_once() for _ in range(3)]
        assert [f.result(WAIT_S) for f in idle] == [False, False, False]
        cid = runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=6).result(WAIT_S)
        assert runner.step_once().result(WAIT_S) is True
        assert runner.submit("conversation", cid).result(WAIT_S).num_computed_tokens == 3  # one step: the prompt
        steps = runner.latest.step_id
    finally:
        runner.stop(WAIT_S)
    assert eng.step_id == steps  # nothing ran after it: the three idle requests were not kept for later


def test_single_steps_keep_to_the_speed_limit(ckpt, monkeypatch):
    """Time is the subject here: steps asked for one after another run at most at the rate the user set."""
    rate = 4.0
    runner, eng = _runner(ckpt, max_steps_per_second=rate)
    stamps: list[float] = []
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda prepared: (stamps.append(time.perf_counter()),
                                                                 real(prepared))[1])
    try:
        runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=8).result(WAIT_S)
        futures = [runner.step_once() for _ in range(3)]
        assert [f.result(WAIT_S) for f in futures] == [True, True, True]
    finally:
        runner.stop(WAIT_S)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) == 3 and min(gaps) >= 0.9 / rate, gaps


def test_a_failed_single_step_hands_its_error_to_the_future(ckpt, monkeypatch):
    runner, eng = _runner(ckpt)
    try:
        runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=4).result(WAIT_S)

        def boom(prepared):
            raise RuntimeError("injected fault in the forward")
        monkeypatch.setattr(eng.runner, "forward", boom)
        with pytest.raises(RuntimeError, match="injected"):
            runner.step_once().result(WAIT_S)
        assert runner.latest.step_id == 0 and runner.paused
    finally:
        runner.stop(WAIT_S)


# ---- the engine's KV events ---------------------------------------------------------------------------------------
def test_kv_events_with_curve_reach_only_key_holders(ckpt, tmp_path):
    keys = make_keys(tmp_path / "curve")
    stranger = tmp_path / "stranger"  # a key pair the engine never authorized, with the right server key
    make_keys(stranger)
    (stranger / "server.key").write_bytes((tmp_path / "curve" / "server.key").read_bytes())
    eng = Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=48, kv_events_endpoint="tcp://*:0",
                              kv_events_replay_endpoint="tcp://*:0", kv_events_curve=keys["directory"]))
    try:
        port, replay = (e.rsplit(":", 1)[1] for e in eng.kv_events_endpoints)
        spec = f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay}"
        with KVEventSubscriber([f"{spec},curve={keys['directory']}", spec, f"{spec},curve={stranger}"]) as sub:
            for k in range(3):
                eng.add_conversation(prompt_token_ids=[k + 1] * 12, max_new_tokens=2)
            eng.run_until_idle()
            allowed, plain, unknown = sub.indexes
            wait_until(lambda: len(allowed.live_hashes()) > 0, WAIT_S, seen=sub.status)
            stored = len(allowed.live_hashes())
            eng.add_conversation(prompt_token_ids=[7] * 12, max_new_tokens=2)  # more, once the others had time
            eng.run_until_idle()
            wait_until(lambda: len(allowed.live_hashes()) > stored, WAIT_S)
            for other in (plain, unknown):
                assert other.num_batches == 0 and len(other.live_hashes()) == 0
            assert [s.connected for s in sub.status()[1:]] == [False, False]  # the handshake never completed
    finally:
        eng.close()


def test_kv_events_bound_beyond_loopback_without_curve_warn_once(ckpt, tmp_path, caplog):
    keys = make_keys(tmp_path / "curve")
    with caplog.at_level(logging.WARNING, logger="kvstream.curve"):
        for endpoint, curve in (("tcp://127.0.0.1:0", None), ("tcp://*:0", keys["directory"])):
            Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=16, kv_events_endpoint=endpoint,
                                kv_events_curve=curve)).close()
        assert "anyone who can reach" not in caplog.text  # loopback (connected), or CURVE
        for _ in range(2):
            Engine(EngineConfig(model=ckpt, block_size=4, num_blocks=16, kv_events_endpoint="tcp://*:0")).close()
    assert caplog.text.count("publishing KV events on") == 1
    assert "anyone who can reach this port can read every conversation's tokens" in caplog.text
    assert "vLLM's own KV-event consumers cannot speak CURVE" in caplog.text


def test_the_command_line_takes_curve_for_kv_events(tmp_path):
    from explorer.cli import UsageError, parse_args
    keys = make_keys(tmp_path / "curve")
    opts = parse_args(["--headless", "--kv-events", f"tcp://*:5557,replay=tcp://*:5558,curve={keys['directory']}"])
    assert (opts.kv_events, opts.kv_events_replay, opts.kv_events_curve) == \
        ("tcp://*:5557", "tcp://*:5558", keys["directory"])
    with pytest.raises(UsageError, match="does not exist"):
        parse_args(["--headless", "--kv-events", f"tcp://*:5557,curve={tmp_path / 'missing'}"])
    opts = parse_args(["--headless", "--attach-kv-events", f"tcp://127.0.0.1:5557,curve={keys['directory']}"])
    assert opts.attach_kv_events
    with pytest.raises(UsageError, match="--attach-kv-events: .*does not exist"):
        parse_args(["--headless", "--attach-kv-events", f"tcp://127.0.0.1:5557,curve={tmp_path / 'missing'}"])

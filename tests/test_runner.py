"""The engine thread: commands through a queue, snapshots published, failures surfaced, prompt stop."""
import time

import pytest

from engine import Engine, EngineConfig, EngineError, EngineRunner
from tests.helpers import write_tiny_checkpoint


@pytest.fixture()
def runner(tmp_path):
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=64, block_size=4))
    r = EngineRunner(eng).start()
    yield r
    assert r.stop(timeout=1.0)


def wait_for(pred, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_commands_and_snapshots(runner):
    cid = runner.submit("add_conversation", prompt_token_ids=[1, 2, 3, 4, 5], max_new_tokens=8).result(5)
    assert wait_for(lambda: (c := runner.latest.conversation(cid)) is not None and c.status == "finished")
    assert len(runner.latest.conversation(cid).output_token_ids) == 8
    with pytest.raises(EngineError, match="no conversation"):
        runner.submit("end_conversation", 1234).result(5)
    assert runner.alive


def test_pause_step_and_resume(runner):
    runner.pause().result(5)
    cid = runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=20).result(5)
    step = runner.latest.step_id
    time.sleep(0.2)
    assert runner.latest.step_id == step  # paused: nothing runs
    runner.step_once().result(5)
    assert wait_for(lambda: runner.latest.step_id == step + 1)
    time.sleep(0.1)
    assert runner.latest.step_id == step + 1
    runner.resume().result(5)
    assert wait_for(lambda: runner.latest.conversation(cid).status == "finished")


def test_engine_exception_surfaces_and_thread_survives(runner):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")
    original = runner.engine.model.forward
    runner.engine.model.forward = broken
    runner.submit("add_conversation", prompt_token_ids=[1, 2, 3], max_new_tokens=5).result(5)
    failures = []
    assert wait_for(lambda: failures.extend(runner.take_failures()) or failures)
    assert "simulated device failure" in failures[0].message and "Traceback" in failures[0].traceback
    assert runner.paused and runner.alive
    runner.engine.model.forward = original
    runner.resume().result(5)
    assert wait_for(lambda: not runner.engine.has_work())


def test_stop_is_prompt(tmp_path):
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "m")), num_blocks=256, block_size=4))
    r = EngineRunner(eng).start()
    for _ in range(8):
        r.submit("add_conversation", prompt_token_ids=list(range(1, 60)), max_new_tokens=150)
    time.sleep(0.2)
    start = time.perf_counter()
    assert r.stop(timeout=1.0)
    assert time.perf_counter() - start < 1.0

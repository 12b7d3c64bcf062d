"""The local engine feed without a window: outputs closed only once the engine thread ended, File > Record joining
a running engine without losing a frame, and the tokenizer called directly through one object (real engine)."""
import threading

import pytest

from engine import Engine, EngineConfig
from explorer.feeds import engine_feed
from explorer.feeds.engine_feed import EngineFeed
from kvstream.recording import Recorder, open_recording, read_frames


def small_engine(prompt="Outputs close once the engine thread has ended.", tokens=40):
    cfg = EngineConfig(model="builtin", num_blocks=64, block_size=4)
    engine = Engine(cfg)
    engine.add_conversation(prompt, max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    return engine, cfg


class Gate:
    """A sink that holds the frame's write until released (a slow disk, a stuck socket)."""

    def __init__(self):
        self.armed = False
        self.entered, self.release = threading.Event(), threading.Event()
        self.thread = None  # the thread that wrote

    def write(self, frame) -> None:
        self.thread = threading.current_thread()
        if self.armed:
            self.entered.set()
            self.release.wait(10)


def test_outputs_are_closed_only_after_the_frames_handed_over_are_written(tmp_path, monkeypatch):
    """Frames are encoded and written on the fanout's own thread, not the engine's: a sink stuck in a write holds
    neither the engine thread nor the close (0.2 s here), and the recorder is closed later, once the frame being
    written when the window closed is in the file (it used to go to a closed recorder and be lost)."""
    monkeypatch.setattr(engine_feed, "STOP_TIMEOUT_S", 0.2)
    engine, cfg = small_engine()
    gate, recorder = Gate(), Recorder(tmp_path / "late.kvrec")
    feed = EngineFeed.start(engine, cfg, start_paused=True, extra_sinks=[gate, recorder], history_bytes=None)
    gate.armed = True
    feed.runner.step_once()
    assert gate.entered.wait(10)  # the fanout's thread is inside the step's frame, before the recorder's write
    assert gate.thread is not feed.runner._thread and gate.thread.name == "pool-stream encoder"
    for _ in range(100):  # the runner publishes the step's snapshot as its frame goes to the fanout
        if feed.runner.latest.step_id == 1:
            break
        threading.Event().wait(0.02)
    step = feed.runner.latest.step_id
    feed.close()  # gives up waiting after 0.2 s; the recorder must stay open for that frame
    assert not feed.runner.alive and not recorder.closed  # the engine thread was not held by the stuck sink
    gate.release.set()
    for _ in range(100):
        if recorder.closed:
            break
        threading.Event().wait(0.05)
    assert recorder.closed
    frames = list(read_frames(recorder.path))
    assert frames[-1].step_id == step == 1 and len(frames) == recorder.frames_written == 2
    assert open_recording(recorder.path).latest().step_id == step


def test_recording_joins_a_running_engine_without_missing_a_frame(tmp_path):
    """File > Record while a step is running: the frame that step publishes before the runner takes the new
    observer is not lost; the file starts with the newest state and then holds every frame with its events."""
    engine, cfg = small_engine()
    feed = EngineFeed.start(engine, cfg, start_paused=True)
    inside, go = threading.Event(), threading.Event()
    step = engine.step

    def late_step():  # the real step, entered before File > Record and finished after it
        inside.set()
        go.wait(10)
        return step()

    engine.step = late_step
    try:
        feed.runner.step_once()
        assert inside.wait(10)
        recorder = Recorder(tmp_path / "joined.kvrec")
        feed.start_recording(recorder)  # the GUI thread, while the engine thread is in its step
        go.set()
        for _ in range(4):
            feed.runner.step_once()
        while feed.runner.latest.step_id < 5:
            threading.Event().wait(0.02)
        _, closed = feed.stop_recording()
        assert closed.result(timeout=10) is recorder and recorder.closed
    finally:
        feed.close()
    recorded = [(f.step_id, f.events) for f in read_frames(recorder.path)]
    history = feed.history
    kept = [history.frame_info(seq) for seq in history.seqs()]
    first = next(i for i, (step_id, _) in enumerate(kept) if step_id == recorded[0][0])
    assert recorded[0][0] == 1  # the state the late step made, not the one before it
    assert [s for s, _ in recorded] == [s for s, _ in kept[first:first + len(recorded)]] == [1, 2, 3, 4, 5]
    assert [e for _, e in recorded[1:]] == [e for _, e in kept[first + 1:first + len(recorded)]]


class StallingRecorder(Recorder):
    """A recorder whose writes wait, once armed, until released (a stalled disk)."""

    armed = False
    release = None

    def write(self, frame) -> None:
        if self.armed:
            self.release.wait(10)
        super().write(frame)


def test_stopping_a_recording_on_a_stalled_disk_does_not_hold_the_engine(tmp_path):
    """File > Stop recording while the recorder's writes are stuck: the recorder is closed once its frames are
    written, and meanwhile the engine thread steps on (its close had waited on the engine thread)."""
    engine, cfg = small_engine(tokens=60)
    feed = EngineFeed.start(engine, cfg, start_paused=True, history_bytes=None)
    try:
        recorder = StallingRecorder(tmp_path / "stalled.kvrec")
        recorder.release = threading.Event()
        feed.start_recording(recorder)
        feed.runner.step_once()
        while recorder.frames_written < 2:
            threading.Event().wait(0.02)
        recorder.armed = True
        for _ in range(3):
            feed.runner.step_once()  # frames wait in the recorder's write
        while feed.runner.latest.step_id < 4:
            threading.Event().wait(0.02)
        _, closed = feed.stop_recording()
        before = feed.runner.latest.step_id
        feed.runner.step_once()  # the engine thread is free: it steps while the recording is still closing
        for _ in range(250):
            if feed.runner.latest.step_id > before:
                break
            threading.Event().wait(0.02)
        assert feed.runner.latest.step_id == before + 1 and not closed.done()
        recorder.release.set()
        assert closed.result(timeout=10) is recorder and recorder.closed
        assert [f.step_id for f in read_frames(recorder.path)] == list(range(recorder.frames_written))
        assert recorder.frames_written == before + 1  # every frame up to the stop, none after it
    finally:
        feed.close()


def test_the_tokenizer_is_called_directly_through_one_object():
    engine, cfg = small_engine()
    feed = EngineFeed.start(engine, cfg, start_paused=True, history_bytes=None)
    try:
        sent = []
        submit = feed.runner.submit
        feed.runner.submit = lambda name, *a, **k: sent.append(name) or submit(name, *a, **k)
        assert feed.takes_text is engine.takes_text is True
        ids = feed.tokenize("paged", continuation=True).result(timeout=0)  # done at once: no queue, no step
        assert ids == engine.tokenize("paged", True) and feed.detokenizer(ids) == "paged"
        assert feed.token_text(ids[0]) == engine.token_text(ids[0])
        with pytest.raises(ValueError):
            feed.tokenize("").result(timeout=0)  # the engine's refusal, through the Future
        assert feed.detokenizer([10 ** 9]) == str(10 ** 9)  # an id outside the vocabulary reads as the id
        assert sent == []
    finally:
        feed.close()


def test_the_title_names_a_checkpoint_by_its_folder_not_its_whole_path():
    """Issue 49: the window demo's title showed the full cache path of its checkpoint."""
    from explorer.feeds.engine_feed import model_name
    assert model_name("/root/.cache/paged-kv-explorer/models/window-mixed") == "window-mixed"
    assert model_name("/data/ckpt/") == "ckpt" and model_name("/m/llama.gguf") == "llama.gguf"
    assert model_name("builtin") == "builtin" and model_name("smollm2") == "smollm2"
    from types import SimpleNamespace
    from engine import EngineConfig
    from explorer.feeds.engine_feed import EngineFeed
    cfg = EngineConfig(model="builtin", num_blocks=8, block_size=4)
    title = EngineFeed.title.fget(SimpleNamespace(config=SimpleNamespace(
        model="/root/.cache/x/window-mixed", num_blocks=cfg.num_blocks, block_size=cfg.block_size, device="cpu")))
    assert title == "local engine: window-mixed, 8 blocks × 4 slots, cpu"

"""Issue 33: the pool stream names its tokenizer, and a viewer decodes token text with it. Watching the project's own
engine through --attach or a recording showed token ids ('<81>') where the byte tokenizer is known to every copy
of this program; --tokenizer resources/builtin was refused ('has no tokenizer.json')."""
import random

import msgspec
import pytest

from engine import Engine, EngineConfig
from kvstream.poolstream import StreamDecoder, StreamEncoder
from kvstream.recording import Recorder
from kvstream.tokens import ByteTokens, piece_text
from tests.helpers import wait_until


def builtin_engine():
    engine = Engine(EngineConfig(model="builtin", num_blocks=32, block_size=4))
    engine.add_conversation("Hello, pages.", max_new_tokens=8)
    for _ in range(3):
        engine.step()
    return engine


def test_the_engines_snapshot_and_the_stream_name_the_tokenizer():
    engine = builtin_engine()
    snap = engine.snapshot()
    assert snap.tokenizer == "builtin"
    frame = StreamEncoder().encode(snap)
    got, _, _ = StreamDecoder().feed(frame.payload)
    assert got.tokenizer == "builtin"


def test_a_stream_without_the_field_still_reads_with_no_tokenizer_named():
    """An older writer's header has no 'tokenizer' key: its messages read as before, naming none."""
    snap = builtin_engine().snapshot()
    payload = StreamEncoder().encode(snap).payload
    message = msgspec.msgpack.decode(payload)
    body = next(part for part in message if isinstance(part, dict) and "header" in part)
    assert body["header"].pop("tokenizer") == "builtin"
    older = msgspec.msgpack.encode(message)
    got, _, _ = StreamDecoder().feed(older)
    assert got.tokenizer == "" and got.model_name == "builtin" and got.num_blocks == 32


def test_a_reader_that_does_not_know_the_field_skips_it():
    """The header is a map: a format-2 reader from before the field ignores the key it does not know."""
    from kvstream.poolstream.schema import Header

    class OlderHeader(msgspec.Struct, frozen=True):
        source: str
        num_blocks: int
        block_size: int
        model_name: str
        device: str
        max_model_len: int
        dtypes: dict[str, str]
    new = Header("engine", 4, 2, "builtin", "cpu", 0, {}, tokenizer="builtin")
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OlderHeader)
    assert old.model_name == "builtin" and old.num_blocks == 4


def test_a_recording_of_the_builtin_engine_shows_token_text_without_tokenizer_flag(tmp_path):
    from explorer.feeds.snapshot_block import block_info_from_snapshot
    from explorer.feeds.stream_feed import RecordingFeed
    engine = builtin_engine()
    path = tmp_path / "builtin.kvpool"
    encoder = StreamEncoder()
    with Recorder(path) as recorder:
        recorder.write(encoder.encode(engine.snapshot()))
    feed = RecordingFeed.open(str(path))
    try:
        assert feed.token_text(ord("H")) == "H" and feed.token_text(256) == "<bos>"
        view = feed.latest()
        (cid, table), = view.block_tables.items()
        info = block_info_from_snapshot(view, table[0], feed.history, None, feed.token_text)
        assert "".join(info.token_texts) == "<bos>Hel"  # not '<72>'
    finally:
        feed.close()


@pytest.mark.parametrize("spec", ["builtin", "resources/builtin"])
def test_tokenizer_flag_takes_the_builtin_tokenizer(spec, tmp_path):
    from explorer.cli import parse_args
    from explorer.feeds.stream_feed import RecordingFeed, load_tokenizer
    path = tmp_path / "r.kvpool"
    with Recorder(path) as recorder:
        recorder.write(StreamEncoder().encode(builtin_engine().snapshot()))
    opts = parse_args(["--open", str(path), "--tokenizer", spec])
    feed = RecordingFeed.open(str(path), load_tokenizer(opts.tokenizer))
    try:
        assert feed.token_text(ord("e")) == "e"
    finally:
        feed.close()


def test_byte_tokens_read_as_the_engines_byte_tokenizer():
    from engine.model.tokenizer import ByteTokenizer
    tokens, engine = ByteTokens(), ByteTokenizer()
    for i in list(range(32, 127)) + list(range(128, 258)):
        assert piece_text(tokens, i) == engine.token_text(i), i
    assert piece_text(tokens, 10) == "\n" and piece_text(tokens, 999) is None
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(258) for _ in range(rng.randrange(1, 12))]
        assert tokens.decode(ids) == engine.decode(ids)


def test_attaching_to_the_builtin_engine_shows_token_text(tmp_path):
    """--attach of the project's own engine: the stream names 'builtin', so the viewer has text, not '<72>'."""
    from explorer.feeds.stream_feed import AttachFeed
    from kvstream.poolstream.publisher import PoolStreamPublisher
    engine = builtin_engine()
    endpoint = f"ipc://{tmp_path}/pool"
    encoder = StreamEncoder()
    with PoolStreamPublisher(endpoint, heartbeat_seconds=0.2) as publisher:
        feed = AttachFeed.connect(endpoint)
        try:

            def publish_a_step():  # until the attached feed has a frame (the first ones go out before it listens)
                publisher.write(encoder.encode(engine.snapshot()))
                engine.step()
            wait_until(lambda: feed.latest() is not None, serve=publish_a_step)
            assert feed.latest().tokenizer == "builtin"
            assert feed.token_text(ord("H")) == "H" and feed.token_text(257) == "<eos>"
        finally:
            feed.close()



def test_a_name_that_leads_nowhere_here_keeps_ids():
    """A model not fetched here, a .gguf path (never converted by a viewer), an unknown name: no text, no error.
    (A fetched model's own tokenizer: tests/test_real_model.py.)"""
    from explorer.feeds.stream_feed import NamedTokenText, named_tokenizer
    from types import SimpleNamespace
    assert named_tokenizer("no-such-model") is None and named_tokenizer("/no/such/model.gguf") is None
    assert named_tokenizer("smollm2") is None  # the tests' own cache is empty
    text = NamedTokenText()
    text.follow(SimpleNamespace(tokenizer="no-such-model"))
    assert text(65) is None and text.name == "no-such-model"

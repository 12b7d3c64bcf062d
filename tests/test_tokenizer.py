"""Tokenizers: the byte-level one never raises on partial UTF-8; a checkpoint's tokenizer.json is used for text."""
import json

from hypothesis import given, strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine import Engine, EngineConfig
from engine.model.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from tests.helpers import write_tiny_checkpoint


@given(st.lists(st.integers(0, 257), max_size=40))
def test_byte_decode_never_raises(ids):
    tok = ByteTokenizer()
    for final in (True, False):
        assert isinstance(tok.decode(ids, final=final), str)
    assert all(isinstance(tok.token_text(i), str) for i in ids)


def test_streaming_holds_back_partial_character():
    tok = ByteTokenizer()
    ids = tok.encode("né", add_special_tokens=False)  # 'é' is two bytes
    assert tok.decode(ids[:-1], final=False) == "n"  # half a character is not shown yet
    assert tok.decode(ids[:-1], final=True) == "n\ufffd"
    assert tok.decode(ids, final=False) == "né"
    assert tok.encode("a") == [BOS_ID, 97]
    assert tok.decode([BOS_ID, 104, 105, EOS_ID]) == "hi"


def test_checkpoint_tokenizer_json_is_used(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", vocab_size=97)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the block table maps logical blocks to physical blocks"] * 3,
                            trainers.WordLevelTrainer(vocab_size=97, special_tokens=["[UNK]"]))
    tok.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [95, 96]}))
    eng = Engine(EngineConfig(model=str(path), num_blocks=32, block_size=4))
    assert eng.eos_token_ids == (95, 96)
    cid = eng.add_conversation(prompt="the block table", max_new_tokens=4)
    info = eng.conversation(cid)
    assert list(info.prompt_token_ids) == tok.encode("the block table").ids
    assert info.prompt_text == "the block table"
    eng.run_until_idle()
    out = eng.conversation(cid)
    assert out.output_text == tok.decode(list(out.output_token_ids), skip_special_tokens=True)

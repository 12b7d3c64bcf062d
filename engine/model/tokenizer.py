"""Tokenizers: the built-in byte-level one, and Hugging Face ``tokenizer.json`` files through ``tokenizers``.

Both turn token ids back into text without ever raising: bytes that do not (yet) form valid UTF-8 are held back
while a conversation is still streaming, and replaced by U+FFFD once it has finished.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvstream.tokens import piece_text

from ..errors import EngineError

BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257


def _incomplete_utf8_tail(data: bytes) -> int:
    """Number of trailing bytes that start a UTF-8 sequence which is not complete yet (0..3)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


class ByteTokenizer:
    """Token id = byte value (0..255), plus BOS (256) and EOS (257). Vocabulary size 258."""

    vocab_size = BYTE_VOCAB + 2
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    chat_template = None  # a byte model trained on documentation: plain text, no chat turns

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID] + ids if add_special_tokens else ids

    def decode(self, ids: Sequence[int], *, final: bool = True) -> str:
        """Text of ``ids`` (special tokens skipped). With ``final=False`` an incomplete UTF-8 tail is held back."""
        try:  # plain bytes at C speed (a decoding conversation's text is rebuilt every step); only lists and
            # tuples: bytes() of an array would read its raw memory
            data = bytes(ids) if isinstance(ids, (list, tuple)) else None
        except (ValueError, TypeError):  # BOS, EOS (anything outside 0..255): skipped below
            data = None
        if data is None:
            data = bytes(int(i) for i in ids if 0 <= i < BYTE_VOCAB)
        if not final:
            cut = _incomplete_utf8_tail(data)
            if cut:
                data = data[:-cut]
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        if token_id == BOS_ID:
            return "<bos>"
        if token_id == EOS_ID:
            return "<eos>"
        if 0x20 <= token_id < 0x7F:
            return chr(token_id)
        return {0x0A: "\\n", 0x09: "\\t", 0x0D: "\\r"}.get(token_id, f"<0x{token_id:02X}>")


class HFTokenizer:
    """A ``tokenizer.json`` file loaded with the ``tokenizers`` package, used with its own defaults."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # a corrupt file is a user error, not a crash
            raise EngineError(f"cannot read tokenizer {path}: {exc}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = _chat_template(path.parent / "tokenizer_config.json")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, final: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more tokens
            text = text.rstrip("\ufffd")
        return text

    def token_text(self, token_id: int) -> str:
        text = piece_text(self._tok, token_id)
        return text if text is not None else f"<{token_id}>"


def _chat_template(path: Path):
    """The chat template that ``tokenizer_config.json`` beside a ``tokenizer.json`` declares (None without one).
    A checkpoint whose template cannot be read still loads, as it did before templates were used: its text prompts
    and replies stay plain."""
    if not path.is_file():
        return None
    import json

    from .chat import ChatTemplate
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if not isinstance(template, str) or not template:
        return None  # none, or several named ones (a list): text prompts stay plain

    def token(name):
        value = config.get(name)
        return value.get("content", "") if isinstance(value, dict) else value if isinstance(value, str) else ""
    try:
        return ChatTemplate(template, bos_token=token("bos_token"), eos_token=token("eos_token"))
    except EngineError:
        return None


class NoTokenizer:
    """For checkpoints without ``tokenizer.json``: token ids only."""

    takes_text = False  # prompts must be token ids
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise EngineError("this checkpoint has no tokenizer.json, so it takes token ids (prompt_token_ids), not text")

    def decode(self, ids: Sequence[int], *, final: bool = True) -> str:
        return "".join(f"{i} " for i in ids)  # a trailing space keeps prompt and output apart when shown together

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

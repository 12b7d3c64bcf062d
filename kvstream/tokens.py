"""How one token reads, the same everywhere: the live engine's inspector, a recording, an attached pool.

Duck-typed over a ``tokenizers.Tokenizer`` (``decode`` and ``id_to_token``), so this package needs no tokenizer
library itself.
"""
from __future__ import annotations


def piece_text(tokenizer, token_id: int) -> str | None:
    """The token's decoded text when it decodes to whole characters; else its vocabulary piece (a byte-level BPE
    token that is part of a multi-byte character); None when the tokenizer does not know the id."""
    try:
        text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
    except Exception:  # an id outside this tokenizer's vocabulary
        return None
    if text and "\ufffd" not in text:
        return text
    return tokenizer.id_to_token(int(token_id)) or text or None


class ByteTokens:
    """The built-in model's byte tokenizer as a reader of its streams needs it, with the two methods of a
    ``tokenizers.Tokenizer`` that :func:`piece_text` and the content view call: token id = byte value (0..255),
    256 BOS, 257 EOS. A viewer has it without the engine (which keeps the same rule in
    ``engine.model.tokenizer.ByteTokenizer``; a test holds the two to the same text for every id)."""

    vocab_size = 258
    _SPECIAL = {256: "<bos>", 257: "<eos>"}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"token id outside the byte vocabulary (0..{self.vocab_size - 1})")
        text = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        if skip_special_tokens or not any(i >= 256 for i in ids):
            return text
        return "".join(self._SPECIAL[i] if i >= 256 else bytes([i]).decode("utf-8", errors="replace") for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a plain list: callers take ``.ids`` of a tokenizers Encoding where there is one)."""
        ids = list(text.encode("utf-8"))
        return [256] + ids if add_special_tokens else ids

    def id_to_token(self, token_id: int) -> str | None:
        i = int(token_id)
        if i in self._SPECIAL:
            return self._SPECIAL[i]
        return f"<0x{i:02X}>" if 0 <= i < 256 else None

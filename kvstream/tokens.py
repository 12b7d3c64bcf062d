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

"""Counts in words, one way everywhere: "1 new token", "2 new tokens", "2,100 tokens" (thousands separated, as
"step 2,100" is). Qt-free, so the feeds, the headless run and the widgets say numbers alike."""
from __future__ import annotations


def number(n: int) -> str:
    """An integer as the window writes it: 2100 -> '2,100'."""
    return f"{int(n):,}"


def count(n: int, singular: str, plural: str | None = None) -> str:
    """'1 token', '2 tokens', '1 new token', '2,100 blocks' (``plural``: when the word does not just take an s)."""
    word = singular if int(n) == 1 else (plural or _plural(singular))
    return f"{number(n)} {word}"


def _plural(words: str) -> str:
    head, _, last = words.rpartition(" ")
    return (head + " " if head else "") + last + "s"

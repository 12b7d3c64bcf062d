"""Checks of everything a caller hands the engine, each failing with an :class:`EngineError` a user understands.

They run before anything changes, so bad input never touches the pool. A bool is never a number here (Python
counts True as 1, users do not), floats are never ids, and text must be real text.
"""
from __future__ import annotations

import math
import os
import stat
from typing import Any

import numpy as np

from .errors import EngineError

MAX_SEED = 2**32 - 1  # seeds are 32-bit, as numpy's and most users' are; derived per-conversation seeds stay in range
MIN_TEMPERATURE = 1e-3  # positive temperatures below this leave sampling nothing but overflow; 0 means greedy


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy integers included)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    if not is_int(value):
        raise EngineError(f"{name} must be a whole number, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise EngineError(f"{name} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise EngineError(f"{name} must be at most {high}, got {value}")
    return value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise EngineError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_seed(value: Any, name: str = "seed") -> int | None:
    """None (a default seed) or an integer in 0..MAX_SEED."""
    if value is None:
        return None
    if not is_int(value):
        raise EngineError(f"{name} must be a whole number from 0 to {MAX_SEED} (or None), got {value!r}")
    return check_int(value, name, 0, MAX_SEED)


def check_temperature(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise EngineError(f"temperature must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise EngineError(f"temperature must be 0 (greedy) or positive, got {value}")
    if 0 < value < MIN_TEMPERATURE:
        raise EngineError(f"temperature {value:g} is too small to sample from: use 0 for greedy decoding or at "
                          f"least {MIN_TEMPERATURE:g}")
    return value


def check_max_new_tokens(value: Any) -> int:
    return check_int(value, "max_new_tokens", 1)


def check_text(text: Any, what: str = "prompt") -> str:
    if not isinstance(text, str):
        raise EngineError(f"{what} must be text, got {type(text).__name__}")
    if not text:
        raise EngineError(f"the {what} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EngineError(f"the {what} is not valid text: character {exc.start} is a lone surrogate "
                          f"({text[exc.start]!r}), which has no UTF-8 form") from None
    return text


def check_token_ids(token_ids: Any, vocab_size: int, allow_empty: bool = False) -> list[int]:
    """A non-empty (unless ``allow_empty``) sequence of integer token ids within the vocabulary (a list, tuple,
    numpy or torch int array)."""
    if isinstance(token_ids, (str, bytes, bytearray, dict, set, frozenset)) or not hasattr(token_ids, "__len__"):
        raise EngineError(f"prompt_token_ids must be a list of integers, got {type(token_ids).__name__}")
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None:  # numpy or torch arrays: integers only, then plain ints
        kind = getattr(dtype, "kind", None)
        is_float = getattr(dtype, "is_floating_point", None)
        if kind is not None and kind not in "iu" or is_float is True or str(dtype).startswith(("torch.bool", "torch.complex")):
            raise EngineError(f"prompt_token_ids must hold integers, got an array of {dtype}")
        if getattr(token_ids, "ndim", 1) != 1:
            raise EngineError("prompt_token_ids must be one-dimensional")
        token_ids = token_ids.tolist()
    ids = list(token_ids)
    if not ids and not allow_empty:
        raise EngineError("the prompt is empty")
    for t in ids:
        if not is_int(t):
            raise EngineError(f"prompt_token_ids must be a list of integers, but it holds {t!r}")
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return [int(t) for t in ids]


def file_kind(path) -> str | None:
    """What ``path`` is when it is not a regular file ("a folder", "a FIFO", ...); None for a regular file (or
    nothing there). Reading a FIFO blocks until someone writes to it: every model file is checked first."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device file"

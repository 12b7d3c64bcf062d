"""``--demo traffic``: real traffic through the pool. The first 400 requests of Mooncake's production chat trace
(resources/traces, with its Apache-2.0 license) replayed live on the built-in model, paced so a person can follow.

The pool is 1,024 blocks: the sweep of this excerpt as the built-in model replays it (prompts cut to its context of
64 blocks) puts LRU at its floor there, evicting nearly every block the trace asks for again, while Belady already
keeps everything the trace reuses: the size where the gap between the online policy and the optimum is widest
(the figures: docs/traffic.md, "The traffic demo"). Smaller pools lose for Belady too; larger ones let LRU catch up.
"""
from __future__ import annotations

from pathlib import Path

EXCERPT = Path(__file__).resolve().parents[2] / "resources" / "traces" / "mooncake_excerpt.jsonl"
NAME = "traffic"
SETTINGS = {"model": "builtin", "num_blocks": 1024}  # EngineConfig fields the demo needs (unless the user set them)
MODE = "timed"  # arrivals on the trace's clock, outputs decoded: requests hold their blocks while they run
SPEED = 1.0  # the trace's own clock: about three arrivals a second, each row readable as it comes
SCALE = 0.1  # a tenth of each output: a request decodes for a second or two at the demo's pace, so a few run at once
STEPS_PER_SECOND = 20.0  # the engine's pace: blocks fill where the eye can follow


def excerpt_path() -> str:
    return str(EXCERPT)

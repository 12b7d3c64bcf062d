"""bench/peers.py's token comparison: how long a peer's greedy output agrees with the engine's (issue 34 asks that
a bfloat16 run agree for at least the first 32 tokens of every sequence, and that the bench say where they part)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from peers import agreed_prefix  # noqa: E402


def test_the_shortest_agreement_of_any_sequence_is_reported():
    engine = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]
    assert agreed_prefix(engine, engine) == 4  # all equal: the whole length
    assert agreed_prefix([[5, 6, 7, 8], [1, 2, 0, 4], [9, 9, 9, 0]], engine) == 2  # the second parts at token 2
    assert agreed_prefix([[0, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]], engine) == 0
    assert agreed_prefix([[5, 6]], [[5, 6, 7]]) == 2  # a shorter output agrees as far as it goes

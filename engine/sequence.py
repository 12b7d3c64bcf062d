"""A conversation: its tokens, how many have K/V in the pool, its block table, and its sampling settings."""
from __future__ import annotations

from .block_pool import hash_block_tokens
from .snapshot import Status


class Sequence:
    """One conversation inside the engine. Mutable; only the engine thread touches it."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, arrival_step: int, parent_id: int | None = None, ignore_eos: bool = False):
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed  # seeds this conversation's own sampler
        self.ignore_eos = ignore_eos  # keep going past end-of-sequence (benchmarks that need a steady load)
        self.arrival_step = arrival_step
        self.parent_id = parent_id
        self.status = Status.WAITING
        self.block_table: list[int] = []  # physical block ids in logical order
        self.num_computed_tokens = 0  # tokens whose K/V sit in the pool
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at the last admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hash of each full block of token ids, by logical index
        self.version = 0  # bumped on every change, so snapshots rebuild only what changed
        self.generator = None  # torch.Generator for temperature sampling, created by the engine

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ENDED)

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Hashes of every block whose token ids are all known, computed once and extended as tokens arrive."""
        n_full = len(self.token_ids) // block_size
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(parent, self.token_ids[i * block_size:(i + 1) * block_size]))
        return self.block_hashes

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.version += 1

    def start_new_turn(self, new_token_ids: list[int], max_new_tokens: int, temperature: float, step: int) -> None:
        """A follow-up message: the whole history becomes the prompt of a new turn."""
        self.token_ids.extend(new_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.arrival_step = step
        self.status = Status.WAITING
        self.version += 1

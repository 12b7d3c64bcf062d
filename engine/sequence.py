"""A conversation: its tokens, how many have K/V in the pool, its block table, and its sampling settings."""
from __future__ import annotations

from .block_pool import hash_block_tokens
from .snapshot import FinishReason, Status


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
        self.finish_reason: FinishReason | None = None
        self.turns: list[tuple[int, int]] = [(0, self.num_prompt_tokens)]  # (user message start, reply start)
        self.block_table: list[int] = []  # physical block ids in logical order
        self.num_computed_tokens = 0  # tokens whose K/V sit in the pool
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at the last admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hash of each full block of token ids, by logical index
        self.version = 0  # bumped on every change, so snapshots rebuild only what changed
        self.generator = None  # torch.Generator for temperature sampling, created by the engine
        self.pending_forks: list[Sequence] = []  # forks (or extra samples) made before this one's prompt was
        #                                          computed: they share its blocks once it is (the engine forks them)

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

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still without K/V: the rest of the prompt while prefilling, 1 (the last sampled) while decoding."""
        return len(self.token_ids) - self.num_computed_tokens

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
        start = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.turns.append((start, self.num_prompt_tokens))
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.arrival_step = step
        self.status = Status.WAITING
        self.finish_reason = None
        self.version += 1

    # ---- rollback -------------------------------------------------------------------------------------------
    _FIELDS = ("num_prompt_tokens", "max_new_tokens", "temperature", "arrival_step", "status", "finish_reason",
               "num_computed_tokens", "num_cached_tokens", "num_preemptions", "version")

    def checkpoint(self) -> tuple:
        """What a failed step or command may have changed (lists are append-only but for the block table)."""
        return (tuple(getattr(self, f) for f in self._FIELDS), len(self.token_ids), len(self.block_hashes),
                list(self.block_table), list(self.turns), list(self.pending_forks))

    def restore(self, checkpoint: tuple) -> None:
        values, num_tokens, num_hashes, table, turns, self.pending_forks = checkpoint
        for name, value in zip(self._FIELDS, values):
            setattr(self, name, value)
        del self.token_ids[num_tokens:]
        del self.block_hashes[num_hashes:]
        self.block_table = table
        self.turns = turns

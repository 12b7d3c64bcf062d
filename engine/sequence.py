"""A conversation: its tokens, how many have K/V in the pool, its block table, and its sampling settings."""
from __future__ import annotations

from .kv.pool import hash_block_tokens
from kvstream.views import FinishReason, Status


class Sequence:
    """One conversation inside the engine. Mutable; only the engine thread touches it."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, arrival_step: int, parent_id: int | None = None, ignore_eos: bool = False):
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed  # with a token's position, its draw when sampled (engine.model.sampling)
        self.ignore_eos = ignore_eos  # keep going past end-of-sequence (benchmarks that need a steady load)
        self.prefill_only = False  # computes and caches its prompt, samples nothing (Engine.add_prefill)
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
        self.pending_forks: list[Sequence] = []  # forks (or extra samples) made before this one's prompt was
        #                                          computed: they share its blocks once it is (the engine forks them)
        self.extra_tables: list[list[int]] = []  # block tables of KV cache groups 1.. (group 0's is block_table);
        #                                        empty for one-group models; -1 where a sliding window released a block

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

    def group_table(self, group: int) -> list[int]:
        """The block table of KV cache group ``group`` (0: block_table)."""
        return self.block_table if group == 0 else self.extra_tables[group - 1]

    def set_group_table(self, group: int, table: list[int]) -> None:
        """Assign a new list (tables are only appended to in place: anything else assigns, see checkpoint)."""
        if group == 0:
            self.block_table = table
        else:
            self.extra_tables[group - 1] = table

    # ---- rollback -------------------------------------------------------------------------------------------
    # Lists are only ever appended to in place; anything else (a copy-on-write, a release, a relocation, a fork)
    # assigns a new list. So a checkpoint keeps each list object with its length, and a restore puts the object
    # back and cuts it to that length: O(1) per conversation, per step.

    def checkpoint(self) -> tuple:
        """What a failed step or command may have changed."""
        return (self.num_prompt_tokens, self.max_new_tokens, self.temperature, self.arrival_step, self.status,
                self.finish_reason, self.num_computed_tokens, self.num_cached_tokens, self.num_preemptions,
                self.version, self.token_ids, len(self.token_ids), self.block_hashes, len(self.block_hashes),
                self.block_table, len(self.block_table), self.turns, len(self.turns), self.pending_forks,
                len(self.pending_forks), self.extra_tables,
                tuple((t, len(t)) for t in self.extra_tables) if self.extra_tables else ())

    def restore(self, checkpoint: tuple) -> None:
        (self.num_prompt_tokens, self.max_new_tokens, self.temperature, self.arrival_step, self.status,
         self.finish_reason, self.num_computed_tokens, self.num_cached_tokens, self.num_preemptions,
         self.version, self.token_ids, n_tokens, self.block_hashes, n_hashes, self.block_table, n_table,
         self.turns, n_turns, self.pending_forks, n_pending, self.extra_tables, extra) = checkpoint
        if extra:  # the container and each group's list as they were, each cut to its length
            self.extra_tables[:] = [t for t, _ in extra]
            for t, n in extra:
                del t[n:]
        del self.token_ids[n_tokens:]
        del self.block_hashes[n_hashes:]
        del self.block_table[n_table:]
        del self.turns[n_turns:]
        del self.pending_forks[n_pending:]

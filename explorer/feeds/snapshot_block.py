"""A block's details rebuilt from a pool view alone: what the inspector shows for a past frame or a remote pool.

The local engine answers ``inspect_block`` with everything, K/V included. A frame kept in history, an attached
stream or a recording has no engine to ask, but the view still says a lot: state, ref count, fill, hash and owners
come from the per-block arrays and block tables; the tokens of a used block are its owner's tokens at the block's
positions (conversations carry their token ids); the tokens of a cached block come from the history's stored
events. K/V values are never part of a view (they are megabytes per frame), and the result says so.
"""
from __future__ import annotations

from typing import Callable

from kvstream.views import NO_HASH, BlockInfo, BlockState, PoolSnapshot, hash_reason

def _positions_in(token_ids: tuple[int, ...], block: tuple[int, ...], block_size: int) -> tuple[int, ...] | None:
    """Positions of ``block`` as a block-aligned run of ``token_ids`` (None if it is not one)."""
    for start in range(0, len(token_ids) - len(block) + 1, block_size):
        if token_ids[start:start + len(block)] == block:
            return tuple(range(start, start + len(block)))
    return None


def block_info_from_snapshot(snapshot: PoolSnapshot, block_id: int, history=None, seq: int | None = None,
                             token_text: Callable[[int], str | None] | None = None) -> BlockInfo:
    """Everything the view knows about ``block_id`` (``keys``/``values`` are None).

    ``history`` (a kvstream History) and ``seq`` (the frame, None for its newest) supply the tokens of cached
    blocks from stored events; ``token_text`` turns token ids into text where the source has a tokenizer.
    """
    if isinstance(block_id, bool) or not 0 <= int(block_id) < snapshot.num_blocks:
        raise IndexError(f"no block {block_id!r}: block ids run from 0 to {snapshot.num_blocks - 1}")
    b, bs = int(block_id), snapshot.block_size
    state = BlockState(int(snapshot.state[b]))
    filled = int(snapshot.num_filled[b])
    owners = snapshot.owners_of(b)
    last_owner = int(snapshot.owner[b])
    tokens: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    if owners:
        for cid, index in owners:  # the first owner the view lists with its tokens
            info = snapshot.conversation(cid)
            if info is not None:
                positions = tuple(range(index * bs, min(index * bs + filled, info.num_tokens)))
                all_tokens = info.token_ids
                tokens = tuple(all_tokens[p] for p in positions)
                break
    elif state == BlockState.CACHED and history is not None and len(history):
        frame = history.last_seq if seq is None else seq
        stored = history.block_tokens(b, frame)
        if stored:
            tokens = tuple(stored)
            holder = snapshot.conversation(last_owner) if last_owner >= 0 else None
            found = _positions_in(holder.token_ids, tokens, bs) if holder is not None else None
            positions = found if found is not None else (-1,) * len(tokens)  # -1: position unknown
    block_hash = int(snapshot.hashes()[b])
    hashed = block_hash != NO_HASH
    texts = tuple((token_text(t) if token_text is not None else None) or "" for t in tokens)
    return BlockInfo(block_id=b, state=state, ref_count=int(snapshot.ref_count[b]), num_filled=filled, block_size=bs,
                     token_ids=tokens, token_texts=texts, positions=positions, owners=owners,
                     block_hash=block_hash if hashed else None,
                     hash_reason=hash_reason(state, hashed, filled, bs), last_owner=last_owner, keys=None, values=None)

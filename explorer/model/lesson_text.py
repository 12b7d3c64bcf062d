"""The lesson's words: what the lesson window says at each position of the toy paged sequence.

The engine runs the lesson (:class:`engine.ToyPagedSequence`: a real block pool and real paged attention, no Qt);
what a reader is told about each step is the window's, so it lives here, beside the rest of the explorer's
wording, reading the lesson's state and never changing it.
"""
from __future__ import annotations


def setup_note(lesson) -> str:
    """How the pool came to have its free order, so the non-adjacent blocks are not a trick."""
    return ("Before the lesson starts, four other conversations used this 8-block pool. BlockPool handed them "
            "blocks in order: A 0-1, B 2-3, C 4, D 5-7. Then C finished (block 4 went back to the free queue) "
            "and A finished (its blocks go back tail first: 1, then 0). B and D are still running. So the free "
            "queue reads 4, 1, 0, and the lesson gets exactly the blocks BlockPool hands out next.")


def explanation(lesson) -> tuple[str, str]:
    """A title and a short text for the current position (or for the layout change just made)."""
    if getattr(lesson, "sliding_window", None) is not None and lesson.last_action != "layout":
        return _window_explanation(lesson)
    n, bs = lesson.num_positions, lesson.block_size
    table = _table_text(lesson)
    if lesson.last_action == "layout" and lesson.last_change is not None:
        c = lesson.last_change
        same = "bit for bit the same" if c.bit_identical else "NOT the same"
        return ("Same data, other addresses",
                f"Every used block moved to another physical id: the table went from {_arrow(c.before_table)} "
                f"to {_arrow(c.after_table)}, and the tenants' blocks moved too. The values were copied with "
                f"their blocks and the table was rewritten, so reading logical block 0, then 1, ... still "
                f"visits positions 1..{n} in order. The output is {_num(c.before_result)} before and "
                f"{_num(c.after_result)} after: {same}. Where a block sits in memory is not part of the "
                f"answer; only the table's order is.")
    e = lesson.last_event
    if n == 0:
        return ("A toy head in a paged pool",
                "One attention head of dimension 1. Every key is 0 and the query is 1, so every position gets "
                "the same weight and the output is just the mean of the values stored so far. Position k "
                "stores the value k. The pool has 8 physical blocks of 4 slots each; press Step (Space or "
                "Right arrow) to append the first position.")
    if n == 1:
        return ("Blocks are pages",
                f"The first position needs somewhere to live, so BlockPool takes the head of its free queue: "
                f"physical block {e.physical_block}. Not block 0: earlier conversations left the queue in this "
                f"order. Like a page of virtual memory, the block is a fixed-size piece of the pool that can "
                f"sit anywhere. The table now has one entry: {table}. Output: mean(1) = 1.")
    if e.allocated and n > 1 and e.logical_block == 1:
        first = lesson.block_table[0]
        return ("Position 5 needs a second block",
                f"Physical block {first} is full (4 of 4 slots), so this position takes the next block from the free "
                f"queue: physical block {e.physical_block}, not next to block {first}. The first block did not "
                f"move and nothing was copied; the table simply grew: {table}. The new block holds one entry "
                f"and three empty slots. Attention reads block {first} then block {e.physical_block} through "
                f"the table and gets mean(1..5) = 3. Try Change layout now.")
    if e.allocated:
        return (f"Logical block {e.logical_block}: wherever the queue points",
                f"The previous block is full, so position {n} opens logical block {e.logical_block} at "
                f"physical block {e.physical_block}, wherever the free queue points. Table: {table}. "
                f"FlashAttention is a different idea: it organises the attention computation itself (tiles "
                f"in fast memory, no full score matrix), whatever the layout of the KV. A paged kernel can "
                f"do both: find the blocks through the table and compute the attention tile by tile.")
    if n == 4:
        return ("The first block is full",
                f"Positions 1-4 fill the four slots of block {lesson.block_table[0]}. No new block was needed "
                f"so far: allocation happens only when a block runs out. Output: mean(1..4) = 2.5. The next "
                f"position cannot fit here.")
    if n == bs + 2:
        m = lesson.memory()
        per_entry = m["table_bytes"] // len(lesson.block_table)
        return ("What paging costs",
                f"Paging is not free. The last block has {m['empty_tail_slots']} empty slots that still take "
                f"memory ({m['tail_bytes']} bytes here), and the table costs {per_entry} bytes per "
                f"block ({m['table_bytes']} bytes). In return the sequence holds only what it uses: reserving "
                f"room for its maximum length up front would take {m['contiguous_bytes']} bytes against "
                f"{m['kv_bytes'] + m['tail_bytes']} now.")
    if n == bs + 3:
        return ("Paging keeps every entry",
                f"Paging changes where the KV is stored, never how much of it there is: all {n} keys and "
                f"values are still in the pool, uncompressed, and attention still reads every one of them. "
                f"It does not shorten the context. Output: mean(1..{n}) = {_num(lesson.expected())}.")
    if n == 2 * bs:
        return ("Full blocks can be shared",
                "Both blocks are full. A full block never changes again, which is what prefix caching uses: "
                "another sequence starting with the same tokens could point its table at the same physical "
                "blocks (the ref count counts the tables naming a block) instead of storing them twice. "
                "Paging makes that sharing possible; prefix caching decides when to do it.")
    if not lesson.can_step():
        return ("The pool is full",
                f"{n} positions fill all the blocks the lesson can get; B and D keep theirs. A real engine "
                f"would now wait for a conversation to finish, or preempt one. Press Reset to start over.")
    if n <= 3:
        return ("The table is the map",
                f"Position {n} goes into slot {e.slot} of the same block: no allocation, nothing moves. "
                f"Attention does not scan memory in address order; it walks the table, {table}, and reads "
                f"the slots in logical order. Output: mean(1..{n}) = {_num(lesson.expected())}.")
    return (f"Position {n}",
            f"Slot {e.slot} of logical block {e.logical_block} (physical {e.physical_block}). Table: {table}. "
            f"Output: mean(1..{n}) = {_num(lesson.expected())}.")


def _window_explanation(lesson) -> tuple[str, str]:
    """The sliding-window chapter: the same positions, a head that reads only the last ``sliding_window``."""
    n, bs, w = lesson.num_positions, lesson.block_size, lesson.sliding_window
    table, e = _table_text(lesson), lesson.last_event
    first = lesson.window_start() + 1
    reads = f"positions {first}..{n}" if n > 1 else "position 1"
    mean = f"mean({first}..{n}) = {_num(lesson.expected())}" if n > 1 else "mean(1) = 1"
    if n == 0:
        return ("A window of 4",
                f"The same toy head, but now it is a sliding-window layer: each position reads only the last "
                f"{w} positions, as Mistral's layers or the sliding layers of Gemma and gpt-oss do. Blocks are "
                f"still {bs} slots. Step it beside plain paging and watch the tables.")
    just = [r for r in lesson.released if r[0] == n]
    if just:
        _, logical, block = just[-1]
        return (f"Position {n}: logical block {logical} is released",
                f"The window now reads {reads}. Logical block {logical} (physical {block}) holds only "
                f"positions before the window, and a window never looks back, so the model will never read "
                f"them again: the block goes back to the free queue at once, and the table keeps its place as "
                f"-1 (a hole, vLLM's null block): {table}. Paging alone never releases anything: beside it "
                f"the same {n} positions still hold every block, because full attention reads all of them. "
                f"The text's point: paging does not automatically shorten context; a window does. Output: "
                f"{mean}.")
    if e is not None and e.allocated and e.logical_block >= 1:
        return (f"Position {n} needs a new block",
                f"Logical block {e.logical_block - 1} is full, so position {n} takes physical block "
                f"{e.physical_block} from the free queue, exactly as with paging alone. The window reads "
                f"{reads}, and some of those are still in the block before, so nothing is released yet. "
                f"Table: {table}. Output: {mean}.")
    if n <= w:
        return (f"Position {n}: the window still sees everything",
                f"With {n} position{'s' if n > 1 else ''} the window of {w} reaches back to the start, so "
                f"this head reads what full attention reads. Table: {table}. Output: {mean}.")
    return (f"Position {n}: the window slides",
            f"The window reads {reads}; positions before {first} are never read again. A block is given back "
            f"only once all of its positions are behind the window. Table: {table}. Output: {mean}.")


def _table_text(lesson) -> str:
    return ", ".join(f"{i} \u2192 {b if b >= 0 else 'released (-1)'}" for i, b in enumerate(lesson.block_table))


def _arrow(table: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(b) for b in table) + "]"


def _num(x: float) -> str:
    return f"{x:g}"

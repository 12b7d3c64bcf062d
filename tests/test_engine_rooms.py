"""The engine's rooms: no two engine modules import each other (engine <-> views <-> relocation once did), the views
are built from the parts they read, the finished window belongs to whoever finishes conversations, and relocation
goes through the pool's manager."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from engine import Engine, EngineConfig, EngineError
from engine.pool_views import PoolViews
from tests.helpers import package_imports, write_tiny_checkpoint
from tests.test_layering import circles

ROOT = Path(__file__).resolve().parents[1]


def engine_imports() -> dict[str, set[str]]:
    """Module -> the engine modules it imports: relative or absolute, at the top, inside a function or under
    TYPE_CHECKING (an import only for types is a circle to the reader all the same). ``from X import name``
    counts as importing X.name where that is a module, else X."""
    return package_imports("engine", named_module_only=True)


def test_no_engine_modules_import_each_other():
    graph = engine_imports()
    assert "engine.pool_views" in graph["engine.engine"] and "engine.native" in graph["engine.attention.native"]
    assert not circles({"a": {"b"}, "b": {"a"}}) == []  # the walk finds a circle where there is one
    found = circles(graph)
    assert not found, "engine modules import each other:\n" + "\n".join(" -> ".join(c) for c in found)
    assert "engine.engine" not in graph["engine.pool_views"] | graph["engine.kv.relocation"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("rooms")))


def _busy(ckpt, **kw):
    eng = Engine(EngineConfig(model=ckpt, num_blocks=64, block_size=4, finished_window=2, **kw))
    for n in (5, 9, 3, 7):
        eng.add_conversation(prompt_token_ids=list(range(1, n + 1)), max_new_tokens=2 + n % 3)
    for _ in range(4):
        eng.step()
    return eng


def test_views_are_built_from_the_parts_they_read_and_give_the_engines_snapshot(ckpt):
    """A second PoolViews made from the engine's parts alone (no Engine handed over) sees what the engine's own
    does: the same snapshot, conversations, memory figures and block inspection."""
    eng = _busy(ckpt)
    views = PoolViews(cfg=eng.cfg, pool=eng.pool, manager=eng.manager, scheduler=eng.scheduler, kv=eng.kv,
                      seqs=eng.seqs, tokenizer=eng.tokenizer, kv_cache_groups=eng.kv_cache_groups,
                      finished=eng.finished, counts=eng._counts, model_name=eng.model_name, device=eng.device,
                      max_model_len=eng.max_model_len)
    assert not hasattr(views, "engine")
    mine, theirs = views.snapshot(), eng.snapshot()
    assert mine.conversations == theirs.conversations and mine.block_tables == theirs.block_tables
    assert mine.metrics == theirs.metrics and mine.memory == theirs.memory and mine.version == theirs.version
    assert np.array_equal(mine.state, theirs.state) and np.array_equal(mine.ref_count, theirs.ref_count)
    used = int(np.flatnonzero(theirs.state != 0)[0])
    a, b = views.inspect_block(used), eng.inspect_block(used)
    assert (a.token_ids, a.owners, a.hash_reason) == (b.token_ids, b.owners, b.hash_reason)


def test_the_finished_window_is_the_engines_and_survives_a_rollback(ckpt):
    """The engine, which finishes conversations, owns the window (newest last, at most finished_window); the views
    only read it, and a rolled-back step leaves it exactly as it was (the same deque, changed in place)."""
    eng = _busy(ckpt)
    eng.run_until_idle()
    window = eng.finished
    assert eng.views.finished is window and len(window) == 2
    shown = [c.conversation_id for c in eng.conversations()]
    assert shown == sorted(window)
    eng.add_conversation(prompt_token_ids=[1, 2, 3], max_new_tokens=1)
    before, seqs = list(window), eng.seqs
    with eng.transaction(rollback=True):
        eng.step_unprotected()  # finishes the new one: the window moves inside the transaction
        assert list(window) != before
    assert eng.finished is window and list(window) == before and eng.seqs is seqs


def test_relocation_goes_through_the_manager_and_a_failed_move_changes_nothing(ckpt, monkeypatch):
    """The engine's relocation moves K/V and then asks the manager (the pool's one writer) to rename; when moving
    the K/V fails for memory the engine is exactly as it was."""
    eng = _busy(ckpt)
    calls = []
    relocate = type(eng.manager).relocate
    monkeypatch.setattr(type(eng.manager), "relocate", lambda self, *a: calls.append(1) or relocate(self, *a))
    mapping = eng.relocate_blocks(seed=3)
    assert mapping and calls == [1]
    before = (eng.snapshot(), eng.kv.data.clone())

    def no_memory(*args):
        raise MemoryError("out of memory")
    monkeypatch.setattr(eng.kv, "move_blocks", no_memory)
    with pytest.raises(EngineError, match="not enough memory to move"):
        eng.relocate_blocks(seed=5)
    after = eng.snapshot()
    assert calls == [1] and eng.kv.data.equal(before[1]) and after.version == before[0].version
    assert after.conversations == before[0].conversations and after.block_tables == before[0].block_tables
    for field in ("state", "ref_count", "num_filled", "owner", "block_hash"):
        assert np.array_equal(getattr(after, field), getattr(before[0], field)), field


def test_the_change_record_is_handed_on_not_noted_aside():
    """No side table of promises in kvstream.views and no compatibility properties on the frozen snapshot: the
    record is a value the producer hands on (Engine.change_record, the runner's PoolUpdate)."""
    import kvstream.views as views
    gone = {"promise_changed_blocks", "promise_output_prefixes", "change_record", "_NOTES"}
    assert not gone & set(vars(views))
    assert not hasattr(views.PoolSnapshot, "changed_blocks") and not hasattr(views.PoolSnapshot, "output_prefixes")
    assert views.PoolUpdate.of("a snapshot").changes is views.NO_CHANGE_RECORD


def test_the_engine_states_why_a_block_has_no_hash_and_the_explorer_words_it(ckpt):
    """BlockInfo carries a HashReason (a fact), not prose; explorer.model.block_words says it as the inspector did:
    a hashed block, a cached one, a partial one, a free one."""
    from explorer.model.block_words import hash_note
    from kvstream.views import BlockState, HashReason
    eng = Engine(EngineConfig(model=ckpt, num_blocks=64, block_size=4))
    a = eng.add_conversation(prompt_token_ids=list(range(1, 7)), max_new_tokens=4, ignore_eos=True)
    eng.step()
    full, part = eng.conversation(a).block_table[:2]
    infos = {b: eng.inspect_block(b) for b in (full, part, 60)}
    assert [infos[b].hash_reason for b in (full, part, 60)] == [HashReason.HASHED, HashReason.PARTIAL, HashReason.FREE]
    assert hash_note(infos[full]).startswith("full block, hashed with its prefix")
    assert hash_note(infos[part]) == ("partially filled (2/4): only full blocks are hashed and shared through the "
                                      "prefix cache")
    assert hash_note(infos[60]) == "free: holds no reusable KV"
    eng.run_until_idle()
    cached = eng.inspect_block(full)
    assert cached.state == BlockState.CACHED and hash_note(cached).endswith("(cached: free, evicted "
                                                                            "least-recently-used first)")
    assert hash_note(dataclasses.replace(cached, hash_reason=None)) == ""
    assert not any(isinstance(getattr(cached, f), str) and " " in getattr(cached, f)
                   for f in cached.__dataclass_fields__)  # no prose in the engine's answer

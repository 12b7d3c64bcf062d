"""paged_attention against a dense reference, and the source text's worked example."""
import contextlib
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine import EngineError, attention, dense_attention, paged_attention


def _scatter(keys_per_seq, values_per_seq, block_size, num_blocks, rng, pad_value):
    """Put each sequence's K/V into randomly chosen physical blocks; return caches, tables, lengths."""
    kv_heads, dim = keys_per_seq[0].shape[1:]
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim)  # garbage everywhere else on purpose
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    free = list(rng.permutation(num_blocks))
    max_blocks = max(-(-len(k) // block_size) for k in keys_per_seq) + 2
    tables = torch.full((len(keys_per_seq), max_blocks), pad_value, dtype=torch.int32)
    for s, (k, v) in enumerate(zip(keys_per_seq, values_per_seq)):
        for i in range(-(-len(k) // block_size)):
            b = int(free.pop())
            tables[s, i] = b
            chunk = slice(i * block_size, min((i + 1) * block_size, len(k)))
            n = chunk.stop - chunk.start
            key_cache[b, :n] = k[chunk]
            value_cache[b, :n] = v[chunk]
    return key_cache, value_cache, tables


@contextlib.contextmanager
def decode_path(path: str):
    """Decode attention through one path: "native" (engine.native's kernel, the CPU default), or with the native
    kernel off, "sdpa" or "cross_head" (the eager path's two ways to attend a group)."""
    chosen = attention.eager._use_cross_head
    previous = attention.use_native_kernel(path == "native")
    attention.eager._use_cross_head = lambda *args: path == "cross_head"
    try:
        yield
    finally:
        attention.eager._use_cross_head = chosen
        attention.use_native_kernel(previous)


@settings(max_examples=60, deadline=None)
@given(
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([1, 3, 4, 16]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    pad=st.sampled_from(["minus_one", "stale"]),
    seed=st.integers(0, 2**16),
    path=st.sampled_from(["native", "sdpa", "cross_head"]),
)
def test_paged_equals_dense(group, block_size, lens, pad, seed, path):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    kv_heads, dim = 2, 8
    heads = kv_heads * group
    # exact multiples of the block size and length 1 always take part
    lens = lens + [block_size * 2, 1]
    keys = [torch.randn(n, kv_heads, dim) for n in lens]
    values = [torch.randn(n, kv_heads, dim) for n in lens]
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    key_cache, value_cache, tables = _scatter(keys, values, block_size, num_blocks, rng, -1)
    if pad == "stale":  # entries past the last block may hold any valid id
        for s, n in enumerate(lens):
            used = -(-n // block_size)
            tables[s, used:] = torch.as_tensor(rng.integers(0, num_blocks, tables.shape[1] - used), dtype=torch.int32)
    query = torch.randn(len(lens), heads, dim)
    with decode_path(path):
        out = paged_attention(query, key_cache, value_cache, tables, torch.tensor(lens))
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    assert out.shape == (len(lens), heads, dim)
    assert torch.allclose(out, ref, atol=1e-5)


def _seed_example(table):
    """Block size 4, one head of dim 1, keys 0, query 1, values 1..5 at positions 0..4."""
    key_cache = torch.zeros(8, 4, 1, 1)
    value_cache = torch.zeros(8, 4, 1, 1)
    for pos, value in enumerate([1.0, 2.0, 3.0, 4.0, 5.0]):
        value_cache[table[pos // 4], pos % 4, 0, 0] = value
    return paged_attention(torch.ones(1, 1, 1), key_cache, value_cache, torch.tensor([table]), torch.tensor([5]))


def test_source_text_example_layouts():
    assert _seed_example([4, 1]).item() == 3.0  # logical blocks 0, 1 in physical blocks 4, 1
    assert _seed_example([0, 7]).item() == 3.0
    assert _seed_example([6, 5]).item() == 3.0


def test_default_scale_and_gqa_mapping():
    # two query heads share one kv head; with explicit scale 0 every position gets equal weight
    key_cache = torch.randn(3, 2, 1, 4)
    value_cache = torch.randn(3, 2, 1, 4)
    out = paged_attention(torch.randn(1, 2, 4), key_cache, value_cache, torch.tensor([[2, 0]]), torch.tensor([3]), scale=0.0)
    expected = torch.cat([value_cache[2], value_cache[0, :1]]).mean(0)  # [1, 4]
    assert torch.allclose(out[0], expected.expand(2, 4), atol=1e-6)


def test_an_empty_batch_gives_an_empty_result():
    out = paged_attention(torch.zeros(0, 2, 4), torch.zeros(3, 4, 1, 4), torch.zeros(3, 4, 1, 4),
                          torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, 2, 4)


def test_bad_shapes_raise_engine_error():
    with pytest.raises(EngineError):
        paged_attention(torch.randn(1, 3, 4), torch.zeros(2, 2, 2, 4), torch.zeros(2, 2, 2, 4),
                        torch.tensor([[0]]), torch.tensor([1]))


def test_compiled_fused_kernel_matches_dense():
    """The torch.compile path (or its eager fallback, should compiling fail) gives the dense result."""
    from engine import attention

    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    try:
        assert attention.use_compiled_attention(True) or attention.compiled._compiled.failed
        for lens in ([5, 16, 1, 33], [64, 3], [7], [9, 2, 40]):  # ragged; 3 rows and odd widths get padded
            keys = [torch.randn(n, 2, 8) for n in lens]
            values = [torch.randn(n, 2, 8) for n in lens]
            num_blocks = sum(-(-n // 4) for n in lens) + 3
            key_cache, value_cache, tables = _scatter(keys, values, 4, num_blocks, rng, -1)
            tables[0, -1] = num_blocks - 1  # a stale id past the end of sequence 0
            for magnitude, atol in ((1.0, 1e-5), (300.0, 1e-3)):  # large scores: near one-hot softmax, no NaN
                query = torch.randn(len(lens), 4, 8) * magnitude
                out = paged_attention(query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32))
                ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
                assert torch.allclose(out, ref, atol=atol), (out - ref).abs().max()
    finally:
        attention.use_compiled_attention(False)


def test_compiled_kernel_limit_falls_back_to_eager(monkeypatch):
    """Once no more kernels may be compiled, a new shape is computed eagerly (and correctly), not compiled."""
    from engine import attention

    rng = np.random.default_rng(6)
    torch.manual_seed(6)
    try:
        attention.use_compiled_attention(True)
        fused = attention.compiled._compiled
        monkeypatch.setattr(fused, "MAX_KERNELS", len(fused._kernels))
        before = set(attention.compiled._compiled._kernels)
        lens = [70, 3, 5, 12, 9]  # 5 rows of 3 kv heads: a shape no other test compiles
        keys = [torch.randn(n, 3, 8) for n in lens]
        values = [torch.randn(n, 3, 8) for n in lens]
        key_cache, value_cache, tables = _scatter(keys, values, 4, sum(-(-n // 4) for n in lens) + 2, rng, -1)
        query = torch.randn(len(lens), 6, 8)
        out = paged_attention(query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32))
        ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
        assert torch.allclose(out, ref, atol=1e-5)
        assert attention.compiled._compiled._kernels == before and not attention.compiled._compiled.failed
    finally:
        attention.use_compiled_attention(False)


def test_engine_plan_equals_plan_decode():
    """The engine's per-step plan (from the tables its conversations hold) equals plan_decode on the same tables
    padded with -1 and spare columns."""
    from engine import Engine, EngineConfig
    from engine.attention import plan_decode

    eng = Engine(EngineConfig(model="builtin", num_blocks=64, block_size=4))
    for n, new in ((3, 9), (8, 2), (13, 5)):
        eng.add_conversation(prompt_token_ids=list(range(1, n + 1)), max_new_tokens=new)
    for _ in range(4):
        eng.step()
        seqs = [s for s in eng.scheduler.running if s.num_computed_tokens < s.num_tokens]
        lens = [s.num_computed_tokens for s in seqs]  # K/V already in the pool
        width = max(len(s.block_table) for s in seqs)
        tables = torch.full((len(seqs), width + 2), -1, dtype=torch.int64)  # -1 and spare columns past the end
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table)
        cache = eng.kv.layers[0][0]
        ours = eng.runner.plan(seqs, lens)
        ref = plan_decode(tables, torch.tensor(lens), 4, attention.group_bytes_for(cache),
                          attention.bytes_per_token(cache))
        assert torch.equal(ours.tables, ref.tables) and torch.equal(ours.seq_lens, ref.seq_lens)
        assert ours.max_len == ref.max_len
        assert _same_groups(ours, ref)


def _same_groups(a, b):
    def key(plan):
        return [(g.start, g.end, g.num_blocks, g.length, g.rows.tolist(), None if g.mask is None else g.mask.tolist())
                for g in plan.groups]
    same_order = (a.order is None) == (b.order is None) and (a.order is None or torch.equal(a.order, b.order))
    return same_order and key(a) == key(b)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 90), min_size=1, max_size=12), group_tokens=st.integers(1, 200),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_decode_groups_cover_the_batch_and_equal_dense(lens, group_tokens, block_size, seed):
    """However the sorted batch is cut into groups (down to one sequence each), every sequence is in exactly one
    group, padded only to its group's longest (at most twice its own length), and the result is the dense one."""
    from engine.attention import plan_decode
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    keys = [torch.randn(n, 2, 8) for n in lens]
    values = [torch.randn(n, 2, 8) for n in lens]
    key_cache, value_cache, tables = _scatter(keys, values, block_size, sum(-(-n // block_size) for n in lens) + 2,
                                              rng, -1)
    per_token = attention.bytes_per_token(key_cache)
    plan = plan_decode(tables, torch.tensor(lens), block_size, group_tokens * per_token, per_token)
    order = list(range(len(lens))) if plan.order is None else plan.order.tolist()
    assert sorted(order) == list(range(len(lens))) and [lens[i] for i in order] == sorted(lens, reverse=True)
    assert [g.start for g in plan.groups] == [0] + [g.end for g in plan.groups[:-1]] and plan.groups[-1].end == len(lens)
    for g in plan.groups:
        members = [lens[i] for i in order[g.start:g.end]]
        assert g.length == max(members) and 2 * min(members) >= g.length
        assert len(members) == 1 or len(members) * g.length <= group_tokens
    query = torch.randn(len(lens), 4, 8)
    old, attention.plan.GROUP_BYTES = attention.plan.GROUP_BYTES, group_tokens * per_token
    try:
        with decode_path("sdpa"):  # the groups are the eager path's
            out = paged_attention(query, key_cache, value_cache, tables, torch.tensor(lens))
    finally:
        attention.plan.GROUP_BYTES = old
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    assert torch.allclose(out, ref, atol=1e-5)


# ---- the default path's per-shape choice of the fused kernel (engine.attention.compiled._AutoKernels) ----------
@pytest.fixture
def auto(monkeypatch):
    """A fresh chooser as the one the default path uses, with a clock the test moves: the eager path costs 10 units
    a call and the fused kernel ``fused_cost[0]``."""
    from engine import attention
    chooser = attention.compiled._AutoKernels()
    monkeypatch.setattr(attention.compiled, "_auto", chooser)
    monkeypatch.setattr(attention.native, "enabled", False)  # the chooser serves where the native kernel does not
    clock, fused_cost = [0.0], [1.0]
    chooser.timer = lambda: clock[0]
    eager, fused = attention.eager._paged_attention_eager, attention.compiled._try_compiled
    calls = {"eager": 0, "fused": 0}

    def timed_eager(*args):
        clock[0] += 10.0
        calls["eager"] += 1
        return eager(*args)

    def timed_fused(*args):
        out = fused(*args)
        if out is not None and threading.current_thread() is threading.main_thread():
            clock[0] += fused_cost[0]
            calls["fused"] += 1
        return out
    monkeypatch.setattr(attention.eager, "_paged_attention_eager", timed_eager)
    monkeypatch.setattr(attention.compiled, "_try_compiled", timed_fused)
    chooser.fused_cost, chooser.calls = fused_cost, calls
    yield chooser
    chooser.wait(60)


def _long_case(seed: int):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    lens = [512, 509]  # contexts from AUTO_MIN_POSITIONS on; 32 blocks: a bucket the kernel takes without padding
    keys = [torch.randn(n, 2, 8) for n in lens]
    values = [torch.randn(n, 2, 8) for n in lens]
    key_cache, value_cache, tables = _scatter(keys, values, 16, sum(-(-n // 16) for n in lens) + 3, rng, -1)
    query = torch.randn(len(lens), 4, 8)
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    return (query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)), ref


@pytest.mark.parametrize("fused_cost, takes_fused", [(1.0, True), (9.9, False)])
def test_default_path_compiles_a_long_shape_in_the_background_then_times_both_and_keeps_the_faster(
        auto, fused_cost, takes_fused):
    from engine import attention
    auto.fused_cost[0] = fused_cost
    inputs, ref = _long_case(7)
    with torch.inference_mode():
        for _ in range(attention.AUTO_MIN_CALLS):  # steady use queues the shape's compile; until then: eager
            assert torch.allclose(paged_attention(*inputs), ref, atol=1e-5)
        assert auto.calls == {"eager": attention.AUTO_MIN_CALLS, "fused": 0}
        assert auto.wait(300)
        if attention.compiled._compiled.failed:
            pytest.skip("torch.compile cannot build kernels on this machine (no C++ compiler?)")
        (key,) = auto._choice
        assert auto.choice(key) == "trial"
        trial = 2 * (attention.AUTO_WARMUP_CALLS + attention.AUTO_TIMING_CALLS)
        for _ in range(trial):  # the caller's own calls time the two paths in turn; each answer is right
            assert torch.allclose(paged_attention(*inputs), ref, atol=1e-5)
        assert auto.calls == {"eager": attention.AUTO_MIN_CALLS + trial // 2, "fused": trial // 2}
        assert auto.choice(key) is takes_fused and auto.decisions[key] == pytest.approx((10.0, fused_cost))
        for _ in range(5):
            assert torch.allclose(paged_attention(*inputs), ref, atol=1e-5)
        assert auto.calls["fused"] == trial // 2 + (5 if takes_fused else 0)
        # the same shape given as views (int64 tables with spare columns, a strided query, a plain tensor inside
        # inference mode) takes the kernel as it is: nothing is compiled again on the caller's thread
        from torch._dynamo.utils import counters
        compiled = counters["frames"]["ok"]
        query, key_cache, value_cache, tables, lens = inputs
        with torch.inference_mode(False):  # a caller's own tensors, made outside inference mode
            wide = torch.cat([tables.long(), torch.full((2, 5), -1, dtype=torch.long)], dim=1)
            strided = torch.cat([query, query], dim=2)[:, :, :8]
            lens64 = lens.long()
        assert not strided.is_contiguous() and not wide.is_inference()
        assert torch.allclose(paged_attention(strided, key_cache, value_cache, wide, lens64), ref, atol=1e-5)
        assert counters["frames"]["ok"] == compiled
        short = (inputs[0], inputs[1], inputs[2], inputs[3], torch.tensor([100, 3], dtype=torch.int32))
        for _ in range(attention.AUTO_MIN_CALLS + 1):  # a short context never queues a compile
            paged_attention(*short)
        assert list(auto._choice) == [key]


def test_nothing_waits_for_a_compile_and_a_failed_one_leaves_the_eager_path(auto, monkeypatch):
    """While the background compile runs (here: held until the test lets it go) every call is answered eagerly and
    right; a compile that raises turns the fused kernel off for good, and the calls go on unharmed."""
    from engine import attention
    monkeypatch.setattr(attention.compiled._compiled, "failed", False)
    monkeypatch.setattr(attention.compiled._compiled, "enabled", False)
    started, release = threading.Event(), threading.Event()

    def stuck_compile(self, *args):
        started.set()
        release.wait(60)
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(attention.compiled._Compiled, "__call__", stuck_compile)
    inputs, ref = _long_case(8)
    with torch.inference_mode():
        for _ in range(attention.AUTO_MIN_CALLS):
            paged_attention(*inputs)
        assert started.wait(60)
        for _ in range(10):  # the compile is stuck: the caller is not
            assert torch.allclose(paged_attention(*inputs), ref, atol=1e-5)
        assert not auto.wait(0.05)
        release.set()
        assert auto.wait(60)
        assert attention.compiled._compiled.failed and auto.choice(next(iter(auto._choice))) is False
        for _ in range(3):
            assert torch.allclose(paged_attention(*inputs), ref, atol=1e-5)
    assert auto.calls["fused"] == 0


# ---- sliding windows ---------------------------------------------------------------------------------------------
def _windowed_case(rng, lens, window, block_size, kv_heads=2, group=2, dim=8, absent=-1):
    """Caches with each sequence's K/V in random blocks; the entries of blocks wholly before each sequence's window
    are ``absent`` (-1, as the engine's tables hold them); the dense reference's keys: the window's positions."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = torch.from_numpy(rng.standard_normal((num_blocks, block_size, kv_heads, dim), dtype=np.float32))
    value_cache = torch.from_numpy(rng.standard_normal((num_blocks, block_size, kv_heads, dim), dtype=np.float32))
    width = max(-(-n // block_size) for n in lens) + 1
    tables = torch.full((len(lens), width), absent, dtype=torch.int64)
    free = list(rng.permutation(num_blocks))
    keys, values = [], []
    for s, n in enumerate(lens):
        first = max(0, n - window) // block_size  # the block of position (n - 1) - window + 1
        blocks = [int(free.pop()) for _ in range(-(-n // block_size))]
        tables[s, first: len(blocks)] = torch.tensor(blocks[first:])
        lo = max(0, n - window)
        keys.append(key_cache[blocks].reshape(-1, kv_heads, dim)[lo:n])
        values.append(value_cache[blocks].reshape(-1, kv_heads, dim)[lo:n])
    query = torch.from_numpy(rng.standard_normal((len(lens), kv_heads * group, dim), dtype=np.float32))
    return query, key_cache, value_cache, tables, torch.tensor(lens), keys, values


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 3, 4, 16]),
    window=st.integers(1, 40),
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    path=st.sampled_from(["native", "sdpa", "cross_head"]),
)
def test_windowed_paged_equals_dense_over_the_window(block_size, window, lens, seed, path):
    """The query at p = len - 1 reads keys at positions > p - window (windows starting mid-block), and never
    dereferences the -1 entries of the blocks wholly before that."""
    rng = np.random.default_rng(seed)
    query, key_cache, value_cache, tables, seq_lens, keys, values = _windowed_case(rng, lens, window, block_size)
    with decode_path(path):
        out = paged_attention(query, key_cache, value_cache, tables, seq_lens, sliding_window=window)
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_a_window_mid_block_reads_exactly_the_window():
    """Window 5, block 4, length 11: positions 6..10 (block 1 from its third slot, block 2); block 0 absent."""
    rng = np.random.default_rng(0)
    query, key_cache, value_cache, tables, seq_lens, keys, values = _windowed_case(rng, [11], 5, 4)
    assert tables[0, 0] == -1 and tables[0, 1] >= 0
    for path in ("native", "sdpa"):
        with decode_path(path):
            out = paged_attention(query, key_cache, value_cache, tables, seq_lens, sliding_window=5)
        assert torch.allclose(out[0], dense_attention(query[0], keys[0], values[0]), atol=1e-5)
        without = paged_attention(query, key_cache, value_cache, tables.clamp_min(0), seq_lens)
        assert not torch.allclose(out, without, atol=1e-3)  # the window really cuts


def test_window_argument_and_absent_blocks_inside_the_window_are_refused():
    rng = np.random.default_rng(1)
    query, key_cache, value_cache, tables, seq_lens, _, _ = _windowed_case(rng, [11], 5, 4)
    for bad in (0, -3, 2.5, True, "4"):
        with pytest.raises(EngineError, match="sliding_window"):
            paged_attention(query, key_cache, value_cache, tables, seq_lens, sliding_window=bad)
    with pytest.raises(EngineError, match="outside the cache"):  # a wider window reads the absent block 0
        paged_attention(query, key_cache, value_cache, tables, seq_lens, sliding_window=9)
    with pytest.raises(EngineError, match="outside the cache"):  # and so does no window
        paged_attention(query, key_cache, value_cache, tables, seq_lens)


def test_windowed_large_batch_checks_through_tensors():
    """More than 1024 table entries: the check runs on tensors; -1 before the window passes, inside it fails."""
    rng = np.random.default_rng(2)
    lens = [200] * 40
    query, key_cache, value_cache, tables, seq_lens, keys, values = _windowed_case(rng, lens, 30, 4)
    assert tables.numel() > 1024
    out = paged_attention(query, key_cache, value_cache, tables, seq_lens, sliding_window=30)
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    assert torch.allclose(out, ref, atol=1e-5)
    tables[3, -(-200 // 4) - 2] = -1
    with pytest.raises(EngineError, match="outside the cache"):
        paged_attention(query, key_cache, value_cache, tables, seq_lens, sliding_window=30)


@pytest.mark.parametrize("start", [0, 3, 9, 14])
@pytest.mark.parametrize("window", [1, 3, 6, 50])
def test_windowed_prefill_equals_dense(start, window):
    from engine.attention import paged_prefill_attention
    torch.manual_seed(start * 7 + window)
    bs, num_new = 4, 7
    total = start + num_new
    key_cache, value_cache = torch.randn(30, bs, 2, 8), torch.randn(30, bs, 2, 8)
    table = torch.randperm(30)[: -(-total // bs)]
    with_holes = table.clone()
    with_holes[: max(0, start - window + 1) // bs] = -1  # blocks the first query does not read: absent
    query = torch.randn(num_new, 4, 8)
    out = paged_prefill_attention(query, key_cache, value_cache, with_holes, start, sliding_window=window)
    for i in range(num_new):
        p = start + i
        pos = range(max(0, p - window + 1), p + 1)
        keys = torch.stack([key_cache[table[x // bs], x % bs] for x in pos])
        values = torch.stack([value_cache[table[x // bs], x % bs] for x in pos])
        assert torch.allclose(out[i], dense_attention(query[i], keys, values), atol=1e-5)


def test_fused_kernel_honours_the_window():
    """The torch.compile path's function (run here uncompiled: the same ops) reads the window and skips -1."""
    rng = np.random.default_rng(3)
    lens = [5, 16, 1, 33]
    query, key_cache, value_cache, tables, seq_lens, keys, values = _windowed_case(rng, lens, 7, 4)
    width = 16  # a multiple of the chunk
    tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]), value=-1)
    out = attention.compiled._paged_attention_fused(query, key_cache, value_cache, tables, seq_lens, 8 ** -0.5, 8, 7)
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    assert torch.allclose(out, ref, atol=1e-5)


# ---- the backends behind one object (engine.attention.Attention) --------------------------------------------------
@pytest.mark.parametrize("window", [None, 5])
def test_every_backend_object_decodes_a_planned_batch_as_the_dense_reference(window):
    """Each named backend (the default order, compiled, eager, reference) answers the same decode batch, planned
    as the engine plans it, with the dense result; a windowed one reads only the keys inside each window."""
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    lens = [9, 1, 23, 6]
    keys = [torch.randn(n, 2, 8) for n in lens]
    values = [torch.randn(n, 2, 8) for n in lens]
    key_cache, value_cache, tables = _scatter(keys, values, 4, sum(-(-n // 4) for n in lens) + 3, rng, -1)
    query = torch.randn(len(lens), 4, 8)
    plan = attention.plan_decode(tables, torch.tensor(lens), 4, attention.group_bytes_for(key_cache),
                                 attention.bytes_per_token(key_cache), window)
    first = [0 if window is None else max(0, n - window) for n in lens]
    ref = torch.stack([dense_attention(query[s], keys[s][first[s]:], values[s][first[s]:])
                       for s in range(len(lens))])
    assert set(attention.BACKENDS) == {"default", "compiled", "eager", "reference"}
    for name, backend in attention.BACKENDS.items():
        out = backend.decode(query, key_cache, value_cache, plan, 8 ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), name


def test_only_the_default_backend_hands_decodes_to_the_native_kernel_and_only_while_it_is_on():
    """The model asks its attention object whether to take the one-call native decode step: the default one says
    yes while the kernel is built and switched on; compiled, eager and reference never do; a plain function is
    not asked (False)."""
    from engine import native
    built = native.kernel() is not None
    assert attention.DEFAULT.decodes_natively() is built
    assert not any(attention.BACKENDS[n].decodes_natively() for n in ("compiled", "eager", "reference"))
    previous = attention.use_native_kernel(False)
    try:
        assert not attention.DEFAULT.decodes_natively()
    finally:
        attention.use_native_kernel(previous)
    assert attention.decodes_natively(attention.DEFAULT) is built
    assert not attention.decodes_natively(lambda *args: None)
    assert attention.choose(False) is attention.DEFAULT and attention.choose(True) is attention.COMPILED
    with pytest.raises(ValueError, match="no attention backend"):
        attention.Attention("fastest")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,count,heads,kv_heads", [(16, 64, 8, 4), (1, 5, 9, 3), (4, 13, 4, 4)])
def test_fresh_prompts_attended_in_one_batch_give_the_bits_of_one_at_a_time(dtype, block_size, count, heads,
                                                                            kv_heads):
    """Several fresh prompts of one length go to one batched SDPA (a step admitting 64 prompts made 64 calls a
    layer): each prompt's attention must be bit for bit what attending it alone gives."""
    from engine.attention import fresh_prefill_attention, paged_prefill_attention
    torch.manual_seed(count)
    seqs, dim = 6, 16
    width = -(-count // block_size)
    key_cache = torch.randn(seqs * width + 5, block_size, kv_heads, dim).to(dtype)
    value_cache = torch.randn_like(key_cache)
    order = torch.randperm(key_cache.shape[0])
    tables = [order[s * width:(s + 1) * width] for s in range(seqs)]
    query = torch.randn(seqs * count, heads, dim).to(dtype)
    together = fresh_prefill_attention(query, key_cache, value_cache, tables, count, 0.3)
    alone = torch.cat([paged_prefill_attention(query[s * count:(s + 1) * count], key_cache, value_cache, tables[s],
                                               0, 0.3) for s in range(seqs)])
    assert torch.equal(together, alone)


def test_prefill_runs_join_only_fresh_adjacent_chunks_of_one_length_inside_the_window():
    from engine.attention.backend import _prefill_runs
    t = [torch.tensor([i]) for i in range(8)]
    chunks = [(0, 4, t[0], 0), (4, 4, t[1], 0), (8, 4, t[2], 0),  # three fresh prompts of 4: one run
              (12, 3, t[3], 0),  # another length: a run of its own
              (15, 3, t[4], 8),  # a later chunk (start 8): alone, and nothing joins it
              (18, 3, t[5], 0), (21, 3, t[6], 0)]  # fresh again: a run of two
    runs = [(first, count, [int(x) for x in tables], start) for first, count, tables, start in
            _prefill_runs(chunks, None)]
    assert runs == [(0, 4, [0, 1, 2], 0), (12, 3, [3], 0), (15, 3, [4], 8), (18, 3, [5, 6], 0)]
    # with a window of 3, prompts of 4 need the windowed path: each alone; prompts of 3 still join
    runs = [(first, count, len(tables)) for first, count, tables, _ in _prefill_runs(chunks, 3)]
    assert runs == [(0, 4, 1), (4, 4, 1), (8, 4, 1), (12, 3, 1), (15, 3, 1), (18, 3, 2)]


def test_an_engine_step_admitting_prompts_of_one_length_attends_them_in_one_call(monkeypatch):
    """The engine's step hands side-by-side fresh prompts to the batched call, with the tokens of the per-prompt
    path."""
    from engine import Engine, EngineConfig
    from engine.attention import eager
    prompts = [[(7 * s + i) % 200 + 3 for i in range(20)] for s in range(5)]
    calls = []
    real = eager.fresh_prefill_attention
    monkeypatch.setattr(eager, "fresh_prefill_attention",
                        lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    batched = Engine(EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=256)).generate(prompts, 6)
    assert calls and calls[0] == 5 * 20  # five prompts in one call per layer
    monkeypatch.setattr(eager, "fresh_prefill_attention", lambda *a: (_ for _ in ()).throw(AssertionError))
    alone = [Engine(EngineConfig(block_size=4, num_blocks=64)).generate([p], 6)[0] for p in prompts]
    assert batched == alone

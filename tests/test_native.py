"""The native decode-attention kernel (engine/native/csrc/paged_decode.c through engine.native): it builds on this kind of
machine, equals dense attention wherever it answers, and the engine gives the same tokens when it cannot be built."""
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine import Engine, EngineConfig, attention, dense_attention, native, paged_attention


def _case(rng, lens, heads, kv_heads, dim, block_size, magnitude=1.0):
    """Caches with every sequence's K/V in randomly chosen blocks (random values everywhere else), tables with
    stale ids past each sequence's end, and the per-sequence K/V for the dense reference."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = torch.from_numpy(rng.standard_normal((num_blocks, block_size, kv_heads, dim), dtype=np.float32))
    value_cache = torch.from_numpy(rng.standard_normal((num_blocks, block_size, kv_heads, dim), dtype=np.float32))
    width = max(-(-n // block_size) for n in lens) + 1
    tables = torch.as_tensor(rng.integers(0, num_blocks, (len(lens), width)))  # stale ids past the end
    free = list(rng.permutation(num_blocks))
    keys, values = [], []
    for s, n in enumerate(lens):
        blocks = [int(free.pop()) for _ in range(-(-n // block_size))]
        tables[s, : len(blocks)] = torch.tensor(blocks)
        keys.append(key_cache[blocks].reshape(-1, kv_heads, dim)[:n])
        values.append(value_cache[blocks].reshape(-1, kv_heads, dim)[:n])
    query = torch.from_numpy(rng.standard_normal((len(lens), heads, dim), dtype=np.float32)) * magnitude
    return query, key_cache, value_cache, tables, torch.tensor(lens), keys, values


def test_the_kernel_builds_here():
    """This kind of machine has a C compiler: the default decode path must be the native one, not a silent
    fallback."""
    assert native.kernel() is not None, native.error()


@settings(max_examples=80, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    kv_heads=st.sampled_from([1, 2, 3, 4]),
    group=st.sampled_from([1, 2, 3, 8]),
    dim=st.sampled_from([8, 24, 32, 64, 80]),  # 8, 24 and 80: not whole 16-float vectors
    block_size=st.sampled_from([1, 3, 4, 16, 32]),
    threads=st.sampled_from([1, 2]),
    magnitude=st.sampled_from([1.0, 300.0]),  # 300: near one-hot softmax, must not overflow to NaN
    seed=st.integers(0, 2**16),
)
def test_native_equals_dense(lens, kv_heads, group, dim, block_size, threads, magnitude, seed):
    """Few sequences (one KV head an item) and many (whole sequences an item), on one thread and on two."""
    rng = np.random.default_rng(seed)
    query, key_cache, value_cache, tables, seq_lens, keys, values = _case(
        rng, lens, kv_heads * group, kv_heads, dim, block_size, magnitude)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.decode(query, key_cache, value_cache, tables, seq_lens, dim ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert out is not None
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(len(lens))])
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-5 if magnitude == 1.0 else 1e-3), (out - ref).abs().max()


def test_paged_attention_takes_the_kernel_and_leaves_other_inputs_to_the_eager_path(monkeypatch):
    """float32 on the CPU goes native; float16 and non-contiguous caches are answered by the eager path,
    with the same result to rounding."""
    calls = []  # whether the kernel answered each call
    decode = native.decode

    def counted(*args):
        out = decode(*args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(native, "decode", counted)
    rng = np.random.default_rng(3)
    query, key_cache, value_cache, tables, seq_lens, keys, values = _case(rng, [5, 40, 17], 8, 2, 16, 4)
    ref = torch.stack([dense_attention(query[s], keys[s], values[s]) for s in range(3)])
    assert torch.allclose(paged_attention(query, key_cache, value_cache, tables, seq_lens), ref, atol=1e-5)
    assert calls == [True]
    half = paged_attention(query.half(), key_cache.half(), value_cache.half(), tables, seq_lens)  # (bfloat16 has a
    #                                                              kernel of its own: tests/test_parity_bf16.py)
    strided = paged_attention(query, key_cache.transpose(0, 1).contiguous().transpose(0, 1),
                              value_cache, tables, seq_lens)
    assert calls == [True, False, False]
    assert torch.allclose(half.float(), ref, atol=5e-2) and torch.allclose(strided, ref, atol=1e-5)


def _outputs(model: str):
    eng = Engine(EngineConfig(model=model, block_size=4, num_blocks=256, seed=0))
    a = eng.add_conversation(prompt="The block table maps logical blocks", max_new_tokens=24)
    eng.add_conversation(prompt="Paging", max_new_tokens=30)
    eng.fork_conversation(a)
    for _ in range(6):
        eng.step()
    eng.relocate_blocks(seed=4)
    eng.run_until_idle()
    return [eng.conversation(i).output_token_ids for i in range(3)]


def test_a_failed_build_leaves_the_eager_path_with_the_same_tokens(monkeypatch, tmp_path, caplog):
    """With no working compiler the kernel is unavailable, says why once, and the engine decodes the same tokens
    through the eager path (greedy, the built-in model, a fork and blocks relocated mid-run)."""
    with_kernel = _outputs("builtin")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: "false")  # found on PATH, fails every build
    assert native.kernel() is None
    assert "failed" in native.error() and "native paged attention unavailable" in caplog.text
    assert not list(tmp_path.glob("*.so"))
    assert _outputs("builtin") == with_kernel


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_NATIVE", "0")
    assert native.kernel() is None and "PAGED_KV_NATIVE=0" in native.error()


def test_built_once_and_reused(monkeypatch, tmp_path):
    """A second process (here: a fresh state) loads the cached library instead of compiling again."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path))
    assert native.kernel() is not None
    built = list(tmp_path.glob("kernels-*.so"))
    assert len(built) == 1
    inode = built[0].stat().st_ino
    monkeypatch.setattr(native, "_state", {})
    runs, real_run = [], native.subprocess.run

    def run(cmd, **kw):
        runs.append(cmd)
        return real_run(cmd, **kw)
    monkeypatch.setattr(native.subprocess, "run", run)
    assert native.kernel() is not None
    assert runs and not [cmd for cmd in runs if "-o" in cmd] and built[0].stat().st_ino == inode


def test_loading_tidies_the_cache_of_stale_versions(monkeypatch, tmp_path):
    """Each version of the sources builds its own library: loading one marks it used and deletes other versions
    unused for STALE_DAYS and temporary files of builds killed a day ago or more; recent ones stay."""
    day = 86400
    files = {name: tmp_path / name for name in ("kernels-0ld.so", "kernels-recent.so", "tmpdead.so", "tmpbuilding.so",
                                                "notes.txt")}
    ages = {"kernels-0ld.so": 31 * day, "kernels-recent.so": 29 * day, "tmpdead.so": 2 * day, "tmpbuilding.so": 60,
            "notes.txt": 400 * day}
    now = time.time()
    for name, path in files.items():
        path.write_bytes(b"")
        os.utime(path, (now - ages[name], now - ages[name]))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path))
    assert native.kernel() is not None
    (loaded,) = [p for p in tmp_path.glob("kernels-*.so") if p not in files.values()]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [loaded.name, "kernels-recent.so", "tmpbuilding.so", "notes.txt"])
    os.utime(loaded, (now - 40 * day, now - 40 * day))  # loading again marks the library used now
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is not None
    assert loaded.is_file() and time.time() - loaded.stat().st_mtime < day


@pytest.mark.parametrize("one_call", [True, False])
def test_engine_decode_uses_the_kernel(monkeypatch, one_call):
    """The engine's decode steps go through the kernel, from Python layer by layer or inside the one-call step (the
    eager path is not called for decodes)."""
    calls = {"native": 0, "stack": 0, "eager": 0}
    decode, stack, eager = native.decode, native.decode_stack, attention.eager._paged_attention_eager
    monkeypatch.setattr(native, "decode", lambda *a: calls.__setitem__("native", calls["native"] + 1) or decode(*a))
    monkeypatch.setattr(native, "decode_stack",
                        lambda *a: calls.__setitem__("stack", calls["stack"] + 1) or (stack(*a) if one_call else None))
    monkeypatch.setattr(attention.eager, "_paged_attention_eager",
                        lambda *a: calls.__setitem__("eager", calls["eager"] + 1) or eager(*a))
    eng = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=64))
    eng.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=5)
    assert calls["stack"] == 4 and calls["eager"] == 0  # four decode steps after the prefill
    assert calls["native"] == (0 if one_call else 4 * eng.model.config.num_hidden_layers)


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 8, 4, 32), (70, 9, 3, 64), (200, 4, 1, 16), (5, 2, 2, 6)])
def test_rope_store_is_bit_identical_to_the_torch_form(tokens, heads, kv_heads, dim):
    """The rotated queries, and the rotated keys and values in their slots, equal apply_rotary and index_copy_ to
    the bit (so the native step changes no token and no K/V byte); slots not written keep their bytes."""
    from engine.model.causal_lm import Rotary, apply_rotary
    g = torch.Generator().manual_seed(tokens + dim)
    rotary = Rotary(dim, 10000.0, 512)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos, sin = rotary.cos_sin(positions, torch.float32)  # [tokens, 1, dim]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 5
    num_blocks, block_size = tokens // 4 + 3, 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    caches = [torch.randn(num_blocks, block_size, kv_heads, dim, generator=g) for _ in range(2)]
    expected = [c.clone() for c in caches]
    view = qkv.view(tokens, heads + 2 * kv_heads, dim)
    qk = apply_rotary(view[:, : heads + kv_heads], cos, sin)
    expected[0].view(-1, kv_heads, dim).index_copy_(0, slots, qk[:, heads:])
    expected[1].view(-1, kv_heads, dim).index_copy_(0, slots, view[:, heads + kv_heads:])
    q = native.rope_store(qkv, cos, sin, slots, caches[0], caches[1], heads, kv_heads)
    assert q is not None
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_without_the_kernel_each_layer_projects_once(monkeypatch):
    """Where rope_store does not serve (here: unavailable), a layer's fused q/k/v projection still runs once (in the
    layer-by-layer loop: the one-call decode step, which takes rope_store's C function itself, is off)."""
    from engine.model import causal_lm as model
    monkeypatch.setattr(native, "rope_store", lambda *a: None)
    monkeypatch.setattr(native, "decode_stack", lambda *a: None)
    calls = []
    call = model.InferenceLinear.__call__
    monkeypatch.setattr(model.InferenceLinear, "__call__", lambda self, x: calls.append(self) or call(self, x))
    eng = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=64))
    eng.generate([[1, 2, 3]], max_new_tokens=2)
    layers = eng.model.model.layers
    qkv_calls = [c for c in calls if any(c is layer.self_attn.qkv for layer in layers)]
    steps = eng.num_steps
    assert len(qkv_calls) == steps * len(layers)


def test_a_read_only_cache_folder_builds_in_the_temporary_folder(monkeypatch, tmp_path):
    """A cache folder that cannot be written (a read-only home) does not cost the kernel: it is built in a folder of
    the user's under the temporary directory."""
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")  # a file where the folder should be: mkdir fails, as on a read-only home
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(blocked / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert native.kernel() is not None, native.error()
    assert list((tmp_path / "tmp").glob("paged-kv-explorer-*/kernels-*.so"))


def test_a_cache_that_cannot_be_tidied_still_loads(monkeypatch, tmp_path):
    """Tidying is best effort: where the library's time cannot be set or a stale file cannot be deleted (a folder
    shared read-only, another process deleting first), the kernel still loads and the stale file stays."""
    stale = tmp_path / "kernels-stale.so"
    stale.write_bytes(b"")
    old = time.time() - 40 * 86400
    os.utime(stale, (old, old))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path))

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")
    monkeypatch.setattr(native.os, "utime", refuse)
    assert native.kernel() is not None, native.error()
    assert stale.is_file()
    monkeypatch.undo()  # and with deletion refused but the time settable
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path))
    monkeypatch.setattr(type(stale), "unlink", refuse)
    assert native.kernel() is not None, native.error()
    assert stale.is_file()


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the last place of the larger magnitude (float32: 2^-23 relative)."""
    scale = torch.maximum(got.abs(), want.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((got - want).abs() / (scale * 2.0 ** -23)).max())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), n=st.sampled_from([1, 5, 16, 17, 256, 576, 1000]), with_delta=st.booleans(),
       magnitude=st.sampled_from([1e-3, 1.0, 40.0]), seed=st.integers(0, 2**16))
def test_add_rms_norm_is_the_torch_form_to_a_few_ulps(rows, n, with_delta, magnitude, seed):
    """x += delta is exact (x is updated in place, as the engine's residual stream is); the norm is torch's RMSNorm
    (HF's form) within 4 units in the last place; 300 rows also takes the threaded path."""
    from engine.model.causal_lm import RMSNorm
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * magnitude
    delta = torch.randn(rows, n, generator=g) * magnitude if with_delta else None
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = torch.randn(n, generator=g)
    with torch.inference_mode():
        summed = x + delta if with_delta else x.clone()
        want = norm(summed)
        got = native.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert got is not None
    assert torch.equal(x, summed)
    assert _ulps(got, want) <= 4


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), n=st.sampled_from([1, 7, 16, 33, 688, 1536]), magnitude=st.sampled_from([0.1, 4.0, 60.0]),
       seed=st.integers(0, 2**16))
def test_silu_mul_is_the_torch_form_to_a_few_ulps(rows, n, magnitude, seed):
    """silu(gate) * up of the fused gate|up projection, within 4 units in the last place of torch's; large
    negative gates (e^-g overflows in the naive form) give products under 1e-30 (torch's: 0), never NaN."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * n, generator=g) * magnitude
    gate, up = gate_up.chunk(2, dim=-1)
    got = native.silu_mul(gate_up)
    assert got is not None and got.shape == (rows, n)
    want = torch.nn.functional.silu(gate) * up
    assert torch.isfinite(got).all()
    normal = want.abs() > 1e-30
    assert not normal.any() or _ulps(got[normal], want[normal]) <= 4
    assert bool(((got - want).abs()[~normal] <= 1e-30).all())


def test_norm_and_activation_kernels_leave_other_inputs_to_torch():
    """Tensors the kernels cannot read as raw float32 rows, or that autograd follows, get None, and x is untouched."""
    x = torch.randn(4, 8)
    w = torch.ones(8)
    before = x.clone()
    assert native.add_rms_norm(x.double(), None, w.double(), 1e-6) is None
    assert native.add_rms_norm(x.t(), None, w[:4], 1e-6) is None  # not contiguous
    assert native.add_rms_norm(x, torch.randn(4, 7), w, 1e-6) is None  # delta of another shape
    assert native.add_rms_norm(x, torch.randn(4, 8, requires_grad=True), w, 1e-6) is None
    assert native.add_rms_norm(x[None], None, w, 1e-6) is None  # rows are 2-D
    assert torch.equal(x, before)
    assert native.silu_mul(torch.randn(4, 7)) is None  # odd width: no gate|up halves
    assert native.silu_mul(torch.randn(4, 8, requires_grad=True)) is None


def test_engine_tokens_equal_with_and_without_the_norm_and_activation_kernels(monkeypatch):
    """The engine's layers take the kernels, and greedy tokens are the same as with torch's forms (the layer-by-layer
    loop: the one-call decode step, which takes the kernels' C functions itself, is off)."""
    from engine.model import causal_lm as model
    monkeypatch.setattr(native, "decode_stack", lambda *a: None)
    calls = {"norm": 0, "silu": 0}
    norm, silu = native.add_rms_norm, native.silu_mul
    monkeypatch.setattr(native, "add_rms_norm", lambda *a: calls.__setitem__("norm", calls["norm"] + 1) or norm(*a))
    monkeypatch.setattr(native, "silu_mul", lambda *a: calls.__setitem__("silu", calls["silu"] + 1) or silu(*a))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [5] * 40]
    eng = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=64))
    with_kernels = eng.generate(prompts, max_new_tokens=12)
    layers = len(eng.model.model.layers)
    assert calls["norm"] == eng.num_steps * (2 * layers + 1) and calls["silu"] == eng.num_steps * layers
    monkeypatch.setattr(native, "add_rms_norm", lambda *a: None)
    monkeypatch.setattr(native, "silu_mul", lambda *a: None)
    eng = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=64))
    assert eng.generate(prompts, max_new_tokens=12) == with_kernels
    assert model.RMSNorm  # the torch form served the second run


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), n=st.sampled_from([1, 47, 48, 258, 512, 1000]),
       k=st.sampled_from([1, 16, 33, 63, 64, 65, 256, 688]), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_panel_linear_is_x_w_t_plus_b(rows, n, k, with_bias, seed):
    """The panel kernel computes F.linear (float64 reference) to float32 accuracy for any row count (tiles of 8,
    and a last partial one), outputs that fill no whole panel of 48, input widths around its blocks of 64, with and
    without a bias."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = native.panel_linear(x, native.pack_panels(w), n, bias)
    assert got is not None and got.shape == (rows, n)
    want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    scale = x.double().abs() @ w.double().abs().t()  # the sum of |terms|: the scale of the rounding errors
    if bias is not None:
        scale += bias.double().abs()
    assert float(((got.double() - want).abs() / scale.clamp_min(1e-30)).max()) <= (k + 1) * 2.0 ** -23


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # small_gemm.c, small_gemm_bf16.c
def test_panel_linear_rows_do_not_depend_on_the_batch_or_the_threads(dtype):
    """Every output is summed by one thread in k order: a row's result is the same bits alone, among 16 or 40 other
    rows, and with one thread or two (so a conversation's tokens do not depend on who else is decoding)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1376, 256, generator=g).to(dtype)
    panels = native.pack_panels(w)
    x = torch.randn(40, 256, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = native.panel_linear(x, panels, 1376, None)
        torch.set_num_threads(1)
        single = native.panel_linear(x, panels, 1376, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, single)
    for lo, hi in ((0, 1), (5, 21), (7, 8), (24, 40)):
        assert torch.equal(native.panel_linear(x[lo:hi].contiguous(), panels, 1376, None), whole[lo:hi])


def test_panel_linear_leaves_other_inputs_to_torch():
    w = torch.randn(50, 8)
    panels = native.pack_panels(w)
    assert panels is not None and panels.shape == (2, 8, 48) and torch.equal(panels[1, :, 2:], torch.zeros(8, 46))
    assert torch.equal(panels[0], w[:48].t()) and torch.equal(panels[1, :, :2], w[48:].t())
    assert native.panel_linear(torch.randn(3, 8).double(), panels, 50, None) is None
    assert native.panel_linear(torch.randn(8, 3).t(), panels, 50, None) is None  # not contiguous
    assert native.panel_linear(torch.randn(3, 9), panels, 50, None) is None  # another input width
    assert native.panel_linear(torch.randn(3, 8, requires_grad=True), panels, 50, None) is None
    assert native.panel_linear(torch.randn(3, 8), panels, 97, None) is None  # more outputs than the panels hold
    assert native.panel_linear(torch.randn(3, 8), panels, 50, torch.randn(49)) is None  # a bias of another length
    assert native.pack_panels(w.double()) is None


def _rows_through(monkeypatch, name: str) -> list[int]:
    """Record the row count of every call to ``native.<name>`` (which still runs)."""
    rows: list[int] = []
    real = getattr(native, name)
    monkeypatch.setattr(native, name, lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    return rows


def test_decode_batches_take_the_panel_kernel_up_to_a_row_limit_that_depends_on_the_cache_with_the_same_tokens(
        monkeypatch):
    """Every linear gets panels. Where the weights fit in the last-level cache (the built-in model's 12 MB) the
    one-call step takes 1-64 rows; where they do not (here the built-in model against a cache said to be 1 MiB),
    1-16 rows. The panels serve 1-64 rows in both (they are the weights' only copy: issue 49); more rows (a prefill)
    take oneDNN or F.linear. Greedy tokens equal those without panels (pack_panels unavailable)."""
    from engine.model import causal_lm as model
    served = _rows_through(monkeypatch, "panel_linear")
    monkeypatch.setattr(native, "decode_stack", lambda *a: None)  # the loop, whose linears are counted here
    prompts = [[3 + i, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(12)] + [[5] * 40]
    crowd = [[7 + i % 200, 8, 9] for i in range(40)]

    def linears(eng):
        return [eng.model.head] + [m for layer in eng.model.model.layers for m in
                                   (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down)]

    def run(eng):
        return eng.generate(prompts, max_new_tokens=10), eng.generate(crowd, max_new_tokens=5)

    pack_panels = native.pack_panels
    monkeypatch.setattr(native, "pack_panels", lambda w: None)
    plain = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=128))
    assert all(isinstance(m, model.InferenceLinear) and m.panels is None and m.panel_rows == 0
               for m in linears(plain))
    without = run(plain)
    assert not served
    monkeypatch.setattr(native, "pack_panels", pack_panels)
    cached = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=128))
    assert all(m.panels is not None and m.panel_rows == 64 for m in linears(cached))
    assert run(cached) == without
    assert set(served) <= set(range(1, 65)) and {13, 40} <= set(served)  # 40: the crowd's decode batches
    served.clear()
    streamed = _panelled_engine(monkeypatch)
    assert all(m.panels is not None and m.panel_rows == 16 for m in linears(streamed))
    assert run(streamed) == without
    assert set(served) <= set(range(1, 65)) and {13, 40} <= set(served)  # past the step's 16 rows too


@pytest.mark.parametrize("with_panels", [True, False])
def test_a_linear_takes_no_rows_with_or_without_panels(monkeypatch, with_panels):
    """No rows (the logits of a prefill chunk that ends no prompt): an empty result, also where panels were asked
    for but could not be made (the panel kernel unavailable)."""
    from engine.model import causal_lm as model
    if not with_panels:
        monkeypatch.setattr(native, "pack_panels", lambda w: None)
    served = _rows_through(monkeypatch, "panel_linear")
    w = torch.randn(50, 16)
    linear = model.InferenceLinear(w, pack=True, panel_rows=64)
    assert (linear.panels is not None) == with_panels and linear.panel_rows == (64 if with_panels else 0)
    assert linear(torch.empty(0, 16)).shape == (0, 50)
    assert not served  # no rows: not the panel kernel's (without panels it would be handed None for them)
    x = torch.randn(3, 16)
    assert torch.allclose(linear(x), x @ w.T, atol=1e-5)


def test_last_level_cache_size_is_the_largest_linux_lists(tmp_path):
    for name, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K"), ("index4", "odd")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    assert native.last_level_cache_bytes(tmp_path) == 32 << 20
    assert native.last_level_cache_bytes(tmp_path / "none") == 32 << 20  # not listed: 32 MiB
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "size").write_text("2M")
    assert native.last_level_cache_bytes(tmp_path) == 32 << 20 and native.last_level_cache_bytes() >= 1 << 20


def _panelled_engine(monkeypatch, **kw):
    """The built-in model treated as larger than the cache (1 MiB), so that its linears' panels serve 1-16 rows
    (not 1-64)."""
    monkeypatch.setattr(native, "last_level_cache_bytes", lambda *a: 1 << 20)
    return Engine(EngineConfig(model="builtin", **{"block_size": 16, "num_blocks": 128, **kw}))


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])  # the pool: the activations' dtype, or fp8
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # decode_stack_f32 / decode_stack_bf16
@pytest.mark.parametrize("streamed,conversations", [(True, 12), (False, 50)])
def test_the_one_call_decode_step_gives_the_same_bits_as_the_layer_by_layer_loop(monkeypatch, streamed,
                                                                                   conversations, dtype, kv):
    """native.decode_stack runs the kernels the Python loop runs, in the same order: the same tokens, and the same
    K/V bits in every layer, with a block size that splits blocks and a fork sharing a prefix; for batches of up to
    16 rows (weights larger than the cache) and up to 64 (weights in the cache); in float32 and in bfloat16 (the
    bfloat16 kernels: decode_stack.c's walk over them); over a pool of the activations' dtype and over fp8 pools
    with scales other than 1 (K's in the softmax scale and the cache write, V's in the write and on the output)."""
    from engine.kv.fp8 import KVScales
    calls = _rows_through(monkeypatch, "decode_stack")
    prompts = [[3 + i, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(conversations)] + [[5] * 40]
    results = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(native, "decode_stack", lambda *a: None)
        eng = _panelled_engine(monkeypatch, block_size=4, num_blocks=512, dtype=dtype, kv_cache_dtype=kv) \
            if streamed else Engine(EngineConfig(model="builtin", block_size=4, num_blocks=512, dtype=dtype,
                                                 kv_cache_dtype=kv))
        layers = len(eng.model.model.layers)
        if kv != "auto":
            eng.model.set_kv_scales(KVScales((0.5, 3.0) * (layers // 2), (2.0, 0.75) * (layers // 2)))
        assert eng.model.stack is not None and eng.model.stack.shape == (layers, 8)
        assert eng.kv.data.dtype == (getattr(torch, dtype) if kv == "auto" else eng.kv_dtype)
        assert eng.model.panel_rows == (16 if streamed else 64)
        tokens = eng.generate(prompts, max_new_tokens=10)
        parent = eng.add_conversation(prompt_token_ids=[9, 8, 7, 6, 5], max_new_tokens=6)
        eng.step()
        eng.fork_conversation(parent)
        eng.run_until_idle()
        results.append((tokens, [c.output_token_ids for c in eng.snapshot().conversations], eng.kv.data.clone()))
    assert calls and set(calls) <= set(range(1, eng.model.panel_rows + 1)) and conversations + 1 in calls
    assert results[0][:2] == results[1][:2] and torch.equal(results[0][2], results[1][2])


def test_the_one_call_decode_step_is_taken_only_where_the_loop_would_take_the_same_kernels(monkeypatch):
    """Not for prefill chunks, a layer hook (the relocation probe), attention other than the native kernel, or more
    rows than the panels serve (then oneDNN's: 64 where the weights fit the cache, 16 where they do not); not for a
    model without panels."""
    from engine import attention
    calls = _rows_through(monkeypatch, "decode_stack")
    small = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=512))
    small.generate([[1, 2, 3, 4, 5]] * 70, max_new_tokens=3)  # 70 rows: oneDNN, so the loop
    assert not calls
    small.generate([[1, 2, 3, 4, 5]] * 64, max_new_tokens=3)
    assert calls == [64, 64]
    calls.clear()
    pack_panels = native.pack_panels
    monkeypatch.setattr(native, "pack_panels", lambda w: None)
    assert Engine(EngineConfig(model="builtin", block_size=16, num_blocks=128)).model.stack is None
    monkeypatch.setattr(native, "pack_panels", pack_panels)
    eng = _panelled_engine(monkeypatch, num_blocks=512)
    eng.generate([[1, 2, 3, 4, 5]] * 20, max_new_tokens=3)  # 20 rows: oneDNN, so the loop
    assert not calls
    eng.generate([[1, 2, 3, 4, 5]], max_new_tokens=3)  # a prefill, then decodes of one row
    assert calls == [1, 1]
    calls.clear()
    eng.add_conversation(prompt_token_ids=[4, 5, 6], max_new_tokens=3)
    eng.step()
    assert eng.probe_attention() and not calls  # the probe hooks every layer: the loop
    previous = attention.use_native_kernel(False)
    try:
        eng.run_until_idle()
        assert not calls
    finally:
        attention.use_native_kernel(previous)
    assert not attention.decodes_natively(attention.attend_batch_compiled)


def test_a_fault_inside_the_one_call_decode_step_changes_nothing(monkeypatch):
    """decode_stack writing K/V in some layers and then failing (an exception after the real call, which has written
    every layer's K/V): the step raises, the pool and the K/V are as before, and after running on, every
    conversation's tokens equal a clean run's."""
    from test_engine import _pool_state
    stack = native.decode_stack

    def run(fault: bool):
        eng = _panelled_engine(monkeypatch, block_size=4, num_blocks=128)
        for p in ([1, 2, 3, 4, 5, 6], [7, 8, 9]):
            eng.add_conversation(prompt_token_ids=p, max_new_tokens=12)
        for _ in range(3):
            eng.step()
        if fault:
            def boom(*a):
                stack(*a)
                raise MemoryError("injected: decode step out of memory midway")
            monkeypatch.setattr(native, "decode_stack", boom)
            before = _pool_state(eng), eng.kv.data.clone(), eng.step_id
            with pytest.raises(Exception, match="injected"):
                eng.step()
            assert _pool_state(eng) == before[0] and torch.equal(eng.kv.data, before[1]) and eng.step_id == before[2]
            monkeypatch.setattr(native, "decode_stack", stack)
        eng.run_until_idle()
        return [c.output_token_ids for c in eng.snapshot().conversations]

    assert run(fault=True) == run(fault=False)


def test_the_one_call_decode_step_refuses_tensors_it_cannot_index_before_writing_anything():
    """Caches of another layout than the shape says (or K and V of two dtypes), a weights table of another width or
    length, slots that are not int64, a scales table of another length: None, and x (the residual stream it would
    update in place) untouched."""
    x = torch.randn(2, 8)
    before = x.clone()
    cache = torch.zeros(4, 16, 2, 4)  # [blocks, block_size, kv_heads, dim]
    args = dict(final_norm=torch.ones(8), cos=torch.ones(2, 4), sin=torch.zeros(2, 4),
                slots=torch.tensor([0, 1]), tables=torch.zeros(2, 1, dtype=torch.int64),
                seq_lens=torch.ones(2, dtype=torch.int64), eps=1e-6,
                layer_scales=torch.tensor([[0.5, 1.0, 1.0, 1.0]]))
    shape = (2, 2, 4, 16, 16)  # heads, kv_heads, dim, intermediate, block_size
    weights = torch.zeros(1, native.STACK_FIELDS, dtype=torch.int64)
    assert native.decode_stack(x, weights, [(cache, cache)], shape=(2, 1, 4, 16, 16), **args) is None
    assert native.decode_stack(x, weights, [(cache, cache)], shape=(2, 2, 4, 16, 8), **args) is None
    assert native.decode_stack(x, weights, [(cache, cache[:2])], shape=shape, **args) is None
    assert native.decode_stack(x, torch.zeros(1, 7, dtype=torch.int64), [(cache, cache)], shape=shape, **args) is None
    assert native.decode_stack(x, weights, [(cache, cache)] * 2, shape=shape, **args) is None
    assert native.decode_stack(x, weights, [(cache, cache)], shape=shape,
                               **{**args, "slots": torch.tensor([0, 1], dtype=torch.int32)}) is None
    assert native.decode_stack(x, weights, [(cache, cache)], shape=shape,
                               **{**args, "layer_scales": torch.ones(2, 4)}) is None  # one row per layer
    assert native.decode_stack(x, weights, [(cache, cache.to(torch.bfloat16))], shape=shape, **args) is None
    assert torch.equal(x, before)


KINDS = [(torch.float32, torch.float32), (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
         (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)]


def _stored(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 cache as a pool of ``dtype`` stores it (fp8: vLLM's cache write)."""
    from engine.kv.fp8 import quantize
    return quantize(cache, dtype) if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache.to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=20),
    window=st.integers(1, 120),
    block_size=st.sampled_from([1, 3, 16, 32]),
    dim=st.sampled_from([8, 32, 80]),
    threads=st.sampled_from([1, 2]),
    kinds=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
)
def test_native_window_equals_dense_over_the_window(lens, window, block_size, dim, threads, kinds, seed):
    """The kernel with a sliding window, for every pair of query and pool dtypes it takes (one walk: csrc/
    paged_decode.c): positions > p - window only, the blocks before them never read (their entries are -1 here: a
    read would fault or give garbage); the pool's stored values read exactly (fp8 included), float32 sums, a
    bfloat16 output rounded once."""
    q_dtype, kv_dtype = kinds
    rng = np.random.default_rng(seed)
    query, key_cache, value_cache, tables, seq_lens, keys, values = _case(rng, lens, 4, 2, dim, block_size)
    query, key_cache, value_cache = query.to(q_dtype), _stored(key_cache, kv_dtype), _stored(value_cache, kv_dtype)
    for s, n in enumerate(lens):
        tables[s, : max(0, n - window) // block_size] = -1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native.decode(query, key_cache, value_cache, tables, seq_lens, dim ** -0.5, window)
    finally:
        torch.set_num_threads(before)
    assert out is not None and out.dtype == q_dtype
    ref = []
    for s, n in enumerate(lens):
        blocks = tables[s, : -(-n // block_size)].clamp_min(0)
        k = key_cache.float()[blocks].reshape(-1, 2, dim)[max(0, n - window):n]
        v = value_cache.float()[blocks].reshape(-1, 2, dim)[max(0, n - window):n]
        ref.append(dense_attention(query[s].float(), k, v))
    ref = torch.stack(ref)
    tolerance = 1e-5 if q_dtype == torch.float32 else 2e-2  # bfloat16: the weights and the output rounded
    assert torch.allclose(out.float(), ref, atol=tolerance, rtol=tolerance), (out.float() - ref).abs().max()


def test_windowed_engines_decode_natively_and_a_one_group_window_in_one_call(monkeypatch, tmp_path):
    """A model with a sliding group takes the native kernel with its window; a model of one group, every layer
    sliding, takes the one-call decode step with it (the same tokens as the layer-by-layer loop); a model of two
    groups (their own tables) never takes the one-call step."""
    from tests.test_groups import S, write_mixed_checkpoint
    windows, stacks = [], []
    real, real_stack = native.decode, native.decode_stack
    monkeypatch.setattr(native, "decode", lambda *a: windows.append(a[6] if len(a) > 6 else None) or real(*a))
    monkeypatch.setattr(native, "decode_stack", lambda *a: stacks.append(a[-1]) or real_stack(*a))
    eng = Engine(EngineConfig(model=str(write_mixed_checkpoint(tmp_path / "m", window=8)), block_size=4,
                              num_blocks=64))
    eng.generate([list(range(1, 20))], max_new_tokens=6)
    assert 8 in windows and None in windows and not stacks
    path = write_mixed_checkpoint(tmp_path / "s", window=8, layer_types=(S, S, S))
    prompts = [list(range(1, 20)), list(range(30, 41))]
    one_call = Engine(EngineConfig(model=str(path), block_size=4, num_blocks=64)).generate(prompts, max_new_tokens=12)
    assert stacks and set(stacks) == {8}
    monkeypatch.setattr(native, "decode_stack", lambda *a: None)
    assert Engine(EngineConfig(model=str(path), block_size=4, num_blocks=64)).generate(
        prompts, max_new_tokens=12) == one_call


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), n=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 69),
                                   st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 9.0])),
                         max_size=6))
def test_argmax_rows_answers_as_torch_argmax_with_ties_and_nans(rows, n, seed, specials):
    """Greedy decoding's argmax (csrc/argmax.c): the first index of each row's largest value, the first NaN's where a
    row holds one, as torch.argmax(dim=-1). Values are drawn from a few levels, so ties are common."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.integers(-3, 4, (rows, n)).astype(np.float32))
    for r, c, value in specials:
        if r < rows and c < n:
            logits[r, c] = value
    assert native.argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    tokens, broken = native.argmax_checked(logits)  # the engine's check before sampling, from the same pass
    assert tokens == logits.argmax(dim=-1).tolist()
    assert broken == frozenset(torch.nonzero(~torch.isfinite(logits).all(-1)).flatten().tolist())


def test_argmax_checked_finds_every_non_finite_value_wherever_it_lies():
    """An infinity or a NaN at any place of a row (the first vector, later ones, the tail past the last whole
    vector) marks that row only."""
    for n in (1, 15, 16, 17, 33, 49152):
        for place in sorted({0, n // 2, n - 1, min(15, n - 1), min(16, n - 1)}):
            for value in (float("inf"), -float("inf"), float("nan")):
                rows = torch.randn(3, n)
                rows[1, place] = value
                assert native.argmax_checked(rows)[1] == {1}, (n, place, value)
        assert native.argmax_checked(torch.randn(3, n))[1] == frozenset()


def test_argmax_rows_at_a_vocabulary_and_where_it_declines():
    logits = torch.randn(16, 49152)
    logits[3, 40000] = logits[3, 7] = logits.max() + 1  # a tie across vectors: the earlier wins
    logits[9, 30001] = float("nan")
    assert native.argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    for n in (15, 16, 17, 33, 48):  # one NaN, or one largest value, at every place of a row (vector lanes, tail)
        for place in range(n):
            for value in (float("nan"), 5.0):
                row = torch.zeros(2, n)
                row[1, place] = value
                assert native.argmax_rows(row) == row.argmax(dim=-1).tolist(), (n, place, value)
    assert native.argmax_rows(torch.zeros(0, 5)) == []
    for other in (logits.double(), logits.to(torch.bfloat16), logits[:, ::2], logits[0]):
        assert native.argmax_rows(other) is None  # another dtype, a strided view, one row: torch's argmax answers


def test_team_size_takes_the_faster_and_tries_the_other_now_and_then():
    """engine.native.TeamSize: both sizes are tried first, then the one with the lower running average serves, and
    every TEAM_PROBE_EVERY-th step tries the other again, so a machine that gets busier (or quieter) is followed."""
    sizes = native.TeamSize()
    seconds = {2: 0.010, 1: 0.030}  # two threads faster
    taken = []
    for _ in range(3 * native.TEAM_PROBE_EVERY):
        threads = sizes.choose(16, 2)
        taken.append(threads)
        sizes.record(16, 2, threads, seconds[threads])
    assert taken[:2] == [2, 1] and taken.count(1) == 1 + 3  # the first try, then one probe per 64 steps
    seconds = {2: 0.090, 1: 0.030}  # the machine got busy: one thread is now faster
    for _ in range(native.TEAM_PROBE_EVERY):
        threads = sizes.choose(16, 2)
        sizes.record(16, 2, threads, seconds[threads])
    assert sizes.choose(16, 2) == 1 and sizes.averages(16, 2)[2] > sizes.averages(16, 2)[1]
    assert sizes.choose(4, 1) == 1  # one thread to give: nothing to choose


def test_the_one_call_step_gives_the_same_bits_on_one_thread_and_on_two(monkeypatch):
    """The step's kernels are cut into parts that either thread takes: the tokens and the K/V written do not depend
    on how many threads there were."""
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(native.team_size, "choose", lambda rows, most, threads=threads: threads)
        eng = Engine(EngineConfig(model="builtin", block_size=4, num_blocks=512))
        tokens = eng.generate([[3 + i, 4, 5, 6, 7, 8 + i] for i in range(20)], max_new_tokens=12)
        results.append((tokens, eng.kv.data.clone()))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])

"""The bfloat16 panel GEMM (engine/native/csrc/small_gemm_bf16.c through engine.native): its packed layout, its sums (float32,
the bias added in float32, rounded to bfloat16 once: in vdpbf16ps's order, or in AMX tiles where the machine has
them, which give oneDNN's bits; its independence from the batch and the threads: tests/test_native.py), what it
leaves to torch, and the engine's bfloat16 decode batches taking it."""
import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine import Engine, EngineConfig, native

needs_amx = pytest.mark.skipif(not native.bf16_amx(), reason="the AMX walk needs a CPU with AMX-BF16 (lscpu: "
                               "amx_bf16) and Linux 5.16 or later")


@contextlib.contextmanager
def _walk(amx: bool):
    """The panel GEMM's AMX walk on (where there is one) or off, for the block."""
    previous = native.use_bf16_amx(amx)
    try:
        yield
    finally:
        native.use_bf16_amx(previous)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b as the kernel sums it: per output one float32 sum over the pairs of inputs in order, the odd input's
    product added before the even one's (vdpbf16ps's order; each product of two bfloat16 values is exact in
    float32), the bias added in float32, then one rounding to bfloat16."""
    xf, wf = x.float(), w.float()
    k = x.shape[1]
    acc = torch.zeros(x.shape[0], w.shape[0])
    for pair in range(0, k, 2):
        for i in ((pair + 1, pair) if pair + 1 < k else (pair,)):
            acc = acc + xf[:, i:i + 1] * wf[:, i][None, :]
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


def test_bfloat16_weights_are_packed_in_pairs_of_inputs_for_each_of_48_outputs():
    w = torch.randn(50, 5).bfloat16()
    panels = native.pack_panels(w)
    assert panels is not None and panels.dtype == torch.bfloat16 and panels.shape == (2, 3, 48, 2)
    for p in range(2):
        for j in range(3):
            for o in range(48):
                for t in range(2):
                    row, col = 48 * p + o, 2 * j + t
                    want = w[row, col] if row < 50 and col < 5 else 0
                    assert panels[p, j, o, t] == want, (p, j, o, t)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 64), n=st.sampled_from([1, 47, 48, 100, 258]),
       k=st.sampled_from([1, 2, 33, 64, 65, 128, 129, 200]), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_bfloat16_panel_linear_sums_in_float32_and_rounds_once(rows, n, k, with_bias, seed):
    """The vdpbf16ps walk: the same bits as one float32 sum per output in vdpbf16ps's order, rounded once: for any
    row count (tiles of 8 and a partial one), outputs that fill no whole panel, odd input widths and widths around
    its blocks of 64 pairs, with and without a bias."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    with _walk(False):
        got = native.panel_linear(x, native.pack_panels(w), n, bias)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, _reference(x, w, bias))


@needs_amx
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 64), k=st.sampled_from([1, 2, 5, 31, 33, 65, 130, 200, 688]), n=st.sampled_from([1, 100]),
       seed=st.integers(0, 2**16))
def test_the_amx_walk_reads_zeros_past_the_inputs(rows, k, n, seed):
    """Widths of no whole number of 16-pair steps (odd ones, the 3M config's 688): the AMX walk's last step adds
    only zero products past K, so the bits are those of the same product with x and W padded by zero inputs to the
    next multiple of 32, which the walk takes in whole steps; rows past a whole tile of 16 come from a padded copy."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    width = -(-k // 32) * 32
    x_wide, w_wide = torch.zeros(rows, width, dtype=torch.bfloat16), torch.zeros(n, width, dtype=torch.bfloat16)
    x_wide[:, :k], w_wide[:, :k] = x, w
    with _walk(True):
        got = native.panel_linear(x, native.pack_panels(w), n, None)
        assert torch.equal(got, native.panel_linear(x_wide, native.pack_panels(w_wide), n, None))
    ulp = torch.finfo(torch.bfloat16).eps * got.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert bool(((got.float() - _reference(x, w, None).float()).abs() <= ulp).all())


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 29, 32])
def test_the_amx_walk_gives_f_linears_bits_for_the_135m_shapes_at_decode_rows(rows):
    """The AMX walk sums each row's 16-pair steps in order in the tile unit, as oneDNN's AMX GEMM (what F.linear and
    so transformers' bfloat16 run reach on such a machine) does for the 135M shape's (SmolLM2's) linears at a decode
    step's rows: up to 32 (a whole tile and one padded from a copy), with and without a bias, the same bits as
    F.linear. oneDNN picks its kernel by shape: above 32 rows, for a single output, or at some other shapes (17 or
    32 outputs of 1,536 inputs at 29-32 rows, widths such as 66 or 130) a few outputs part by one unit in the last
    place; the within-a-unit test above covers those."""
    g = torch.Generator().manual_seed(rows)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        x, w = torch.randn(rows, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        for bias in (None, torch.randn(n, generator=g).bfloat16()):
            with _walk(True):
                got = native.panel_linear(x, native.pack_panels(w), n, bias)
            assert torch.equal(got, torch.nn.functional.linear(x, w, bias)), (n, k, bias is None)


@needs_amx
def test_the_amx_walk_can_be_turned_off_and_on():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 576, generator=g).bfloat16(), (torch.randn(960, 576, generator=g) * 0.1).bfloat16()
    panels = native.pack_panels(w)
    assert native.bf16_amx()
    assert native.use_bf16_amx(False) is True and not native.bf16_amx()
    try:
        vdp = native.panel_linear(x, panels, 960, None)
    finally:
        assert native.use_bf16_amx(True) is False
    assert native.bf16_amx()
    assert torch.equal(vdp, _reference(x, w, None))
    amx = native.panel_linear(x, panels, 960, None)
    assert not torch.equal(amx, vdp)  # another order of sums: some outputs part by a unit in the last place
    assert torch.equal(amx, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (1376, 256)])
def test_bfloat16_panel_linear_is_f_linear_to_a_unit_in_the_last_place(n, k, amx):
    """Against F.linear (oneDNN's bfloat16 GEMM, what transformers' bfloat16 run reaches), which may sum in another
    order: at most one unit in the last place apart, and in few outputs (measured: 0.002-0.02%), by either walk."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(16, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    with _walk(amx):
        got = native.panel_linear(x, native.pack_panels(w), n, bias)
    want = torch.nn.functional.linear(x, w, bias)
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert float((got != want).float().mean()) < 1e-3


def test_bfloat16_panel_linear_leaves_other_inputs_to_torch():
    w = torch.randn(50, 8).bfloat16()
    panels = native.pack_panels(w)
    x = torch.randn(3, 8).bfloat16()
    assert native.panel_linear(x, panels, 50, None) is not None
    assert native.panel_linear(torch.randn(65, 8).bfloat16(), panels, 50, None) is None  # more rows than it takes
    assert native.panel_linear(x.float(), panels, 50, None) is None  # float32 rows, bfloat16 panels
    assert native.panel_linear(x, native.pack_panels(w.float()), 50, None) is None  # bfloat16 rows, float32 panels
    assert native.panel_linear(torch.randn(8, 3).bfloat16().t(), panels, 50, None) is None  # not contiguous
    assert native.panel_linear(torch.randn(3, 10).bfloat16(), panels, 50, None) is None  # another input width
    assert native.panel_linear(torch.randn(3, 8).bfloat16().requires_grad_(), panels, 50, None) is None
    assert native.panel_linear(x, panels, 97, None) is None  # more outputs than the panels hold
    assert native.panel_linear(x, panels, 50, torch.randn(49).bfloat16()) is None  # a bias of another length
    assert native.panel_linear(x, panels, 50, torch.randn(50)) is None  # a float32 bias
    previous = native.use_bf16_gemm(False)
    try:
        assert native.panel_linear(x, panels, 50, None) is None  # turned off: oneDNN / F.linear serve
    finally:
        native.use_bf16_gemm(previous)


def test_bfloat16_decode_batches_take_the_panel_gemm(monkeypatch):
    """A bfloat16 engine's decode steps run every linear through the bfloat16 panel GEMM (the built-in model fits in
    the cache: up to 64 rows), and its prefill (more rows) through oneDNN or F.linear; greedy tokens are those of
    the engine with the kernel turned off, for this model's 12 tokens."""
    rows: list[int] = []
    real = native._panel_linear_bf16
    monkeypatch.setattr(native, "_panel_linear_bf16", lambda lib, x, *a: rows.append(x.shape[0]) or real(lib, x, *a))
    prompts = [[3 + i, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(12)] + [[5] * 80]
    eng = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=128, dtype="bfloat16"))
    linears = [eng.model.head] + [m for layer in eng.model.model.layers for m in
                                  (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down)]
    assert all(m.panels is not None and m.panels.dtype == torch.bfloat16 and m.panel_rows == 64 for m in linears)
    with_kernel = eng.generate(prompts, max_new_tokens=12)
    assert 13 in rows and set(rows) <= set(range(1, 65))
    steps = eng.num_steps
    previous = native.use_bf16_gemm(False)
    try:
        rows.clear()
        assert eng.generate(prompts, max_new_tokens=12) == with_kernel
    finally:
        native.use_bf16_gemm(previous)
    assert eng.num_steps > steps and rows == []


@pytest.mark.parametrize("switch", ["use_bf16_gemm", "use_bf16_elementwise"])
def test_the_bfloat16_one_call_decode_step_stands_aside_where_the_loop_would_take_torch(monkeypatch, switch):
    """With the bfloat16 GEMM or the elementwise bfloat16 kernels turned off, the loop computes with torch's
    operations: the one-call step answers None (nothing written) and the loop runs, so the bits stay the loop's."""
    eng = Engine(EngineConfig(model="builtin", block_size=16, num_blocks=128, dtype="bfloat16"))
    calls = None
    if switch == "use_bf16_elementwise":
        calls, real = [], native._panel_linear_bf16
        monkeypatch.setattr(native, "_panel_linear_bf16", lambda lib, x, *a: calls.append(x.shape[0]) or real(lib, x, *a))
    stack = native.decode_stack
    answers = []
    monkeypatch.setattr(native, "decode_stack", lambda *a: answers.append(stack(*a)) or answers[-1])
    previous = getattr(native, switch)(False)
    try:
        eng.generate([[1, 2, 3, 4, 5]] * 4, max_new_tokens=3)
    finally:
        getattr(native, switch)(previous)
    assert answers == [None, None]
    assert calls is None or 4 in calls  # the loop's linears still took the GEMM
    answers.clear()
    eng.generate([[1, 2, 3, 4, 5]] * 4, max_new_tokens=3)
    assert len(answers) == 2 and all(a is not None and a.dtype == torch.bfloat16 for a in answers)


def test_bfloat16_decode_with_a_window_is_native_and_reads_only_the_window():
    """The one decode walk (csrc/paged_decode.c) gives a bfloat16 query a sliding window as every dtype has one (it
    used to leave windowed bfloat16 models to the eager path): the blocks wholly before the window are never read
    (their entries are -1 here), and the answer is attention over the window's keys alone, as SDPA over those keys
    gives it (to the bit where the kernel adds in torch's order, whose chunks then start at the window)."""
    from engine import paged_attention
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size, length, window = 4, 2, 32, 4, 21, 6
    key = torch.randn(8, block_size, kv_heads, dim, generator=gen).bfloat16()
    value = torch.randn(8, block_size, kv_heads, dim, generator=gen).bfloat16()
    query = torch.randn(1, heads, dim, generator=gen).bfloat16()
    tables = torch.tensor([[6, 1, 4, 0, 7, 3]])
    lens = torch.tensor([length])
    windowed = tables.clone()
    windowed[0, : (length - window) // block_size] = -1
    got = native.decode(query, key, value, windowed, lens, dim ** -0.5, window=window)
    assert got is not None
    assert torch.equal(paged_attention(query, key, value, windowed, lens, dim ** -0.5, sliding_window=window), got)
    keys = key[tables[0]].reshape(-1, kv_heads, dim)[length - window:length]
    values = value[tables[0]].reshape(-1, kv_heads, dim)[length - window:length]
    whole = key[tables[0]].reshape(-1, kv_heads, dim)[:length], value[tables[0]].reshape(-1, kv_heads, dim)[:length]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=dim ** -0.5, enable_gqa=True)
    unwindowed = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1), whole[0].transpose(0, 1), whole[1].transpose(0, 1), scale=dim ** -0.5, enable_gqa=True)
    assert (got[0].float() - want[:, 0].float()).abs().max() <= 0.02
    if native.bf16_torch_order():
        assert torch.equal(got[0], want[:, 0])
    assert (got[0].float() - unwindowed[:, 0].float()).abs().max() > 0.05

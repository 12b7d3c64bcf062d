"""The engine in bfloat16 against transformers in bfloat16 (``dtype=torch.bfloat16``) on bench/peers.py's shapes.

bfloat16 keeps 8 bits of mantissa, so two correct implementations that round in different places drift apart; with
random weights the logits are nearly flat and one flipped argmax changes every token after it. The rule (issue 34):
greedy tokens agree with transformers' bfloat16 run for at least the first 32 tokens of every sequence. Where they
first differ over longer runs is in docs/engine.md ("bfloat16"). float32 stays exact (tests/test_parity.py)."""
import ctypes
import math

import pytest
import torch
import transformers

from engine import Engine, EngineConfig, native, paged_attention
from engine.attention import use_native_kernel

AGREE = 32  # tokens every sequence must share with transformers
PROMPT_LEN = 64  # as bench/peers.py

SHAPES = {  # bench/peers.py's MODELS, with fewer sequences for the 135M shape (it is a slow model for a test)
    "3m": (dict(vocab_size=258, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=256,
                eos_token_id=None), 16),
    "135m": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                  tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=0,
                  eos_token_id=None), 4),
}


TORCH_ORDER_VERSION = "2.13.0"  # the torch build whose decode attention csrc/paged_decode.c copies


def _needs_torch_order() -> None:
    """Skip, saying why, where the kernel's copy of torch's order cannot be compared: no kernel, no AVX-512 BF16 or
    not an Intel processor (the order is off there), or another torch than the one whose build was read."""
    if native.kernel() is None or not native.bf16_torch_order():
        pytest.skip("torch's order is built for Intel processors with AVX-512 BF16 (vdpbf16ps, what MKL's bfloat16 "
                    "gemv kernels sum with)")
    if torch.__version__.split("+")[0] != TORCH_ORDER_VERSION:
        pytest.skip(f"the kernel copies torch {TORCH_ORDER_VERSION}'s build; this is torch {torch.__version__}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ; None where they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    config, batch = SHAPES[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"bf16-{request.param}")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16).save_pretrained(
        path, safe_serialization=True)
    # loaded back as a user would (bench/peers.py too): ``.to(bfloat16)`` on a built model would also round the
    # rotary embedding's inverse frequencies, which from_pretrained keeps in float32
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, min(config["vocab_size"], 256), (batch, PROMPT_LEN), generator=gen).tolist()
    return model, path, prompts


def _hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def test_greedy_agrees_with_transformers_bfloat16(checkpoint):
    model, path, prompts = checkpoint
    expected = _hf_greedy(model, prompts, AGREE)
    eng = Engine(EngineConfig(model=str(path), block_size=16, num_blocks=len(prompts) * 8 + 8, dtype="bfloat16"))
    assert eng.kv.data.dtype == torch.bfloat16 and next(eng.model.parameters()).dtype == torch.bfloat16
    got = eng.generate(prompts, max_new_tokens=AGREE)
    firsts = [first_difference(a, b) for a, b in zip(got, expected)]
    assert firsts == [None] * len(prompts), f"first differing token of each sequence: {firsts}"


def test_bfloat16_linears_are_packed_and_give_f_linear_bits(checkpoint):
    """oneDNN's bfloat16 GEMM serves a prefill's rows past the panel GEMM's up to 64, with F.linear's exact bits (a
    decode step's take the panels up to 64: tests/test_builtin_model.py); more rows take F.linear itself, as transformers does (the packed GEMM parts from it there: 32 outputs of the
    135M shape's output projection at 1,024 rows); a decode batch takes the bfloat16 panel GEMM
    (csrc/small_gemm_bf16.c), which sums in another order (in AMX tiles, oneDNN's: tests/test_bf16_gemm.py): within
    a unit in the last place of F.linear."""
    _, path, _ = checkpoint
    eng = Engine(EngineConfig(model=str(path), num_blocks=16, dtype="bfloat16"))
    linear = eng.model.model.layers[0].mlp.gate_up
    assert linear.onednn and linear.panels is not None and linear.panel_rows in (16, 64)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(linear.panel_rows + 1, linear.weight.shape[1], generator=gen).bfloat16()
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight))
    for layer in eng.model.model.layers[:2]:
        for linear in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down):
            x = torch.randn(1024, linear.weight.shape[1], generator=gen).bfloat16()  # a prefill of 16 x 64 tokens
            assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    x = x[:16]
    got, want = linear(x), torch.nn.functional.linear(x, linear.weight)
    assert torch.equal(got, native.panel_linear(x, linear.panels, linear.weight.shape[0], None))
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
    assert bool(((got.float() - want.float()).abs() <= ulp).all())


def _scattered(heads, kv_heads, dim, block_size, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = 4 + sum(-(-n // block_size) for n in lens)
    key = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    value = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    query = torch.randn(len(lens), heads, dim, generator=gen).bfloat16()
    width = max(-(-n // block_size) for n in lens)
    order = torch.randperm(blocks, generator=gen)
    tables = torch.full((len(lens), width), -1, dtype=torch.int64)
    used = 0
    for s, n in enumerate(lens):
        live = -(-n // block_size)
        tables[s, :live] = order[used:used + live]
        used += live
    return query, key, value, tables, torch.tensor(lens)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(8, 4, 32, 16), (9, 3, 64, 16), (4, 4, 20, 4),
                                                           (6, 2, 48, 1)])
def test_native_bfloat16_decode_reads_the_pool_in_place_like_torch_sdpa(heads, kv_heads, dim, block_size):
    """csrc/paged_decode.c takes bfloat16 queries and caches itself (no float32 copy, no gather) and gives what
    torch's bfloat16 SDPA gives on the same K/V laid out contiguously, within a unit in the last place of
    bfloat16 (they round the same values, summed in another order)."""
    if native.kernel() is None:
        pytest.skip(f"no native kernel here: {native.error()}")
    lens = [1, 17, 40, 100, 63]
    query, key, value, tables, seq_lens = _scattered(heads, kv_heads, dim, block_size, lens)
    out = native.decode(query, key, value, tables, seq_lens, dim ** -0.5)
    assert out is not None and out.dtype == torch.bfloat16
    for s, n in enumerate(lens):
        blocks = tables[s, : -(-n // block_size)]
        k = key[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, dim]
        v = value[blocks].flatten(0, 1)[:n].transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(query[s][None, :, None], k[None], v[None],
                                                               enable_gqa=True)[0, :, 0]  # [heads, dim]
        # a bfloat16 ulp is 2^-8 to 2^-7 of a value; an output near zero is a sum that cancelled, off by the
        # rounding of its terms: a unit of the largest output's last place
        near = ref.float().abs() * 2 ** -7 + ref.float().abs().max() * 2 ** -7
        assert ((out[s].float() - ref.float()).abs() <= near).all()
    # and the public paged_attention reaches it, the same as with the kernel off (the eager path, torch's SDPA)
    assert torch.equal(paged_attention(query, key, value, tables, seq_lens), out)
    previous = use_native_kernel(False)
    try:
        eager = paged_attention(query, key, value, tables, seq_lens)
    finally:
        use_native_kernel(previous)
    assert (out.float() - eager.float()).abs().max() <= 2 * 2 ** -7 * eager.float().abs().max()
    assert math.isfinite(float(out.float().abs().max()))


def test_native_bfloat16_norm_activation_and_rotary_round_where_torch_does():
    """csrc/norm_act_bf16.c against the torch forms transformers runs in bfloat16 (each operation rounding its
    result): the rotary embedding, the residual add and the norm (its float32 mean summed in torch's order) bit for
    bit; SiLU (whose exponential is approximated otherwise than torch's) all but a few values, one unit in the last
    place off."""
    if native.kernel() is None:
        pytest.skip(f"no native kernel here: {native.error()}")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from engine.model.causal_lm import Rotary, apply_rotary
    gen = torch.Generator().manual_seed(5)
    rows = 2048  # (the kernel that summed in its own order was off in a few values of 10^5 to 10^6)
    for hidden in (7, 64, 100, 256, 576, 960, 4096, 5000):  # a partial vector, steps of 4, the cascade's levels
        x = (torch.randn(rows, hidden, generator=gen) * 4).bfloat16()
        delta = torch.randn(rows, hidden, generator=gen).bfloat16()
        norm = LlamaRMSNorm(hidden, eps=1e-5).to(torch.bfloat16)  # what transformers' Llama normalises with
        with torch.no_grad():
            norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
            summed = x + delta
            expected = norm(summed)
        got = native.add_rms_norm(x, delta, norm.weight.detach(), 1e-5)
        assert got is not None and got.dtype == torch.bfloat16
        assert torch.equal(x, summed)  # the residual, added in place and rounded as torch rounds it
        assert torch.equal(got, expected), (hidden, int((got != expected).sum()))
    hidden = 576

    gate_up = torch.randn(rows, 2 * 1536, generator=gen).bfloat16() * 3
    got = native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    off = got != expected
    assert got.dtype == torch.bfloat16 and off.float().mean() < 0.01
    assert ((got.float() - expected.float()).abs()[off] <= expected.float().abs()[off] * 2 ** -7).all()

    heads, kv_heads, dim, tokens, block_size = 9, 3, 64, 7, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
    rotary = Rotary(dim, 100000.0, 256)
    cos, sin = rotary.cos_sin(torch.tensor([0, 3, 17, 90, 91, 200, 5]), torch.bfloat16)
    caches = [torch.zeros(8, block_size, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([5, 17, 40, 3, 90, 127, 64])
    q = native.rope_store(qkv, cos, sin, slots, caches[0], caches[1], heads, kv_heads)
    parts = qkv.view(tokens, heads + 2 * kv_heads, dim)
    assert torch.equal(q, apply_rotary(parts[:, :heads], cos, sin))
    flat_k, flat_v = (c.view(-1, kv_heads, dim) for c in caches)
    assert torch.equal(flat_k[slots], apply_rotary(parts[:, heads:heads + kv_heads], cos, sin))
    assert torch.equal(flat_v[slots], parts[:, heads + kv_heads:])


def test_the_bfloat16_engine_is_transformers_to_the_bit(checkpoint):
    """Where the panel GEMM sums in AMX tiles (oneDNN's order, F.linear's bits: tests/test_bf16_gemm.py) and the
    decode attention adds in torch's order (AVX-512 BF16: csrc/paged_decode.c), every part of a bfloat16 step
    rounds exactly as transformers' bfloat16 run: the prefill (F.linear, each part of a fused projection apart,
    torch's SDPA), the norms (torch's sum order), SwiGLU, the rotary embedding, the decode attention read through the
    block tables, the output head. So greedy tokens equal transformers' in every sequence, 64 tokens long. With the
    attention's own float32 order instead (bf16_decode_torch_order off) they parted at tokens 35 (3M), 51 and 43
    (135M shape)."""
    model, path, prompts = checkpoint
    if native.kernel() is None or not native.bf16_amx():
        pytest.skip("needs the AMX walk (a CPU with AMX-BF16), whose sums are F.linear's")
    _needs_torch_order()
    eng = Engine(EngineConfig(model=str(path), block_size=16, num_blocks=len(prompts) * 16 + 8, dtype="bfloat16",
                              enable_prefix_caching=False, max_num_batched_tokens=4096))  # one prefill, as
    # transformers: oneDNN's sums depend on the row count, so a prefill in chunks rounds otherwise
    expected = _hf_greedy(model, prompts, 64)
    got = eng.generate(prompts, max_new_tokens=64, ignore_eos=True)
    assert [first_difference(a, b) for a, b in zip(got, expected)] == [None] * len(prompts)


def _order_probes(dim: int, keys: int, probes: int, block_size: int = 16, seed: int = 0):
    """Sequences (one head) whose attention output shows the order a sum was taken in: a score made of the products
    +2^24, -2^24 and +1 at three random dims (the 1 survives only where it joins after the two cancel, as
    2^24 + 1 rounds back to 2^24 and -2^24 + 1 does not), or, with equal scores, a weighted V made of +2^24, -2^24
    and +1 at three random keys (for every other such probe, three of eight neighbouring keys). Returns decode's
    arguments, contiguous K/V placed in the pool through the tables."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-keys // block_size)
    key = torch.zeros(probes * per, block_size, 1, dim)
    value = torch.zeros(probes * per, block_size, 1, dim)
    query = torch.zeros(probes, 1, dim)
    tables = torch.randperm(probes * per, generator=gen).reshape(probes, per)
    for i in range(probes):
        k, v = torch.zeros(per * block_size, dim), torch.zeros(per * block_size, dim)
        if i % 2 == 0:  # the score's sum over dims
            a, b, c = torch.randperm(dim, generator=gen)[:3].tolist()
            query[i, 0, [a, b, c]] = torch.tensor([2.0 ** 12, 2.0 ** 12, 1.0])
            k[0, [a, b, c]] = torch.tensor([2.0 ** 12, -2.0 ** 12, 1.0])
            v[0, 0] = 1.0
        else:  # the weighted V's sum over keys: anywhere, or (every other one) within eight neighbouring keys
            start = int(torch.randint(0, keys - 8, (), generator=gen)) if i % 4 == 3 else 0
            a, b, c = (start + torch.randperm(8 if i % 4 == 3 else keys, generator=gen)[:3]).tolist()
            v[[a, b, c], 0] = torch.tensor([2.0 ** 24, -2.0 ** 24, 1.0])
        key[tables[i]] = k.reshape(per, block_size, 1, dim)
        value[tables[i]] = v.reshape(per, block_size, 1, dim)
    return query.bfloat16(), key.bfloat16(), value.bfloat16(), tables, torch.full((probes,), keys)


def test_native_bfloat16_decode_sums_the_softmax_in_torch_order():
    """The softmax's denominator rarely shows in a bfloat16 output (SmolLM2's real weights showed it in about one layer
    step in 30, a token later), but torch's flash attention also returns its log-sum-exp, max + log(sum), in float32:
    with the maximum at 0 and the other weights small the sum stays below 2.5, where that log resolves a unit in the
    sum's last place. So the kernel's softmax is checked against it (bf16_softmax_row: softmax_join, what the kernel
    runs for each chunk, over a row) for rows of 1 to 1,500 scores, exact scores built as score = q . k with q one-hot,
    the maximum last so that every later chunk of 512 rescales the sum so far. Summing every vector into one accumulator
    (torch's source reads so; its build adds in two) fails it, and so does joining the chunks' sums without the fused
    multiply-add."""
    _needs_torch_order()
    lib = native.kernel()
    logf = ctypes.CDLL(None).logf
    logf.restype, logf.argtypes = ctypes.c_float, [ctypes.c_float]
    gen = torch.Generator().manual_seed(3)
    differ = []
    for n in [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 129, 200, 257, 300, 511, 512, 600, 1030,
              1500]:
        scores = -6.0 - 8.0 * torch.rand(4, n, generator=gen)  # weights below 2.5e-3 ...
        scores[:, -1] = 0.0  # ... and one of 1, the maximum, last: every later chunk rescales the earlier ones
        scores[:, : n - 1: 512] = -2.0  # (each chunk's own maximum higher than its neighbours')
        keys = torch.zeros(4, 1, n, 64)
        keys[:, 0, :, 0] = scores
        keys = keys.bfloat16()
        query = torch.zeros(4, 1, 1, 64, dtype=torch.bfloat16)
        query[..., 0] = 1.0
        lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, keys, scale=1.0)[1]
        for row in range(4):
            exact = keys[row, 0, :, 0].float().contiguous()
            weights = torch.empty(min(n, 512) + 1, dtype=torch.bfloat16)
            total, top = ctypes.c_float(), ctypes.c_float()
            assert lib.bf16_softmax_row(exact.data_ptr(), n, weights.data_ptr(), ctypes.byref(total),
                                        ctypes.byref(top)) == 0 and top.value == 0.0
            mine = torch.tensor(logf(total.value), dtype=torch.float32)  # max (0) + log(sum), as torch
            if not torch.equal(mine, lse[row, 0, 0].float()):
                differ.append((n, row))
    assert differ == []


@pytest.mark.parametrize("dim,keys", [(64, 80), (32, 150), (64, 1030)])
def test_native_bfloat16_decode_adds_in_torch_order(dim, keys):
    """Random inputs rarely show the order of a float32 sum in a bfloat16 output, so this asks it directly
    (_order_probes): for each probe the kernel's output is torch's SDPA's bit for bit, both where the scores are
    summed over dims and where V is summed over keys (past 512 keys: torch's chunks, rescaled). Adding the last
    lanes of a score in another order, or a key pair's products in another, fails it."""
    _needs_torch_order()
    query, key, value, tables, lens = _order_probes(dim, keys, 120)
    out = native.decode(query, key, value, tables, lens, 1.0)
    # all probes in one call, as transformers' batch: torch then spreads (sequence, head) items over its threads and
    # each GEMM runs on one (a lone item's GEMM would be split over the threads, its sums in halves)
    k = key[tables].flatten(1, 2)[:, :keys].transpose(1, 2)  # [probes, 1, keys, dim]
    v = value[tables].flatten(1, 2)[:, :keys].transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(query[:, :, None], k, v, scale=1.0)[:, :, 0]
    differ = [i for i in range(len(lens)) if not torch.equal(out[i].view(torch.int16), ref[i].view(torch.int16))]
    assert differ == []


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(8, 4, 32, 16), (9, 3, 64, 16), (4, 4, 64, 5),
                                                           (2, 1, 128, 32), (6, 2, 96, 1)])
def test_native_bfloat16_decode_is_torch_flash_attention_to_the_bit(heads, kv_heads, dim, block_size):
    """With AVX-512 BF16, csrc/paged_decode.c reads K/V through the block tables and gives torch's SDPA bits
    (its CPU flash attention, transformers' bfloat16 path) for every head of every sequence: contexts of 1 to 1,030
    keys (torch's chunks of 512, rescaled), odd and even counts, block sizes that split a pair of keys, grouped
    queries. Off
    (bf16_decode_torch_order(0)), the float32 walk differs in some outputs: the test sees that the switch switches."""
    _needs_torch_order()
    lens = [1, 2, 15, 33, 64, 65, 100, 129, 192, 257, 511, 512, 600, 1030]
    query, key, value, tables, seq_lens = _scattered(heads, kv_heads, dim, block_size, lens)
    scale = dim ** -0.5
    ref = []
    for s, n in enumerate(lens):
        blocks = tables[s, : -(-n // block_size)]
        k = key[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, dim]
        v = value[blocks].flatten(0, 1)[:n].transpose(0, 1)
        ref.append(torch.nn.functional.scaled_dot_product_attention(query[s][None, :, None], k[None], v[None],
                                                                    scale=scale, enable_gqa=True)[0, :, 0])
    ref = torch.stack(ref)
    out = native.decode(query, key, value, tables, seq_lens, scale)
    assert out is not None and torch.equal(out.view(torch.int16), ref.view(torch.int16))
    previous = native.use_bf16_torch_order(False)
    try:
        widened = native.decode(query, key, value, tables, seq_lens, scale)
    finally:
        native.use_bf16_torch_order(previous)
    assert not torch.equal(widened.view(torch.int16), ref.view(torch.int16))


def test_torch_order_is_kept_to_intel_processors(monkeypatch):
    """The order copied is that of MKL's Intel kernels, which torch's build calls on Intel processors; on another
    vendor's engine/native/__init__.py turns it off when the kernels load, and the attention keeps its own order."""
    if native.kernel() is None:
        pytest.skip(f"no native kernel here: {native.error()}")
    before = native.bf16_torch_order()
    saved = dict(native._state)
    try:
        native.use_bf16_torch_order(True)
        built = native.bf16_torch_order()  # whether this build has the order at all (AVX-512 BF16)
        native._state.clear()
        monkeypatch.setattr(native, "_vendor", lambda: "GenuineIntel")
        assert native.kernel() is not None and native.bf16_torch_order() == built  # kept on
        native._state.clear()
        monkeypatch.setattr(native, "_vendor", lambda: "AuthenticAMD")
        assert native.kernel() is not None and not native.bf16_torch_order()  # turned off
    finally:
        native._state.clear()
        native._state.update(saved)
        native.use_bf16_torch_order(before)
    assert native.bf16_torch_order() == before


def test_a_thread_out_of_scratch_in_torch_order_attention_raises_and_changes_nothing(checkpoint):
    """The attention in torch's order (head size 32 here) takes its scratch where the widening walk did: a thread
    that cannot have it makes the one-call step raise MemoryError, the engine is exactly as it was, and what follows
    is what a run without the fault produces."""
    from tests.test_engine_core import assert_same, finish, state_of
    model, path, prompts = checkpoint
    if model.config.hidden_size != 256:
        pytest.skip("the 3M config is enough (its head size, 32, takes torch's order)")
    _needs_torch_order()

    def busy():
        eng = Engine(EngineConfig(model=str(path), block_size=16, num_blocks=64, dtype="bfloat16"))
        for p in prompts[:4]:
            eng.add_conversation(prompt_token_ids=p, max_new_tokens=12)
        while any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()  # every prompt prefilled: the next step is a decode step, the one-call step's
        return eng
    expected = finish(busy())
    eng = busy()
    before = state_of(eng)
    native.kernel().kernels_fail_scratch(2)  # layer 0's attention, the second thread's scratch
    try:
        with pytest.raises(MemoryError, match="scratch"):
            eng.step()
    finally:
        native.kernel().kernels_fail_scratch(0)
    assert_same(state_of(eng), before)
    assert finish(eng) == expected

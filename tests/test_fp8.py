"""The fp8 KV cache (engine/kv/fp8.py): the cache write's rounding, saturation, NaN and infinity as vLLM's CPU cache
write does them (checked against vLLM's own operation in tests/vllm_live/test_fp8_live.py), exact reads, scales from
a checkpoint, and an fp8 pool through the engine: attention, relocation, copy-on-write, tiers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig, EngineError, paged_attention
from engine.attention import REFERENCE, dense_attention
from engine.kv.fp8 import FP8_MAX, KVScales, dequantize, quantize, read_scales, scale_name
from tests.helpers import write_tiny_checkpoint

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KINDS = {"fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


def codes(dtype: torch.dtype) -> torch.Tensor:
    """Every finite code of the format except -0, as uint8."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = every.view(dtype).float()
    return every[torch.isfinite(values) & ~((values == 0) & torch.signbit(values))]


def finite_values(dtype: torch.dtype) -> torch.Tensor:
    """The format's finite values, ascending (float64), +0 once."""
    return torch.unique(codes(dtype).view(dtype).double())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_code_round_trips(dtype):
    """Reading is exact and writing a stored value gives its code back: quantise(dequantise(c)) == c for every
    finite code, in float32 and in bfloat16 (each fp8 value is a value of both)."""
    c = codes(dtype)
    for compute in (torch.float32, torch.bfloat16):
        values = dequantize(c.view(dtype), dtype=compute)
        assert torch.equal(values.double(), c.view(dtype).double())  # torch's own cast: the exact value
        assert torch.equal(quantize(values, dtype).view(torch.uint8), c)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_values_between_codes_are_cut_toward_zero(dtype):
    """vLLM's CPU cache write cuts the mantissa: every value is stored as the code of largest magnitude not above
    its own, where torch's cast rounds to nearest (the two differ for about half the values)."""
    grid = finite_values(dtype)
    x = torch.cat([torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * s for s in (0.001, 0.1, 1, 40)])
    x = x[x.abs() <= FP8_MAX[dtype]]
    got = quantize(x, dtype).double()
    magnitude = x.double().abs()
    below = grid[torch.searchsorted(grid, magnitude, right=True) - 1]  # largest grid value <= |x|
    assert torch.equal(got.abs(), below)
    assert torch.equal(torch.sign(got)[got != 0], torch.sign(x.double())[got != 0])
    rounded = x.to(dtype).double()
    assert (rounded != got).float().mean() > 0.3  # not torch's cast
    assert torch.equal(got[rounded.abs() <= magnitude], rounded[rounded.abs() <= magnitude])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturation_nan_infinity_and_zero(dtype):
    """Past the format's largest value the write saturates; NaN is stored as the positive largest value (torch's
    cast keeps a NaN), infinities as the signed largest; -0 as +0, and magnitudes below the smallest subnormal as a
    zero that keeps its sign."""
    top = FP8_MAX[dtype]
    x = torch.tensor([top, top * 1.01, 1e30, -1e30, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30,
                      -1e-30])
    got = quantize(x, dtype)
    assert got.float().tolist()[:7] == [top, top, top, -top, top, -top, top]
    assert got.view(torch.uint8).tolist()[7:] == [0, 0, 0, 0x80]
    assert torch.isnan(torch.tensor([float("nan")]).to(dtype).float()).all()  # where torch's cast keeps the NaN


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_scale_divides_before_the_cut(dtype):
    """With a scale the value is multiplied by the float32 reciprocal of the scale first (as vLLM does: not
    divided), then cut; reading multiplies the code's value by the scale."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 3
    for scale in (0.37, 3.0, 0.0625):
        inverse = torch.tensor(1.0) / torch.tensor(scale)  # float32
        assert torch.equal(quantize(x, dtype, scale).view(torch.uint8), quantize(x * inverse, dtype).view(torch.uint8))
        assert torch.equal(dequantize(quantize(x, dtype, scale), scale), quantize(x, dtype, scale).float() * scale)


def test_scale_names_are_vllms():
    assert scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert scale_name("model.layers.0.self_attn.v_proj.v_scale") == (0, "v")
    assert scale_name("model.layers.12.self_attn.qkv_proj.k_scale") == (12, "k")
    assert scale_name("model.layers.1.self_attn.kv_scale") == (1, "kv")
    assert scale_name("model.layers.2.self_attn.v_cache.scale") == (2, "v")
    assert scale_name("model.layers.2.self_attn.q_scale") == (2, "q")
    for other in ("model.layers.0.self_attn.k_proj.weight", "model.norm.weight", "k_scale", "model.layers.x.k_scale"):
        assert scale_name(other) is None


def test_read_scales_defaults_and_duplicates():
    t = torch.tensor
    scales = read_scales({(0, "k"): t(0.5), (0, "v"): t([2.0]), (1, "kv"): t(0.25), (2, "v"): t(4.0),
                          (3, "q"): t(9.0)}, 5, "ckpt")
    assert scales == KVScales((0.5, 0.25, 4.0, 1.0, 1.0), (2.0, 0.25, 4.0, 1.0, 1.0))


@pytest.mark.parametrize("found, message", [
    ({(0, "k"): torch.tensor(-1.0)}, "positive finite"),
    ({(0, "k"): torch.tensor(float("nan"))}, "positive finite"),
    ({(0, "v"): torch.tensor(float("inf"))}, "positive finite"),
    ({(0, "k"): torch.tensor(0.0)}, "positive finite"),
    ({(0, "k"): torch.ones(3)}, "one number"),
    ({(0, "k"): torch.tensor(2)}, "one number"),
    ({(7, "k"): torch.tensor(1.0)}, "has 2 layers"),
])
def test_read_scales_refuses_what_means_nothing(found, message):
    with pytest.raises(EngineError, match=message):
        read_scales(found, 2, "ckpt")


def test_bad_kv_cache_dtype_is_refused():
    for bad in ("fp16", "float8", "", None, 8):
        with pytest.raises(EngineError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)


@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
def test_paged_attention_reads_fp8_caches_exactly(kind):
    """Every backend reads an fp8 pool's values exactly: through the block tables it gives the float64 reference's
    attention over the same values (the values made float32 first)."""
    dtype = KINDS[kind]
    g = torch.Generator().manual_seed(3)
    num_blocks, bs, kv_heads, dim = 12, 4, 2, 16
    kc = quantize(torch.randn(num_blocks, bs, kv_heads, dim, generator=g), dtype)
    vc = quantize(torch.randn(num_blocks, bs, kv_heads, dim, generator=g), dtype)
    q = torch.randn(3, 4, dim, generator=g)
    tables = torch.tensor([[5, 2, 9], [0, 11, 3], [7, 1, 4]])
    lens = torch.tensor([10, 3, 12])
    out = paged_attention(q, kc, vc, tables, lens)
    for s in range(3):
        n = int(lens[s])
        keys = kc.float()[tables[s]].flatten(0, 1)[:n]
        values = vc.float()[tables[s]].flatten(0, 1)[:n]
        torch.testing.assert_close(out[s], dense_attention(q[s], keys, values), rtol=1e-5, atol=1e-6)


def _engine(path, kind, num_blocks=64, **kw):
    return Engine(EngineConfig(model=str(path), num_blocks=num_blocks, block_size=4, kv_cache_dtype=kind, **kw))


PROMPTS = [[5, 9, 14, 3, 7, 22, 8], [40, 2, 2, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_halves_the_bytes_and_stores_what_vllm_writes(tmp_path, kind):
    """A block of an fp8 pool takes a quarter of float32's bytes; the K/V written are the quantised values of the
    float32 K/V the same model computes (first layer: its inputs do not depend on the pool's dtype)."""
    path = write_tiny_checkpoint(tmp_path / "m")
    full, small = _engine(path, "auto"), _engine(path, kind)
    assert small.kv.bytes_per_block * 4 == full.kv.bytes_per_block
    assert small.kv.data.dtype is KINDS[kind]
    for eng in (full, small):
        eng.add_conversation(prompt_token_ids=PROMPTS[0], max_new_tokens=4)
        eng.step()  # the prompt's K/V written; the conversation holds its blocks
    table = list(full.conversation(0).block_table)
    assert len(table) == 2 and table == list(small.conversation(0).block_table)
    k32 = full.kv.data[0, :, table].flatten(1, 2)[:, :len(PROMPTS[0])]  # [2, positions, kv_heads, dim]
    k8 = small.kv.data[0, :, table].flatten(1, 2)[:, :len(PROMPTS[0])]
    assert torch.equal(k8.view(torch.uint8), quantize(k32, KINDS[kind]).view(torch.uint8))
    info = small.inspect_block(table[0])
    assert np.array_equal(info.keys, small.kv.data[:, 0, table[0], :4].float().numpy())


@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
def test_fp8_backends_agree_and_relocation_is_bit_identical(tmp_path, kind):
    """An fp8 pool decodes the same greedy tokens through the reference and the default backend, and relocating
    every block mid-generation changes no attention output and no token."""
    path = write_tiny_checkpoint(tmp_path / "m")
    reference = _engine(path, kind)
    reference.runner.attend = REFERENCE
    expected = reference.generate(PROMPTS, max_new_tokens=12)
    eng = _engine(path, kind)
    assert eng.generate(PROMPTS, max_new_tokens=12) == expected
    eng = _engine(path, kind)
    ids = [eng.add_conversation(prompt_token_ids=p, max_new_tokens=12) for p in PROMPTS]
    for _ in range(5):
        eng.step()
    report = eng.relocate_and_verify(seed=4, lookahead=3)
    assert report.max_abs_diff == 0.0 and report.tokens_identical and report.num_conversations_checked == 3
    eng.run_until_idle()
    assert [list(eng.conversation(i).output_token_ids) for i in ids] == expected


def test_fp8_fork_copy_on_write_and_tiers_keep_the_bytes(tmp_path):
    """Copy-on-write copies an fp8 block's bytes; a block offloaded to the host and disk tiers comes back with the
    same bytes (the tiers keep raw bytes), so a prefix hit from a tier decodes the tokens of a fresh run."""
    path = write_tiny_checkpoint(tmp_path / "m")
    eng = _engine(path, "fp8", num_blocks=12, host_tier_blocks=4, disk_tier_blocks=64,
                  disk_tier_path=str(tmp_path / "disk"))
    prompt = PROMPTS[2] + [30, 31, 32]  # 14 tokens: the fork shares a part-filled block
    first = eng.generate([prompt], max_new_tokens=6)
    parent = eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=6)
    eng.step()
    child = eng.fork_conversation(parent)
    eng.run_until_idle()
    assert eng.metrics().num_cow_copies > 0
    assert [list(eng.conversation(i).output_token_ids) for i in (parent, child)] == [first[0]] * 2
    for n in range(8):  # push the prompt's cached blocks down the tiers
        eng.generate([[60 + n] * 16], max_new_tokens=2)
    hit = eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=6)
    eng.run_until_idle()
    sources = eng.conversation(hit).prompt_token_sources
    assert sources["host"] + sources["disk"] > 0
    assert list(eng.conversation(hit).output_token_ids) == first[0]


def test_checkpoint_scales_apply_on_write_and_read(tmp_path):
    """k_scale / v_scale tensors in a checkpoint reach every layer: K/V are stored as the quantised values times the
    reciprocal scale, and attention multiplies the scales back (K's into the softmax scale, V's into the output).
    Power-of-two scales are exact but for values below e4m3's normal range, so the tokens are those of the checkpoint
    without scales; a scale left out on either side would multiply scores or outputs by 4."""
    plain = write_tiny_checkpoint(tmp_path / "plain")
    scaled = write_tiny_checkpoint(tmp_path / "scaled")
    tensors = load_file(str(scaled / "model.safetensors"))
    tensors.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),
                    "model.layers.0.self_attn.v_scale": torch.tensor(4.0),
                    "model.layers.1.self_attn.kv_scale": torch.tensor(2.0)})
    save_file(tensors, str(scaled / "model.safetensors"))
    a, b, full = _engine(plain, "fp8"), _engine(scaled, "fp8"), _engine(scaled, "auto")
    assert b.kv.scales == KVScales((0.25, 2.0), (4.0, 2.0))
    assert a.generate(PROMPTS, max_new_tokens=10) == b.generate(PROMPTS, max_new_tokens=10)
    tables = []
    for eng in (b, full):
        cid = eng.add_conversation(prompt_token_ids=PROMPTS[2], max_new_tokens=4)
        eng.step()
        tables.append(list(eng.conversation(cid).block_table))
    n = len(PROMPTS[2])
    k8, v8 = (b.kv.data[0, i, tables[0]].flatten(0, 1)[:n] for i in (0, 1))
    k32, v32 = (full.kv.data[0, i, tables[1]].flatten(0, 1)[:n] for i in (0, 1))  # layer 0: inputs as b's
    assert torch.equal(k8.view(torch.uint8), quantize(k32, E4M3, 0.25).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), quantize(v32, E4M3, 4.0).view(torch.uint8))
    assert not torch.equal(k8.view(torch.uint8), quantize(k32, E4M3).view(torch.uint8))
    assert _engine(scaled, "auto").generate(PROMPTS, max_new_tokens=10) == \
        _engine(plain, "auto").generate(PROMPTS, max_new_tokens=10)  # a float pool ignores the scales (as vLLM)


def test_bad_checkpoint_scale_is_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(-2.0)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(EngineError, match="v_scale of layer 1 .* positive finite"):
        _engine(path, "fp8")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_the_native_cache_write_is_the_rule(dtype, compute):
    """csrc/rope_store.c's fp8 write (csrc/elements.h) stores the bytes engine/kv/fp8.py's rule gives: the rotated
    keys and the values, every float32 bit pattern among them (NaN, infinities, subnormals, values past the range),
    with scales; K/V in bfloat16 are rotated with transformers' rounding first, then quantised."""
    from engine import native
    from engine.model.causal_lm import apply_rotary
    g = torch.Generator().manual_seed(7)
    tokens, heads, kv_heads, dim, block_size = 512, 2, 2, 32, 8
    qkv = torch.randint(-2**31, 2**31 - 1, (tokens, (heads + 2 * kv_heads) * dim), generator=g,
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    qkv[::2] = torch.randn(tokens // 2, qkv.shape[1], generator=g) * 8  # half ordinary values, half any bits
    qkv = qkv.to(compute)
    angle = torch.rand(tokens, 1, dim, generator=g) * 6
    cos, sin = angle.cos().to(compute), angle.sin().to(compute)
    slots = torch.randperm(tokens, generator=g)
    for scales in ((1.0, 1.0), (0.37, 5.0)):
        key_cache = torch.zeros(tokens // block_size, block_size, kv_heads, dim, dtype=dtype)
        value_cache = torch.zeros_like(key_cache)
        q = native.rope_store(qkv, cos.contiguous(), sin.contiguous(), slots, key_cache, value_cache, heads,
                              kv_heads, scales)
        assert q is not None
        rows = qkv.view(tokens, heads + 2 * kv_heads, dim)
        k = apply_rotary(rows[:, heads:heads + kv_heads], cos, sin)  # [tokens, kv_heads, dim]
        v = rows[:, heads + kv_heads:]
        stored_k = key_cache.view(-1, kv_heads, dim)[slots].view(torch.uint8)
        stored_v = value_cache.view(-1, kv_heads, dim)[slots].view(torch.uint8)
        assert torch.equal(stored_k, quantize(k, dtype, scales[0]).view(torch.uint8))
        assert torch.equal(stored_v, quantize(v, dtype, scales[1]).view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("query", [torch.float32, torch.bfloat16])
def test_the_native_walk_reads_every_code_exactly(dtype, query):
    """csrc/elements.h's fp8 reads (through float16: e5m2 exactly, e4m3 short of 2^8, made up once per output):
    attention over one key returns its V row, so every finite code comes back as torch's cast reads it, subnormals
    and the largest values included."""
    from engine import native
    c = codes(dtype)
    c = torch.cat([c, c[: (-len(c)) % 16]])  # whole vectors of sixteen
    values = c.view(dtype).view(1, 1, 1, -1)
    out = native.decode(torch.zeros(1, 1, values.shape[-1], dtype=query), torch.zeros_like(values), values,
                        torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1.0)
    assert out is not None
    expected = values.float().view(-1)
    if query is torch.bfloat16:  # the output is rounded to bfloat16 once (every fp8 value is a bfloat16 value)
        expected = expected.bfloat16()
    assert torch.equal(out.view(-1), expected)

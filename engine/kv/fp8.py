"""The fp8 KV cache: K and V stored as 8-bit floats with one scale per layer for K and one for V, as vLLM's
``--kv-cache-dtype fp8`` stores them.

Writing quantises exactly as vLLM's CPU cache write (``cpu_attn_reshape_and_cache``) does, which is not torch's
cast: the value is multiplied by the float32 reciprocal of the scale, clamped to the format's largest finite value
(NaN becomes the positive largest, infinities the signed largest), and its mantissa is cut, not rounded (toward
zero); zero of either sign is stored as +0. Greedy tokens on SmolLM2 change with the rounding mode, so only the same
rule gives vLLM's tokens (tests/test_fp8.py checks this rule against probes; tests/vllm_live/test_fp8_live.py against
vLLM's own operation). Reading is exact: every code the write makes is a float32 (and a bfloat16) value. The scales
are not folded into the stored values: attention multiplies its softmax scale by K's scale and its output by V's, as
vLLM's CPU attention does (its ``scale_on_logits``), so an fp8 K/V row is read as the plain value of its byte.

Scales: 1.0 unless the checkpoint carries ``k_scale`` / ``v_scale`` tensors under the names vLLM maps to an
attention layer's (``self_attn.k_scale``, ``self_attn.k_proj.k_scale``, ``self_attn.qkv_proj.k_scale``,
``self_attn.k_cache.scale``, the older ``self_attn.kv_scale`` for both); one of the two alone serves both, as vLLM
duplicates it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import EngineError

# EngineConfig.kv_cache_dtype -> the pool's storage dtype ("auto": the model's own dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # largest finite value of each format


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores K/V in for EngineConfig's ``kv_cache_dtype`` (checked there)."""
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return model_dtype if dtype is None else dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` (any float dtype) as ``dtype`` (float8_e4m3fn or float8_e5m2) the way vLLM's CPU cache write stores it
    (see the module's docstring): the same bytes for every input, NaN and infinities included."""
    inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)  # float32, as vLLM
    top = FP8_MAX[dtype]
    v = torch.nan_to_num(x.float() * inverse, nan=top).clamp_(-top, top)  # +-inf -> +-float32 max -> +-top
    if dtype is torch.float8_e4m3fn:
        # 2^-120 moves the float32 exponent's bias (127) onto e4m3's (7): the float's sign, four exponent bits and
        # top three mantissa bits are then the code (below e4m3's normal range the product is a float32 subnormal
        # whose bits are e4m3's subnormal code, still cut toward zero)
        bits = (v * 2.0 ** -120).view(torch.int32)
        code = ((bits >> 24) & 0x80) | ((bits >> 20) & 0x7F)
    else:  # e5m2: float32 exponent e (unbiased) -> e + 15, two mantissa bits; below 2^-14 a subnormal
        bits = v.view(torch.int32)
        sign = (bits >> 24) & 0x80
        exponent = ((bits >> 23) & 0xFF) - 127
        normal = sign | ((exponent + 15).clamp_(min=0) << 2) | ((bits >> 21) & 3)
        shift = (-14 - exponent).clamp_(min=0) + 21  # the mantissa (hidden bit set) shifted down to 2^-16 units
        sub = ((bits & 0x7FFFFF) | 0x800000) >> shift.clamp(max=31)
        sub = torch.where(shift >= 32, torch.zeros_like(sub), sub)
        code = torch.where(exponent < -14, sign | sub, normal)
    code = torch.where(v == 0, torch.zeros_like(code), code)
    return code.to(torch.uint8).view(dtype)


def dequantize(x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``x`` (fp8) stands for: its exact values times ``scale``, in ``dtype``."""
    out = x.to(torch.float32)
    if scale != 1.0:
        out = out * scale
    return out.to(dtype)


@dataclass(frozen=True)
class KVScales:
    """One scale for K and one for V per model layer (vLLM's ``_k_scale_float`` / ``_v_scale_float``)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


# checkpoint tensor name -> (layer, what): the names vLLM's maybe_remap_kv_scale_name maps onto a layer's scales
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:(?:[kv]_proj|qkv_proj)\.)?"
                         r"(k_scale|v_scale|kv_scale|q_scale|prob_scale)$|"
                         r"^model\.layers\.(\d+)\.self_attn\.([kv])_cache\.scale$")


def scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv" | "q" | "prob") for a checkpoint tensor that is an attention layer's quantisation
    scale, else None. (q and prob scales serve vLLM's fp8 attention on GPUs; its CPU attention, and the engine, read
    only K's and V's.)"""
    m = _SCALE_NAME.match(name)
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1)), m.group(2)[: -len("_scale")]
    return int(m.group(3)), m.group(4)


def read_scales(found: dict[tuple[int, str], torch.Tensor], num_layers: int, source: str) -> KVScales:
    """Each layer's K and V scales from the scale tensors a checkpoint carries (``found``: what :func:`scale_name`
    named, with the tensor): checked for meaning (one positive finite number each, a layer the model has), with
    vLLM's defaults (1.0 for a layer without any; a lone kv_scale, k_scale or v_scale serves both)."""
    k, v = [1.0] * num_layers, [1.0] * num_layers
    given: dict[int, dict[str, float]] = {}
    for (layer, what), tensor in found.items():
        label = f"the {what}_scale of layer {layer} in {source}"
        if not 0 <= layer < num_layers:
            raise EngineError(f"{label}: the model has {num_layers} layers")
        if tensor.numel() != 1 or not tensor.is_floating_point():
            raise EngineError(f"{label} must be one number (a per-tensor scale), got a {tensor.dtype} tensor of "
                              f"shape {tuple(tensor.shape)}")
        value = float(tensor.reshape(()).float())
        if not (value > 0 and value < float("inf")):
            raise EngineError(f"{label} must be a positive finite number, got {value}")
        given.setdefault(layer, {})[what] = value
    for layer, scales in given.items():
        lone = scales.get("kv")
        ks, vs = scales.get("k", lone), scales.get("v", lone)
        if ks is None and vs is None:
            continue  # only q / prob scales: K and V keep 1.0
        k[layer] = ks if ks is not None else vs
        v[layer] = vs if vs is not None else ks
    return KVScales(tuple(k), tuple(v))

"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP) in plain torch.

Parameter names are the Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` names, so a checkpoint's
safetensors load with ``load_state_dict`` and the built-in model is saved in the same format.

Two forwards share the weights:
- :meth:`CausalLM.forward` runs a flattened batch of tokens from many conversations; K/V are written into the
  paged cache and attention reads them back only through block tables (:mod:`engine.attention`).
- :meth:`CausalLM.forward_dense` is plain causal attention over ``[batch, time]``, for training and as a reference.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from ..attention import decodes_natively
from ..errors import EngineError
from ..kv.cache import write_slots
from ..kv.fp8 import FP8_DTYPES, KVScales

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # config.json's layer_types values


def _layer_kinds(d: dict[str, Any], arch: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(kind of every layer, the window) as the checkpoint's own library reads them, so that transformers (and
    vLLM) attend exactly as the engine does: Mistral slides every layer when ``sliding_window`` is set (its
    ``layer_types`` are ignored, as transformers' MistralConfig ignores them); Qwen2/Qwen3 slide only with
    ``use_sliding_window``, over ``layer_types`` or else the layers from ``max_window_layers`` on (transformers 5's
    Qwen2Config/Qwen3Config derivation), and a sliding layer without a window attends to everything there; Llama
    follows ``layer_types`` with ``sliding_window`` (as vLLM's Llama does)."""
    window = d.get("sliding_window")
    types = d.get("layer_types")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not d.get("use_sliding_window", False):
            window = None
        if types is None:
            first = d.get("max_window_layers", 28)
            if isinstance(first, bool) or not isinstance(first, int):
                raise EngineError(f"config.json: max_window_layers must be an integer, got {first!r}")
            types = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
                     for i in range(num_layers)]
    elif arch == "MistralForCausalLM":
        types = [FULL_ATTENTION if window is None else SLIDING_ATTENTION] * num_layers
    elif types is None:
        types = [FULL_ATTENTION] * num_layers
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise EngineError(f"config.json: layer_types must list one kind per layer ({num_layers}), got {types!r}")
    bad = [t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)]
    if bad:
        raise EngineError(f"config.json: unsupported layer type {bad[0]!r}; supported: {FULL_ATTENTION!r}, "
                          f"{SLIDING_ATTENTION!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise EngineError(f"config.json: sliding_window must be a positive integer (or null), got {window!r}")
    if SLIDING_ATTENTION in types and window is None:
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # transformers: such a layer sees everything
            types = [FULL_ATTENTION] * num_layers
        else:
            raise EngineError("config.json: layer_types has sliding_attention layers but sliding_window is not set")
    if SLIDING_ATTENTION not in types:
        window = None
    return tuple(types), window


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of the decoder, read from (and written to) a Hugging Face ``config.json``."""

    vocab_size: int  # rows of the embedding and of the output head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # K/V heads; query head h reads K/V head h // (heads // kv_heads)
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # output head shares the embedding matrix
    attention_bias: bool = False  # Llama: bias on q, k, v and o projections when True
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # sampling any of these finishes a conversation
    architecture: str = "LlamaForCausalLM"
    layer_types: tuple[str, ...] = ()  # each layer's kind (FULL_ATTENTION / SLIDING_ATTENTION); () all full
    sliding_window: int | None = None  # a sliding layer's query at position p reads keys at positions > p - window
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary embedding

    def kv_cache_groups(self) -> tuple[tuple[str, int | None, tuple[int, ...]], ...]:
        """One (kind "full_attention"|"sliding_window", window, layer indices) per kind of layer, as vLLM's hybrid
        allocator groups them: the full-attention group first when there is one (its tables are the ones the
        one-group views show). A plain model has one full-attention group of every layer."""
        n = self.num_hidden_layers
        types = self.layer_types or (FULL_ATTENTION,) * n
        full = tuple(i for i in range(n) if types[i] == FULL_ATTENTION)
        sliding = tuple(i for i in range(n) if types[i] == SLIDING_ATTENTION)
        groups = []
        if full:
            groups.append(("full_attention", None, full))
        if sliding:
            groups.append(("sliding_window", self.sliding_window, sliding))
        return tuple(groups)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(d.get("model_type"), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise EngineError(f"unsupported model architecture {arch or d.get('model_type')!r}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise EngineError(f"unsupported activation {act!r}; only silu (SwiGLU) is supported")
        scaling = d.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise EngineError(f"rope_scaling must be an object (or null), got {scaling!r}")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise EngineError(f"unsupported rope_scaling {scaling!r}: only the default rotary embedding is supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = d.get(name)
            if value is None and name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"config.json: {name} must be a positive integer, got {value!r}")
        if d.get("mlp_bias"):
            raise EngineError("unsupported checkpoint: MLP biases (mlp_bias=true)")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
            layer_types, window = _layer_kinds(d, arch, int(d["num_hidden_layers"]))
            config = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and bool(d.get("attention_bias", False)),
                qkv_bias=arch == "Qwen2ForCausalLM",
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                architecture=arch,
                layer_types=layer_types if window is not None else (),
                sliding_window=window,
                qk_norm=arch == "Qwen3ForCausalLM",
            )
            config.validate()
            return config
        except EngineError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"config.json is missing or has a bad field: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        d = {
            "architectures": [self.architecture],
            "model_type": {v: k for k, v in _MODEL_TYPES.items()}[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.sliding_window is not None:  # written so that this engine and transformers read the same kinds back
            d["sliding_window"] = self.sliding_window
            if self.architecture != "MistralForCausalLM":
                d["layer_types"] = list(self.layer_types)
            if self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
                d["use_sliding_window"] = True
        return d

    def validate(self) -> None:
        bad = [e for e in self.eos_token_ids if not 0 <= e < self.vocab_size]
        if bad:
            raise EngineError(f"config.json: eos_token_id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise EngineError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise EngineError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


@dataclass
class BatchMetadata:
    """How a flattened batch of tokens maps onto the paged cache for one forward pass.

    Decode tokens come first (one per conversation), then each prefill chunk's tokens back to back.
    """

    slot_mapping: torch.Tensor | None  # int64 [tokens]: physical slot (block * block_size + offset) each token's K/V goes to
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_plan: Any  # attention.DecodePlan for the decode tokens (tables trimmed, mask built once per step)
    prefills: Sequence[tuple[int, int, torch.Tensor, int]]  # (first token index, num tokens, block table int64, start position)
    sliding_window: int | None = None  # the layers this describes read keys at positions > p - window (None: all)
    groups: tuple = ()  # a model of several KV cache groups: one BatchMetadata per group (its tables, its slots,
    #                     its window); layer i reads groups[CausalLM.layer_group[i]]. Empty: this one, every layer


PANEL_ROWS_STREAMED = 16  # most rows for the panel kernel where the weights do not fit in the last-level cache
PANEL_ROWS_CACHED = 64  # and where they do


class InferenceLinear:
    """``y = x W^T + b`` for inference, with ``W`` held once, in the layout the CPU's kernels read.

    Decode on CPU is matmul-bound. oneDNN's GEMM ran faster than ``F.linear`` here for decode's and prefill's row
    counts (docs/engine.md, "Figures behind the engine's choices"); it is checked against ``F.linear`` once and
    skipped wherever it is unavailable (no oneDNN, CUDA, float16).

    With ``panel_rows`` (see :meth:`CausalLM.prepare_inference`), the weight is laid out for the native panel kernel
    (:func:`engine.native.panel_linear`: csrc/small_gemm.c in float32, csrc/small_gemm_bf16.c's ``vdpbf16ps`` walk in
    bfloat16, where oneDNN's packed bfloat16 GEMM lost to it the same way: docs/engine.md) serves 1 to ``panel_rows``
    rows: a decode batch, or any step as small (a
    short prefill, the logits of a few rows). Where the weights do not fit in the last-level cache (16 rows), a step
    streams every weight from memory once for a few multiply-adds each, and oneDNN did not overlap the stream with its
    arithmetic (the time of the two added up); the panel kernel prefetches the stream through its arithmetic, so it
    wins at decode's few rows and loses at a prefill's hundreds. Where the weights fit (64 rows), the one-call decode
    step it allows saves more than its own speed. More rows keep oneDNN. The measurements: docs/engine.md, "Figures
    behind the engine's choices"."""

    MIN_ROWS = 4  # fewest rows for oneDNN's GEMM (fewer, without panels: F.linear)
    # most rows for oneDNN's bfloat16 GEMM: it gives F.linear's bits at a decode batch's rows but not always
    # at a prefill's (the 135M shape's output projection at 1,024 rows: 32 of 589,824 outputs a unit off), where
    # F.linear, which transformers' bfloat16 run takes, costs the same (docs/engine.md, "bfloat16")
    PACKED_ROWS_BF16 = 64

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False,
                 panel_rows: int = 0, parts: tuple[int, ...] = ()):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach()
        # a fused projection's parts (q, k, v; gate, up): a bfloat16 prefill computes each with F.linear as
        # transformers does, since oneDNN sums a fused one differently at some row counts (q|k|v of the 135M shape
        # at 256 and 384 rows, gate|up at 2,048: a few outputs a unit apart)
        self.parts = parts if weight.dtype == torch.bfloat16 and len(parts) > 1 else ()
        # oneDNN's GEMM reads the weight as it is: given the plain [out, in] tensor it gave the bits (and the speed)
        # of its own pre-packed copy at every row count tried, so no packed copy is kept (docs/engine.md, "Memory")
        self.onednn = pack and _takes_onednn(weight)
        self.panels = native.pack_panels(weight) if pack and panel_rows else None
        # most rows the panel kernel serves; in a decode step (decode_rows) up to PANEL_ROWS_CACHED, what it takes:
        # the panels are the only copy, and oneDNN past panel_rows would need them unpacked at every step, where a
        # prefill's rows keep oneDNN's sums, which the tokens checked against vLLM's fp8 cache were taken with
        # (docs/engine.md, "Memory")
        self.panel_rows = panel_rows if self.panels is not None else 0
        # the weight is held once: as panels where there are panels (the rows past panel_rows unpack them for the
        # call: a prefill's rows or a crowd's, where the GEMM's own work dwarfs the copy), else as it came
        self._plain = weight if self.panels is None else None

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in]: the tensor held, or a fresh copy unpacked from the panels (the same values)."""
        if self._plain is not None:
            return self._plain
        return _unpack_panels(self.panels, self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``weight[ids]`` (the embedding of a model whose output head shares it), read from what is held."""
        if self._plain is not None:
            return F.embedding(ids, self._plain)
        flat = ids.reshape(-1)
        panel, lane = flat // native.PANEL, flat % native.PANEL
        if self.panels.dim() == 3:  # float32 [panels, in, 48]
            out = self.panels[panel, :, lane]
        else:  # bfloat16 [panels, ceil(in / 2), 48, 2]
            out = self.panels[panel, :, lane, :].reshape(flat.shape[0], -1)[:, :self.in_features]
        return out.reshape(*ids.shape, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            rows = x.shape[0]
            most = PANEL_ROWS_CACHED if self.panel_rows and getattr(_step, "decode", False) else self.panel_rows
            if 0 < rows <= most:  # (none: a prefill chunk that ends no prompt samples no logits)
                out = native.panel_linear(x, self.panels, self.out_features, self.bias)
                if out is not None:
                    return out
            if self.onednn and rows >= self.MIN_ROWS and \
                    (rows <= self.PACKED_ROWS_BF16 or self.dtype is not torch.bfloat16):
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            if self.parts and rows > self.PACKED_ROWS_BF16:
                weights = self.weight.split(self.parts)
                biases = self.bias.split(self.parts) if self.bias is not None else (None,) * len(self.parts)
                return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
        return F.linear(x, self.weight, self.bias)


_step = threading.local()  # .decode: inside decode_rows(True) on this thread


@contextmanager
def decode_rows(on: bool):
    """Inside, on this thread, the linears take the rows of a decode step (``on``: no prefill among them) past
    ``panel_rows`` from the panels, up to 64; outside, or for a prefill, oneDNN's sums as before the panels were the
    only copy (ModelRunner wraps each step's forward and logits in it)."""
    before = getattr(_step, "decode", False)
    _step.decode = on
    try:
        yield
    finally:
        _step.decode = before


def _unpack_panels(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [out, in] that :func:`engine.native.pack_panels` laid out as ``panels`` (float32 [P, in, 48] or
    bfloat16 [P, ceil(in / 2), 48, 2]): the same values, contiguous."""
    if panels.dim() == 3:
        return panels.transpose(1, 2).reshape(-1, in_features)[:out_features]
    plain = panels.transpose(1, 2).reshape(-1, 2 * panels.shape[1])[:out_features]
    return plain if plain.shape[1] == in_features else plain[:, :in_features].contiguous()


def _takes_onednn(weight: torch.Tensor) -> bool:
    """Whether oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``) may serve this weight: a CPU float32 weight
    where it agrees with F.linear, a bfloat16 one where it gives F.linear's very bits."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or \
            not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, weight, None, "none", [], "")
        if weight.dtype == torch.bfloat16:  # oneDNN's bfloat16 GEMM (AVX-512 BF16 / AMX where the CPU has them) is
            # what F.linear reaches too: taken only where it gives F.linear's bits (tests/test_parity_bf16.py)
            return torch.equal(got, F.linear(probe, weight))
        return torch.allclose(got, F.linear(probe, weight), atol=1e-4, rtol=1e-4)
    except (RuntimeError, AttributeError):
        return False


class RMSNorm(nn.Module):
    """Root-mean-square normalisation, computed as the HF Llama/Qwen2 models do (in float32, scaled after casting
    back)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op; bit-identical to the form below in float32 (tests/test_perf_model.py), and faster
            # (docs/engine.md, "Figures behind the engine's choices")
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        dtype = x.dtype  # normalised in float32 and scaled after casting back, as the HF models do
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding with the "rotate half" layout that Llama and Qwen2 checkpoints use."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._build(max(max_positions, 64))

    def _build(self, n: int) -> None:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        device = getattr(self, "cos", torch.empty(0)).device
        sin = emb.sin()
        half = self.head_dim // 2
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        # rotate_half(x) * sin == swap_halves(x) * sin_signed, with the first half of sin negated (exactly: IEEE
        # negation commutes with multiplication), so the rotation is one roll instead of two slices, a neg and a cat
        self.register_buffer("sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), -1).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for :func:`apply_rotary`, [tokens, 1, head_dim] each (broadcast over heads)."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._build(2 * int(positions.max()) + 1)
        return self.cos[positions].to(dtype).unsqueeze(-2), self.sin_signed[positions].to(dtype).unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., tokens, heads, head_dim]; cos/sin_signed [tokens, 1, head_dim] from :meth:`Rotary.cos_sin`.
    Bit-identical to the HF form ``x * cos + rotate_half(x) * sin``."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool = False):
        super().__init__()
        self.sliding_window = cfg.sliding_window if sliding else None  # for forward_dense (paged: the metadata's)
        if cfg.qk_norm:  # Qwen3
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias_qkv = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias_qkv)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias_qkv)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias_qkv)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = self.head_dim ** -0.5
        self.k_scale = self.v_scale = 1.0  # an fp8 pool's scales for this layer (checkpoint k_scale/v_scale)
        self.qkv: InferenceLinear | None = None  # q|k|v in one matmul, set by prepare_inference
        self.out: InferenceLinear | None = None

    def prepare_inference(self, pack: bool, panel_rows: int = 0) -> None:
        """One matmul for q, k and v. The projections they are made from are let go (set to None): every forward
        reads ``qkv`` and ``out`` from then on, so each weight is held once (CausalLM.prepare_inference)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight.detach() for p in projs])
        bias = torch.cat([p.bias.detach() for p in projs]) if self.q_proj.bias is not None else None
        self.qkv = InferenceLinear(weight, bias, pack, panel_rows, parts=tuple(p.weight.shape[0] for p in projs))
        del weight, bias, projs
        self.out = InferenceLinear(self.o_proj.weight, self.o_proj.bias, pack, panel_rows)
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, projected: torch.Tensor | None = None):
        """q, k (rotated) and v of ``x``; ``projected``: the fused projection of ``x`` when already computed."""
        lead = x.shape[:-1]
        if self.qkv is not None:  # one matmul, and one rotary call for the q and k heads together
            qkv = (self.qkv(x) if projected is None else projected) \
                .view(*lead, self.num_heads + 2 * self.num_kv_heads, self.head_dim)  # [..., tokens, h+2kv, dim]
            if self.qk_norm:  # per head, before the rotation (Qwen3)
                q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=-2)
                return (apply_rotary(self.q_norm(q.contiguous()), cos, sin),
                        apply_rotary(self.k_norm(k.contiguous()), cos, sin), v)
            qk = apply_rotary(qkv[..., : self.num_heads + self.num_kv_heads, :], cos, sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=-2)
            return q, k, qkv[..., self.num_heads + self.num_kv_heads:, :]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)  # [..., tokens, heads, dim]
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)  # [..., tokens, kv_heads, dim]
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, meta: BatchMetadata, key_cache, value_cache, attend: Callable) -> torch.Tensor:
        q = projected = None
        fp8 = key_cache.dtype in FP8_DTYPES  # an fp8 pool: K/V quantised as written, scales applied by attention
        if self.qkv is not None and meta.slot_mapping is not None and x.dim() == 2 and not self.qk_norm:  # native: rotate q
            # and k and write k and v to their slots in one pass, the same bits as below
            projected = self.qkv(x)  # [tokens, (heads + 2 kv_heads) * dim]
            q = native.rope_store(projected, cos, sin, meta.slot_mapping, key_cache, value_cache, self.num_heads,
                                  self.num_kv_heads, (self.k_scale, self.v_scale))
        if q is None:  # x [tokens, hidden] -> q [tokens, heads, dim], k/v [tokens, kv_heads, dim]
            q, k, v = self._qkv(x, cos, sin, projected)
            if meta.slot_mapping is not None:  # None: a read-only probe of K/V already in the pool
                write_slots(key_cache, meta.slot_mapping, k, self.k_scale)
                write_slots(value_cache, meta.slot_mapping, v, self.v_scale)
        block_size = key_cache.shape[1]
        # an fp8 pool's values are read as they are stored: K's scale joins the softmax scale (as vLLM's CPU
        # attention folds it into the logits' scale), V's multiplies the output
        scale = self.scale * self.k_scale if fp8 else self.scale
        out = attend(q, key_cache, value_cache, meta, scale, block_size)  # [tokens, heads, dim]
        if fp8 and self.v_scale != 1.0:
            out = out * self.v_scale
        out = out.reshape(x.shape[0], self.num_heads * self.head_dim)
        return self.out(out) if self.out is not None else self.o_proj(out)

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)  # [b, t, heads|kv_heads, dim]
        mask = None
        if self.sliding_window is not None:  # key k visible to query p when p - window < k <= p
            pos = torch.arange(t, device=x.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.sliding_window)  # [t, t]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)  # [b, heads, t, dim]
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.out(out) if self.out is not None else self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: InferenceLinear | None = None  # gate|up in one matmul, set by prepare_inference
        self.down: InferenceLinear | None = None

    def prepare_inference(self, pack: bool, panel_rows: int = 0) -> None:
        """gate|up in one matmul; the projections are let go as Attention.prepare_inference lets its go."""
        self.gate_up = InferenceLinear(torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()]),
                                       pack=pack, panel_rows=panel_rows,
                                       parts=(self.gate_proj.weight.shape[0], self.up_proj.weight.shape[0]))
        self.down = InferenceLinear(self.down_proj.weight, pack=pack, panel_rows=panel_rows)
        self.gate_proj = self.up_proj = self.down_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate_up = self.gate_up(x)
            act = native.silu_mul(gate_up)  # one pass; None: not float32 on the CPU, or no kernel
            if act is None:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            return self.down(act)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, sliding)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if weight.device.type != "meta":  # nn.Embedding's own init; on the meta device (the loader's empty model)
            nn.init.normal_(weight)  # none, since meta's normal_ imports hundreds of modules (sympy) to run
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        kinds = cfg.layer_types or (FULL_ATTENTION,) * cfg.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, kinds[i] == SLIDING_ATTENTION)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):  # computed tables, also in a model built on the meta device (the loader's)
            self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.head: InferenceLinear | None = None
        self.stack: torch.Tensor | None = None  # the layers' addresses for native.decode_stack (prepare_inference)
        self._scales_table: dict[bool, torch.Tensor] = {}  # _layer_scales' tables (fp8 pool or not), made on use
        self.panel_rows = 0  # most rows of a one-call decode step: rows every layer's panels serve (0: no step)
        self._stack_norms: list[torch.Tensor] = []  # the norms' weights those addresses point into
        self.layer_group = [0] * cfg.num_hidden_layers  # the KV cache group each layer reads (ModelConfig order)
        for g, (_kind, _window, layers) in enumerate(cfg.kv_cache_groups()):
            for i in layers:
                self.layer_group[i] = g

    def kv_scales(self) -> KVScales:
        """Each layer's K and V scale for an fp8 pool (1.0 unless the checkpoint carried them)."""
        layers = [layer.self_attn for layer in self.model.layers]
        return KVScales(tuple(a.k_scale for a in layers), tuple(a.v_scale for a in layers))

    def set_kv_scales(self, scales: KVScales) -> None:
        for layer, k, v in zip(self.model.layers, scales.k, scales.v):
            layer.self_attn.k_scale, layer.self_attn.v_scale = float(k), float(v)
        self._scales_table = {}

    def _layer_scales(self, fp8: bool) -> torch.Tensor:
        """float32 [layers, 4] for native.decode_stack: each layer's softmax scale, K's and V's scale as the cache
        write takes them (1 / scale), V's scale on the output; the scales only for an fp8 pool (as the layer loop
        applies them: Attention.forward)."""
        table = self._scales_table.get(fp8)
        if table is None:
            rows = []
            for layer in self.model.layers:
                a = layer.self_attn
                k, v = (a.k_scale, a.v_scale) if fp8 else (1.0, 1.0)
                rows.append([a.scale * k if fp8 else a.scale, native._inverse(k), native._inverse(v), v])
            table = self._scales_table[fp8] = torch.tensor(rows, dtype=torch.float32)
        return table

    def init_weights(self, seed: int) -> None:
        """Seeded random init (std 0.02), used when a model has no trained weights."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def prepare_inference(self, pack: bool = True) -> None:
        """Concatenate q/k/v and gate/up weights (4 matmuls per layer instead of 7) and, on CPU, lay every weight
        out for the native panel kernel that serves decode batches (:class:`InferenceLinear`): up to 16 rows where
        the weights do not fit in the last-level cache (a decode step streams them from memory), up to 64 where they
        do. Call once, after the weights are loaded and the model is on its device and dtype.

        Each weight is then held once, in the layout its kernels read: the linears' ``nn.Linear`` modules (and the
        embedding of a model whose head shares it, read through the head from then on) are set to None as their
        weights move into the InferenceLinears, layer by layer, so that loading never holds two whole copies
        (docs/engine.md, "Memory"). :meth:`forward_dense` reads the InferenceLinears too."""
        if self.head is not None:
            raise RuntimeError("prepare_inference runs once: the weights it was made from are let go")
        weight_bytes = sum(p.numel() * p.element_size() for p in self.parameters())
        panel_rows = (PANEL_ROWS_STREAMED if weight_bytes > native.last_level_cache_bytes() else PANEL_ROWS_CACHED) \
            if pack else 0
        for layer in self.model.layers:
            layer.self_attn.prepare_inference(pack, panel_rows)
            layer.mlp.prepare_inference(pack, panel_rows)
        self.head = InferenceLinear(self.lm_head.weight, pack=pack, panel_rows=panel_rows)
        self.lm_head = None
        if self.config.tie_word_embeddings:
            self.model.embed_tokens = None
        self.stack = self._stack_addresses()  # only where every layer's linear has panels, all for ``panel_rows``
        self.panel_rows = panel_rows if self.stack is not None else 0

    def _stack_addresses(self) -> torch.Tensor | None:
        """int64 [layers, 8]: each layer's weights for :func:`engine.native.decode_stack` (decode_stack.c's order),
        where every linear has panels and every norm is rows of one dtype (float32, or bfloat16: decode_stack.c runs
        either) with one epsilon; else None. The addresses stay
        valid: the InferenceLinears hold their panels, and ``_stack_norms`` the norms' weights as they are now (a
        snapshot of the storage: norm weights changed in place are seen, ones given new storage are not)."""
        layers = self.model.layers
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(self.model.norm)
        fits = native._fits_bf16 if norms[0].weight.dtype is torch.bfloat16 else native._fits  # one dtype throughout
        if not layers or any(n.eps != norms[0].eps or not fits(n.weight) for n in norms):
            return None
        if self.config.qk_norm:  # decode_stack.c has no per-head q/k norm
            return None
        self._stack_norms = [n.weight.detach() for n in norms]  # per layer: input, post-attention; then the final
        rows = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp  # the MLP's linears have no bias (prepare_inference makes none)
            linears = (attn.qkv, attn.out, mlp.gate_up, mlp.down)
            if any(m is None or m.panels is None for m in linears) or \
                    any(m.bias is not None and not fits(m.bias) for m in linears):
                return None
            rows.append([self._stack_norms[2 * i].data_ptr(), attn.qkv.panels.data_ptr(), _address(attn.qkv.bias),
                         attn.out.panels.data_ptr(), _address(attn.out.bias), self._stack_norms[2 * i + 1].data_ptr(),
                         mlp.gate_up.panels.data_ptr(), mlp.down.panels.data_ptr()])
        return torch.tensor(rows, dtype=torch.int64)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], attend: Callable,
                layer_hook: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """input_ids, positions [tokens] -> final hidden states [tokens, hidden]. Inference only (the engine runs it
        under ``torch.inference_mode``): residuals are added in place; training uses :meth:`forward_dense`.

        ``layer_hook(layer, attention_output)`` sees each layer's attention output [tokens, heads, dim] (used to prove
        that relocating blocks leaves attention unchanged)."""
        x = self.embed(input_ids)  # [tokens, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if self.stack is not None and layer_hook is None and meta.slot_mapping is not None and not meta.prefills \
                and not meta.groups and meta.num_decode == x.shape[0] <= self.panel_rows and decodes_natively(attend):
            # a decode batch of a model with panels: every layer in one native call, the same kernels in the same
            # order as the loop below takes them (the same bits), without the Python between them
            attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
            plan = meta.decode_plan
            out = native.decode_stack(x, self.stack, kv_caches, self._stack_norms[-1], cos, sin, meta.slot_mapping,
                                      plan.tables, plan.seq_lens,
                                      (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                       mlp.down.in_features, kv_caches[0][0].shape[1]),
                                      self.model.norm.eps, self._layer_scales(kv_caches[0][0].dtype in FP8_DTYPES),
                                      meta.sliding_window)
            if out is not None:
                return out
        delta = None  # what the last block adds to the residual stream x, added where the next norm reads x
        for i, layer in enumerate(self.model.layers):
            key_cache, value_cache = kv_caches[i]
            layer_meta = meta.groups[self.layer_group[i]] if meta.groups else meta
            hook = None if layer_hook is None else (lambda out, i=i: layer_hook(i, out))
            attend_i = attend if hook is None else _hooked(attend, hook)
            h = _add_norm(x, delta, layer.input_layernorm)
            delta = layer.self_attn(h, cos, sin, layer_meta, key_cache, value_cache, attend_i)
            delta = layer.mlp(_add_norm(x, delta, layer.post_attention_layernorm))
        return _add_norm(x, delta, self.model.norm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``input_ids`` (any shape) -> [..., hidden]: the embedding table's rows, or where the
        output head shares that table (and holds it since prepare_inference), the head's."""
        if self.model.embed_tokens is not None:
            return self.model.embed_tokens(input_ids)
        return self.head.rows(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.head(hidden) if self.head is not None else self.lm_head(hidden)).float()  # [tokens, vocab]

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, time] -> logits [batch, time, vocab], plain causal attention from position 0."""
        x = self.embed(input_ids)  # [b, t, hidden]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = x + layer.self_attn.forward_dense(layer.input_layernorm(x), cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x)
        return self.head(x) if self.head is not None else self.lm_head(x)


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _add_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> torch.Tensor:
    """``x += delta`` in place (inference only), then ``norm(x)``: one pass of the native kernel where it applies."""
    out = native.add_rms_norm(x, delta, norm.weight, norm.eps)  # None: not rows of float32 on the CPU, or no kernel
    if out is None:
        if delta is not None:
            x += delta
        out = norm(x)
    return out


def _hooked(attend: Callable, hook: Callable[[torch.Tensor], None]) -> Callable:
    def run(*args):
        out = attend(*args)
        hook(out)
        return out
    return run

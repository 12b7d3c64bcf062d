"""Native kernels for the decode step: ``csrc/*.c``, built on first use with the machine's C compiler into one
shared library and called through ctypes.

- ``paged_decode.c``: decode attention reading K/V in place through the block tables (:func:`decode`): one walk
  for float32 and bfloat16 queries over float32, bfloat16 and fp8 pools (``elements.h``: the element kinds, fp8's
  reads and vLLM's cache write), with a sliding window for all, and torch's own order for bfloat16 queries where the
  machine has AVX-512 BF16.
- ``rope_store.c``: the rotary embedding of queries and keys, and the step's K/V written to their slots
  (:func:`rope_store`), bit for bit what the torch form computes (an fp8 pool: the bytes engine/kv/fp8.py writes).
- ``norm_act.c``: the residual add with the RMSNorm after it (:func:`add_rms_norm`), and the SwiGLU activation
  (:func:`silu_mul`), one pass each instead of torch's composite operations (within a few units in the last place
  of the torch form).
- ``small_gemm.c``: ``x W^T + b`` with W packed into panels of 48 outputs (:func:`pack_panels`,
  :func:`panel_linear`), for decode batches: up to 16 rows of models larger than the last-level cache, up to 64 of
  models that fit (see engine.model.causal_lm.InferenceLinear).
- ``decode_stack.c``: a decode step through every layer in one call (:func:`decode_stack`): the kernels above in
  the order and with the arguments engine.model.causal_lm.CausalLM.forward gives them, without the Python between them.
- ``norm_act_bf16.c`` (with ``bf16.h``): the bfloat16 path's norms, SwiGLU and rotary embedding, reached through
  the same functions with bfloat16 tensors; they round where transformers' bfloat16 operations round
  (docs/engine.md, "bfloat16"). They share the float32 kernels' walks (``row_walks.h``), and ``decode_stack.c`` is
  written once for both element types of the activations.
- ``small_gemm_bf16.c``: the bfloat16 panel GEMM (:func:`pack_panels` and :func:`panel_linear` with bfloat16
  tensors): ``vdpbf16ps`` on pairs of inputs, or AMX tiles where the CPU has them (:func:`use_bf16_amx`), float32
  sums rounded once.

Why native: decode attention in torch's eager ops must copy each sequence's scattered blocks into a contiguous
tensor (``index_select``) before SDPA or a matmul can read them: that copy was 24% of a decode step of the built-in
model at batch 64, and the attention after it another 23%. The kernel reads every K/V row in place, through the
block table, once. It runs on torch's own OpenMP threads (torch's libgomp is already loaded, so the kernel's
``omp parallel`` joins the same runtime rather than starting a second team that would fight the first).

The shared library is cached under ``$PAGED_KV_EXPLORER_CACHE`` (default ``$XDG_CACHE_HOME/paged-kv-explorer`` or
``~/.cache/paged-kv-explorer``; a folder in the temporary directory where that cannot be written), named by a hash
of the sources, the compiler's version, the flags and the CPU's features, so a build happens once per machine
(about a second). Without a compiler, or when the build fails, :func:`kernel` answers
None and the caller takes the eager path, which computes the same attention. ``PAGED_KV_NATIVE=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.c")))
HEADERS = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.h")))  # included by the sources: hashed with them
STALE_DAYS = 30  # a library of another version of the sources, unused this long, is deleted when one is loaded
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11")

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, or None once a build or load failed; "error": why


def cache_dir() -> Path:
    """Where built kernels are kept."""
    if os.environ.get("PAGED_KV_EXPLORER_CACHE"):
        return Path(os.environ["PAGED_KV_EXPLORER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paged-kv-explorer"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpuinfo(*keys: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of ``keys``; None where Linux does not list one."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(keys)), None)
    except OSError:
        return None


def _cpu() -> str:
    """What -march=native builds for: the processor's feature flags where Linux lists them."""
    flags = _cpuinfo("flags", "Features")
    return platform.machine() + (flags if flags is not None else platform.processor())


def _vendor() -> str:
    """The processor's vendor as Linux names it (GenuineIntel, AuthenticAMD, ...), or "" where it does not say."""
    line = _cpuinfo("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def _writable(directory: Path) -> Path:
    """``directory``, made if needed; where it cannot be written (a read-only home), a folder of this user's in the
    temporary directory instead."""
    for candidate in (directory, Path(tempfile.gettempdir()) / f"paged-kv-explorer-{os.getuid()}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise RuntimeError(f"no writable folder for the built kernels ({directory} cannot be written)")


def _build():
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES + HEADERS), version.encode(),
                                        " ".join(FLAGS).encode(), _cpu().encode()])).hexdigest()[:16]
    directory = _writable(cache_dir())
    target = directory / f"kernels-{digest}.so"
    if not target.is_file():
        fd, temp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", temp, "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(temp, target)  # atomic: another process building the same kernel ends with the same file
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
    lib = ctypes.CDLL(str(target))
    _prune(directory, target)
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {  # csrc/kernels.h; every one returns an int status
        "paged_decode": [ptr] * 4 + [i64, ptr, ptr, i64] + [i32] * 4 + [f32, f32, i64, i32, i32],
        "rope_store_f32": [ptr] * 7 + [i64] + [i32] * 4 + [f32, f32, i32],
        "add_rms_norm_f32": [ptr] * 4 + [i64, i32, f32, i32],
        "silu_mul_f32": [ptr, ptr, i64, i32, i32],
        "panel_gemm_f32": [ptr] * 4 + [i64] * 3 + [i32],
        "decode_stack_f32": [ptr] * 5 + [i32] + [ptr] * 5 + [i64, ptr, i64] + [i32] * 6 + [f32, ptr, i64, i32, i32],
        "decode_stack_bf16": [ptr] * 5 + [i32] + [ptr] * 5 + [i64, ptr, i64] + [i32] * 6 + [f32, ptr, i64, i32, i32],
        "rope_store_bf16": [ptr] * 7 + [i64] + [i32] * 4 + [f32, f32, i32],  # csrc/norm_act_bf16.c
        "add_rms_norm_bf16": [ptr] * 4 + [i64, i32, f32, i32],
        "silu_mul_bf16": [ptr, ptr, i64, i32, i32],
        "panel_gemm_bf16": [ptr] * 4 + [i64] * 3 + [i32],  # csrc/small_gemm_bf16.c
        "bf16_amx": [i32],  # csrc/small_gemm_bf16.c
        "bf16_decode_torch_order": [i32],  # csrc/paged_decode.c
        "bf16_softmax_row": [ptr, i64, ptr, ptr, ptr],  # csrc/paged_decode.c (tests)
        "kernels_fail_scratch": [i32],  # csrc/decode_stack.c (tests)
        "argmax_rows_f32": [ptr, ptr, ptr, i64, i64, i32],  # csrc/argmax.c
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = i32, argtypes
    return lib


def _prune(directory: Path, loaded: Path) -> None:
    """Mark ``loaded`` as used now (its modification time) and delete the libraries of other source versions that no
    process has loaded for STALE_DAYS (each is about 30 KB, one per version an update brought), and temporary files
    that a build killed midway left a day ago or more. A library another process has mapped stays mapped."""
    now = time.time()
    try:
        os.utime(loaded)
        for path in directory.iterdir():
            if path == loaded or path.suffix != ".so":
                continue
            age = now - path.stat().st_mtime
            if (path.name.startswith("kernels-") and age > STALE_DAYS * 86400) or \
                    (path.name.startswith("tmp") and age > 86400):
                path.unlink()
    except OSError as exc:  # a folder shared read-only, a file another process deleted first: nothing to tidy
        log.debug("kernel cache not tidied: %s", exc)


def kernel():
    """The loaded library, building it first if needed; None where it cannot be had (the reason is logged
    once and kept in :func:`error`)."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            lib = None
            if os.environ.get("PAGED_KV_NATIVE", "1") == "0":
                _state["error"] = "turned off by PAGED_KV_NATIVE=0"
            else:
                try:
                    lib = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                    _state["error"] = str(exc)
                    log.warning("native paged attention unavailable (%s); using the eager path", exc)
                if lib is not None and _vendor() != "GenuineIntel":
                    # bfloat16 decode attention in torch's order copies the sums of MKL's Intel kernels, which
                    # torch's build calls on Intel processors (docs/engine.md, "torch's decode attention, read off
                    # its bits"); MKL may take other code elsewhere, so there the kernel keeps its own order
                    lib.bf16_decode_torch_order(0)
            _state["lib"] = lib
    return _state["lib"]


def error() -> str | None:
    """Why the kernel is unavailable, once that is known."""
    return _state.get("error")


def _fits(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can read these tensors as raw memory: float32, on the CPU, contiguous. (Shapes the C code
    does not handle, such as more than 256 query heads, it refuses itself: the caller then gets None.)"""
    for t in tensors:  # a loop of cheap attribute reads: this runs a dozen times a decode step
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def _kind(t: torch.Tensor, elementwise: bool = False):
    """(the check that tensors fit, the kernels' name suffix) for ``t``'s dtype: one table for the float32 kernels and
    the bfloat16 ones (csrc/*_bf16.c), which take the same arguments with bfloat16 tensors. None for another dtype,
    and for bfloat16 ``elementwise`` kernels while :func:`use_bf16_elementwise` has them off."""
    if t.dtype is torch.bfloat16:
        return None if elementwise and not _bf16_enabled else (_fits_bf16, "bf16")
    return (_fits, "f32") if t.dtype is torch.float32 else None


ELEMENT = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # csrc/elements.h


def _raw(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can read these tensors as raw memory: on the CPU, contiguous, no autograd."""
    return all(t.is_cpu and t.is_contiguous() and not t.requires_grad for t in tensors)


def _inverse(scale: float) -> float:
    """1 / scale in float32, as vLLM's cache write takes it (engine/kv/fp8.py)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))


def decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, window: int | None = None,
           out_scale: float = 1.0) -> torch.Tensor | None:
    """Decode attention through the kernel (csrc/paged_decode.c, one walk for every element type): query [seqs,
    heads, dim] float32 or bfloat16; caches [blocks, block_size, kv_heads, dim] of the query's dtype or fp8 (read as
    the values they hold: the caller folds K's scale into ``scale``); tables int [seqs, >= each sequence's live
    blocks] whose live entries are valid block ids (the caller checks); seq_lens int [seqs] -> [seqs, heads, dim].
    ``window``: a sliding window (the query at position p reads keys at positions > p - window; blocks wholly before
    that are not read, their entries may be -1). ``out_scale``: the output times it, after its rounding (V's scale,
    as the layer multiplies it). None where the kernel is unavailable or does not handle the tensors. A bfloat16
    query with AVX-512 BF16 and a head size that is a multiple of 32 takes torch's own CPU flash attention operation
    for operation (its bits: greedy tokens stay with transformers'), else the walk widens to float32 and sums in
    float32, the output rounded to bfloat16 once."""
    lib = kernel()
    q_kind, kv_kind = ELEMENT.get(query.dtype), ELEMENT.get(key_cache.dtype)
    if lib is None or q_kind is None or q_kind > 1 or kv_kind is None or value_cache.dtype != key_cache.dtype or \
            (kv_kind != q_kind and kv_kind < 2):
        return None
    query = query.contiguous()
    if not _raw(query, key_cache, value_cache):
        return None
    seqs, heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    tables = tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty((seqs, heads, dim), dtype=query.dtype)
    status = lib.paged_decode(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
                              tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, dim,
                              block_size, scale, out_scale, window or 0, q_kind | kv_kind << 4,
                              torch.get_num_threads())
    if status == 2:
        raise MemoryError("paged attention: out of memory for the scores of the longest context")
    return None if status else out


def _fits_bf16(*tensors: torch.Tensor) -> bool:
    """:func:`_fits` for the bfloat16 kernels: bfloat16, on the CPU, contiguous."""
    return all(t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() for t in tensors)


_bf16_enabled = True  # the elementwise bfloat16 kernels (norm_act_bf16.c); off: torch's bfloat16 operations


def use_bf16_elementwise(enabled: bool = True) -> bool:
    """Let the bfloat16 path's norms, activation and rotary embedding take csrc/norm_act_bf16.c (True, the default)
    or torch's operations (False: for benchmarks comparing the two). Returns the previous setting."""
    global _bf16_enabled
    previous, _bf16_enabled = _bf16_enabled, bool(enabled)
    return previous


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, heads: int, kv_heads: int,
               scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor | None:
    """The rotated queries [tokens, heads, dim], with the rotated keys and the values written to ``slots`` of the
    caches [blocks, block_size, kv_heads, dim]: ``qkv`` [tokens, (heads + 2 kv_heads) * dim] from the fused
    projection, ``cos``/``sin`` [tokens, 1, dim] from Rotary.cos_sin. Caches of qkv's dtype take the rows as they
    are; fp8 caches take them quantised with ``scales`` (K's, V's) as engine/kv/fp8.py's cache write does. None where
    the kernel is unavailable or does not handle the tensors (the caller does it in torch, with the same bits;
    bfloat16: rounding where transformers does)."""
    lib = kernel()
    kind = None if lib is None else _kind(qkv, elementwise=True)
    kv_kind = ELEMENT.get(key_cache.dtype)
    if kind is None or not kind[0](qkv, cos, sin) or slots.dtype != torch.int64 or qkv.requires_grad or \
            kv_kind is None or value_cache.dtype != key_cache.dtype or not _raw(key_cache, value_cache) or \
            (key_cache.dtype != qkv.dtype and kv_kind < 2):
        return None
    tokens, dim = qkv.shape[0], key_cache.shape[-1]
    q = torch.empty((tokens, heads, dim), dtype=qkv.dtype)
    slots = slots.contiguous()
    fp8 = kv_kind >= 2
    status = getattr(lib, "rope_store_" + kind[1])(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), q.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), tokens, heads, kv_heads, dim, kv_kind, _inverse(scales[0]) if fp8 else 1.0,
        _inverse(scales[1]) if fp8 else 1.0, torch.get_num_threads())
    return None if status else q


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``x += delta`` (in place, when given), then the RMSNorm of ``x`` [rows, n] with ``weight`` [n], as a new
    tensor. None (and ``x`` untouched) where the kernel is unavailable or does not handle the tensors."""
    lib = kernel()
    kind = None if lib is None else _kind(x, elementwise=True)
    tensors = (x, weight) if delta is None else (x, weight, delta)
    if kind is None or not kind[0](*tensors) or x.dim() != 2 or weight.shape != x.shape[1:] or x.requires_grad or \
            (delta is not None and (delta.shape != x.shape or delta.requires_grad)):  # autograd: the torch form
        return None
    out = torch.empty_like(x)
    status = getattr(lib, "add_rms_norm_" + kind[1])(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                                     weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                                     torch.get_num_threads())
    return None if status else out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of the fused projection's output [rows, 2 n] (gate, then up) -> [rows, n]. None where
    the kernel is unavailable or does not handle the tensor."""
    lib = kernel()
    kind = None if lib is None else _kind(gate_up, elementwise=True)
    if kind is None or not kind[0](gate_up) or gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.requires_grad:
        return None
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype)
    status = getattr(lib, "silu_mul_" + kind[1])(gate_up.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
    return None if status else out


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """``logits.argmax(dim=-1).tolist()`` for float32 logits [rows, vocab] on the CPU (csrc/argmax.c: the same
    answer, NaN rows included, in a vectorised walk). None where the kernel is unavailable or does not take the
    tensor."""
    checked = argmax_checked(logits)
    return None if checked is None else checked[0]


def argmax_checked(logits: torch.Tensor) -> tuple[list[int], frozenset[int]] | None:
    """:func:`argmax_rows` and, from the same pass over the logits, the rows holding a NaN or an infinity (what the
    engine must not sample from). None where the kernel is unavailable or does not take the tensor."""
    lib = kernel()
    if lib is None or logits.dim() != 2 or not _fits(logits) or logits.requires_grad or not logits.shape[1]:
        return None
    if not logits.shape[0]:
        return [], frozenset()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    bad = torch.empty(logits.shape[0], dtype=torch.uint8)
    status = lib.argmax_rows_f32(logits.data_ptr(), out.data_ptr(), bad.data_ptr(), logits.shape[0],
                                 logits.shape[1], torch.get_num_threads())
    if status:
        return None
    return out.tolist(), frozenset(torch.nonzero(bad).flatten().tolist()) if bool(bad.any()) else frozenset()


PANEL = 48  # outputs per panel of a packed weight (small_gemm.c's WIDTH)


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """A Linear's weight [out, in] laid out for :func:`panel_linear`: [panels, in, 48], panel p holding outputs
    48p .. 48p + 47 side by side for each input (zeros past ``out``). None where the kernel is unavailable or the
    weight is not float32 on the CPU."""
    weight = weight.detach().contiguous()
    if kernel() is None or weight.dim() != 2:
        return None
    if _fits_bf16(weight):
        return _pack_panels_bf16(weight)
    if not _fits(weight):
        return None
    n, k = weight.shape
    whole = n // PANEL
    panels = torch.zeros((-(-n // PANEL), k, PANEL), dtype=weight.dtype)  # filled in place: no temporary copy
    panels[:whole].copy_(weight[:whole * PANEL].view(whole, PANEL, k).transpose(1, 2))
    if n % PANEL:
        panels[whole, :, : n % PANEL].copy_(weight[whole * PANEL:].t())
    return panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x W^T + b`` with W packed by :func:`pack_panels`: x [rows, in] -> [rows, out_features]. None where the
    kernel is unavailable or does not handle the tensors (autograd, another dtype, a view that is not contiguous)."""
    lib = kernel()
    if lib is not None and x.dtype is torch.bfloat16:
        return _panel_linear_bf16(lib, x, panels, out_features, bias) if _bf16_gemm_enabled else None
    if lib is None or x.dim() != 2 or x.requires_grad or not _fits(x) or panels.dim() != 3 or \
            x.shape[1] != panels.shape[1] or not 0 < out_features <= panels.shape[0] * PANEL or \
            (bias is not None and (not _fits(bias) or bias.numel() != out_features)):
        return None
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    status = lib.panel_gemm_f32(x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                                out.data_ptr(), x.shape[0], out_features, x.shape[1], torch.get_num_threads())
    return None if status else out


_bf16_gemm_enabled = True  # the bfloat16 panel GEMM (small_gemm_bf16.c); off: oneDNN's packed GEMM or F.linear


def use_bf16_gemm(enabled: bool = True) -> bool:
    """Let bfloat16 linears of a decode step's few rows take csrc/small_gemm_bf16.c (True, the default) or oneDNN's
    packed GEMM / F.linear (False: for benchmarks and parity checks comparing the two). Returns the previous
    setting."""
    global _bf16_gemm_enabled
    previous, _bf16_gemm_enabled = _bf16_gemm_enabled, bool(enabled)
    return previous


def _switch(name: str, enabled: bool | None) -> bool:
    """A kernel setting through its C function (mode 1 on, 0 off, -1 ask): whether it served before; where ``enabled``
    is not None it is set so. False without the kernels."""
    lib = kernel()
    if lib is None:
        return False
    previous = bool(getattr(lib, name)(-1))
    if enabled is not None:
        getattr(lib, name)(1 if enabled else 0)
    return previous


def use_bf16_amx(enabled: bool = True) -> bool:
    """Let the bfloat16 panel GEMM sum in the machine's AMX tiles where it has them (True, the default: its AMX walk,
    for input widths that are a multiple of 32) or only with ``vdpbf16ps`` (False: for benchmarks and tests of both
    walks). Returns the previous setting: whether the AMX walk served (False where the machine, the build or Linux
    offers no AMX)."""
    return _switch("bf16_amx", enabled)


def bf16_amx() -> bool:
    """Whether the bfloat16 panel GEMM takes its AMX walk now (csrc/small_gemm_bf16.c's ``bf16_amx``)."""
    return _switch("bf16_amx", None)


def use_bf16_torch_order(enabled: bool = True) -> bool:
    """Let bfloat16 decode attention add in torch's own order where the machine has AVX-512 BF16 (True, the default on
    Intel processors: csrc/paged_decode.c's copy of torch's CPU flash attention for one query row, so that
    greedy tokens stay with transformers') or widen K/V to float32 and sum in the kernel's own order (False: for
    benchmarks and tests of both). Returns the previous setting: whether torch's order served."""
    return _switch("bf16_decode_torch_order", enabled)


def bf16_torch_order() -> bool:
    """Whether bfloat16 decode attention adds in torch's order now (csrc/paged_decode.c's
    ``bf16_decode_torch_order``; never on a machine without AVX-512 BF16)."""
    return _switch("bf16_decode_torch_order", None)


PANEL_ROWS_BF16 = 64  # most rows panel_gemm_bf16 takes (csrc/kernels.h's PANEL_ROWS_BF16)


def _pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """:func:`pack_panels` of a bfloat16 weight [out, in], for csrc/small_gemm_bf16.c: [panels, ceil(in / 2), 48, 2],
    each pair of inputs' 48 x 2 weights side by side (output o's two weights next to each other: the layout
    vdpbf16ps multiplies), zeros past ``out`` and past ``in``."""
    n, k = weight.shape
    padded = torch.zeros((-(-n // PANEL) * PANEL, k + k % 2), dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(-1, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def _panel_linear_bf16(lib, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`panel_linear` of bfloat16 rows over :func:`_pack_panels_bf16`'s panels (float32 sums, the bias added
    in float32, rounded to bfloat16 once): x [rows <= 64, in] -> [rows, out_features]."""
    if x.dim() != 2 or x.requires_grad or not _fits_bf16(x, panels) or panels.dim() != 4 or \
            not 0 < x.shape[0] <= PANEL_ROWS_BF16 or panels.shape[1] != -(-x.shape[1] // 2) or \
            not 0 < out_features <= panels.shape[0] * PANEL or \
            (bias is not None and (not _fits_bf16(bias) or bias.numel() != out_features)):
        return None
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    status = lib.panel_gemm_bf16(x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                                 out.data_ptr(), x.shape[0], out_features, x.shape[1], torch.get_num_threads())
    return None if status else out


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache's size, as Linux lists it under ``root`` (32 MiB where it does not say)."""
    best = 0
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            best = max(best, int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1))
        except (OSError, ValueError, IndexError):
            continue
    return best or 32 << 20


STACK_FIELDS = 8  # addresses per layer in decode_stack's weights table (decode_stack.c's FIELDS)
TEAM_PROBE_EVERY = 64  # one-call steps between two tries of the team size not in use (TeamSize)
TEAM_EMA = 0.25  # weight of a step's time in its team size's running average


class TeamSize:
    """How many threads a one-call decode step takes: all of torch's, or one, whichever has been faster lately for
    steps of that many rows. Each step is timed; the size in use is tried again every TEAM_PROBE_EVERY steps.

    Why: the step's kernels hand their parts from thread to thread hundreds of times a step. On a machine whose cores
    other processes also want, a thread is often off its core for a whole time slice while the other waits for its
    part, and two threads then ran a step slower than one (docs/engine.md, "One region per decode step"); on a quiet
    machine two are faster. The thread count does not change a step's bits (each output is summed in one order by
    whichever thread takes it: tested), only its time."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._seconds: dict[tuple, dict[int, float]] = {}  # (rows, most threads) -> {threads: average seconds}
        self._calls: dict[tuple, int] = {}

    def choose(self, rows: int, most: int) -> int:
        if most <= 1:
            return 1
        key = (rows, most)
        with self._lock:
            seen = self._seconds.setdefault(key, {})
            calls = self._calls[key] = self._calls.get(key, 0) + 1
            for threads in (most, 1):
                if threads not in seen:
                    return threads
            best = min((most, 1), key=seen.__getitem__)
            return (1 if best == most else most) if calls % TEAM_PROBE_EVERY == 0 else best

    def record(self, rows: int, most: int, threads: int, seconds: float) -> None:
        key = (rows, most)
        with self._lock:
            seen = self._seconds.setdefault(key, {})
            old = seen.get(threads)
            seen[threads] = seconds if old is None else old + TEAM_EMA * (seconds - old)

    def averages(self, rows: int, most: int) -> dict[int, float]:
        """The running average seconds of each team size tried for steps of ``rows`` rows (for benches and tests)."""
        with self._lock:
            return dict(self._seconds.get((rows, most), {}))


team_size = TeamSize()


def decode_stack(x: torch.Tensor, weights: torch.Tensor, caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, shape: tuple[int, int, int, int, int], eps: float,
                 layer_scales: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """A decode step through every layer (decode_stack.c): x [tokens, hidden], the embedded tokens, is the residual
    stream (updated in place); returns the final norm of it [tokens, hidden]. ``weights`` int64 [layers, 8]: each
    layer's addresses, made by engine.model.causal_lm.CausalLM (the tensors must outlive it); ``caches`` each layer's
    (key, value) caches [blocks, block_size, kv_heads, dim], of x's dtype or fp8; ``shape`` (heads, kv_heads, dim,
    intermediate, block_size); ``layer_scales`` float32 [layers, 4]: each layer's softmax scale, K's and V's scale
    as the cache write takes them (1 / scale in float32) and V's scale on the output; ``window``: every layer's
    sliding window. None, with nothing written, where the kernel is unavailable or does not take the tensors;
    MemoryError when a kernel ran out of scratch memory midway (x and the caches partly updated)."""
    lib = kernel()
    heads, kv_heads, dim, inter, block_size = shape
    bf16 = x.dtype is torch.bfloat16  # the bfloat16 kernels, where the layer-by-layer loop would take them all
    fits = _fits_bf16 if bf16 else _fits
    kv_kind = ELEMENT.get(caches[0][0].dtype) if caches else ELEMENT[x.dtype]
    if lib is None or not fits(x, final_norm, cos, sin) or x.dim() != 2 or weights.dim() != 2 or \
            weights.shape != (len(caches), STACK_FIELDS) or weights.dtype != torch.int64 or \
            not weights.is_contiguous() or slots.dtype != torch.int64 or kv_kind is None or \
            (kv_kind != ELEMENT[x.dtype] and kv_kind < 2) or not _fits(layer_scales) or \
            layer_scales.shape != (len(caches), 4) or \
            (bf16 and (not _bf16_enabled or not _bf16_gemm_enabled or x.shape[0] > PANEL_ROWS_BF16)):
        return None
    for key_cache, value_cache in caches:  # the layout the kernels index: [blocks, block_size, kv_heads, dim]
        if ELEMENT.get(key_cache.dtype) != kv_kind or value_cache.dtype != key_cache.dtype or \
                not _raw(key_cache, value_cache) or key_cache.shape != value_cache.shape or \
                key_cache.shape[1:] != (block_size, kv_heads, dim):
            return None
    tokens, hidden = x.shape
    tables = tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if tables.shape[0] != tokens or seq_lens.shape[0] != tokens or slots.shape[0] != tokens:
        return None
    addresses = torch.tensor([t.data_ptr() for pair in caches for t in pair], dtype=torch.int64)
    scratch = torch.empty(tokens * (2 * hidden + (heads + 2 * kv_heads) * dim + 2 * heads * dim + 3 * inter),
                          dtype=x.dtype)
    out = torch.empty_like(x)
    slots = slots.contiguous()
    most = torch.get_num_threads()
    threads = team_size.choose(tokens, most)
    start = team_size.clock()
    status = (lib.decode_stack_bf16 if bf16 else lib.decode_stack_f32)(
        x.data_ptr(), out.data_ptr(), scratch.data_ptr(), weights.data_ptr(), addresses.data_ptr(), weights.shape[0],
        final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
        seq_lens.data_ptr(), tokens, hidden, heads, kv_heads, dim, inter, block_size, eps, layer_scales.data_ptr(),
        window or 0, kv_kind, threads)
    team_size.record(tokens, most, threads, team_size.clock() - start)
    if status == 2:
        raise MemoryError("decode step: out of memory for a kernel's scratch")
    return None if status else out

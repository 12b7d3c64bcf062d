"""The compiled backend: decode attention through a torch.compile'd fused kernel that reads K/V straight from its
blocks, and the default path's per-shape choice of that kernel (:class:`_AutoKernels`).

An engine built with ``compile_attention`` takes the kernel for every shape; the default backend takes it only for
long-context shapes where a background compile measured it faster. Any failure turns it off for good (the eager
backend computes the same thing).
"""
from __future__ import annotations

import logging
import statistics
import threading
import time

import torch

from . import eager as eager_path
from .plan import DecodePlan, _bucket

log = logging.getLogger(__name__)


def _paged_attention_fused(query, key_cache, value_cache, block_tables, seq_lens, scale: float, chunk: int,
                           window: int | None = None):
    """The same attention written so that torch.compile (inductor) fuses the block-table lookups into the
    reductions: each K/V row is read straight from its physical block and nothing is gathered.

    Two choices make the generated loops fast. Scores are laid out with the block's slots innermost, so the dot
    products over ``dim`` become 16-wide vector accumulations over slots instead of one horizontal reduction per
    score. And the softmax runs per chunk of ``chunk`` blocks (split-K, as in flash-decoding): each chunk keeps its
    own maximum, its weighted V sum and its denominator, and the chunks are rescaled to the global maximum and
    added at the end, so no pass over all scores has to finish before V is read."""
    seqs, heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    width = block_tables.shape[1]
    chunks = width // chunk
    live = torch.arange(width, device=query.device).view(1, width) * block_size < seq_lens.view(seqs, 1)
    if window is not None:  # a window's absent blocks (-1) -> block 0, masked out below
        live = live & (block_tables >= 0)
    tables = torch.where(live, block_tables, 0).long().view(seqs, chunks, chunk)  # entries past the end -> block 0
    pos = torch.arange(width * block_size, device=query.device).view(1, chunks, chunk, 1, 1, block_size)
    valid = pos < seq_lens.view(seqs, 1, 1, 1, 1, 1)
    if window is not None:  # the query at len - 1 reads positions > len - 1 - window
        valid = valid & (pos >= seq_lens.view(seqs, 1, 1, 1, 1, 1) - window)
    # [seqs, chunks, chunk, kv_heads, 1, block_size, dim]: indexed inside the fused loops, never materialised
    # (an fp8 pool's codes read as their exact values, in the queries' dtype)
    k = key_cache[tables].to(query.dtype).permute(0, 1, 2, 4, 3, 5).unsqueeze(4)
    v = value_cache[tables].to(query.dtype).permute(0, 1, 2, 4, 3, 5).unsqueeze(4)
    q = (query * scale).view(seqs, 1, 1, kv_heads, group, 1, dim)
    scores = torch.where(valid, (k * q).sum(-1), float("-inf"))  # [seqs, chunks, chunk, kv_heads, group, block_size]
    # A chunk wholly past the end has maximum -inf; clamping keeps exp() at 0 there instead of NaN.
    chunk_max = scores.amax((2, 5), keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    weights = torch.exp(scores - chunk_max)
    partial = (weights.unsqueeze(-1) * v).sum((2, 5))  # [seqs, chunks, kv_heads, group, dim]
    denom = weights.sum((2, 5))  # [seqs, chunks, kv_heads, group]
    chunk_max = chunk_max.view(seqs, chunks, kv_heads, group)
    rescale = torch.exp(chunk_max - chunk_max.amax(1, keepdim=True))  # chunk 0 always holds the first token
    out = (partial * rescale.unsqueeze(-1)).sum(1) / (denom * rescale).sum(1).unsqueeze(-1)
    return out.reshape(seqs, heads, dim)


CHUNK_BLOCKS = 8  # blocks per softmax chunk in the fused kernel (4 and 8 ran alike at batch 32, context 1024)


class _Compiled:
    """Lazily compiled fused kernel, one static specialisation per (batch, width, cache shape) bucket; any failure
    (no C++ compiler, unsupported backend) falls back to eager for good. Past ``MAX_KERNELS`` specialisations new
    shapes take the eager path (dynamo would otherwise run the fused code uncompiled, which is slow)."""

    MAX_KERNELS = 64

    def __init__(self):
        self.enabled = False
        self.failed = False
        self._fn = None
        self._kernels: set[tuple] = set()
        self._lock = threading.Lock()

    def __call__(self, query, key_cache, value_cache, block_tables, seq_lens, scale,
                 window: int | None = None) -> torch.Tensor | None:
        """The attention output, or None for a shape with no kernel left to compile (the caller goes eager)."""
        if not getattr(_thread_state, "limit_raised", False):  # dynamo's settings may be per thread: in each one
            config = torch._dynamo.config
            config.cache_size_limit = max(config.cache_size_limit, self.MAX_KERNELS + 8)
            _thread_state.limit_raised = True
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    self._fn = torch.compile(_paged_attention_fused, dynamic=False)
        seqs, width = block_tables.shape
        padded_seqs, padded_width = _bucket(seqs), _bucket(width)
        key = kernel_key(query, key_cache, seqs, width, scale) + ((window,) if window is not None else ())
        # fresh contiguous copies made in the caller's mode (small: a step's queries and tables), so that what the
        # kernel's guards check (strides, inference-ness, requires_grad) is the same for every call in that mode,
        # from any thread: a view of a caller's tensor would be compiled again on the caller's thread (seconds)
        query = query.detach().clone(memory_format=torch.contiguous_format)
        block_tables = block_tables.to(torch.long, copy=True).contiguous()
        seq_lens = seq_lens.to(torch.long, copy=True).contiguous()
        if key not in self._kernels:
            with self._lock:
                if len(self._kernels) >= self.MAX_KERNELS:
                    return None
                self._kernels.add(key)
        if (padded_seqs, padded_width) != (seqs, width):  # padding rows attend to one slot of block 0; dropped below
            query = torch.cat([query, query.new_zeros(padded_seqs - seqs, *query.shape[1:])])
            block_tables = torch.nn.functional.pad(block_tables, (0, padded_width - width, 0, padded_seqs - seqs))
            seq_lens = torch.cat([seq_lens, seq_lens.new_ones(padded_seqs - seqs)])
        if window is None:
            out = self._fn(query, key_cache, value_cache, block_tables, seq_lens, scale, min(CHUNK_BLOCKS, padded_width))
        else:
            out = self._fn(query, key_cache, value_cache, block_tables, seq_lens, scale, min(CHUNK_BLOCKS, padded_width),
                           window)
        return out[:seqs]


def kernel_key(query, key_cache, num_seqs: int, width: int, scale) -> tuple:
    """The shape bucket a fused kernel is compiled for (one static specialisation each) for ``num_seqs`` sequences
    and tables ``width`` blocks wide, with what else its guards check: grad and inference mode, and whether the
    caches are inference tensors (queries, tables and lengths are copied in the caller's mode: see _Compiled)."""
    return (_bucket(num_seqs), _bucket(width), tuple(query.shape[1:]), tuple(key_cache.shape), query.dtype,
            key_cache.dtype, query.device, float(scale), torch.is_inference_mode_enabled(), torch.is_grad_enabled(),
            key_cache.is_inference())


_thread_state = threading.local()


_compiled = _Compiled()

AUTO_MIN_POSITIONS = 512  # longest context in a batch below which decode always takes the eager path (the fused
#                           kernel lost to it inside the engine at short contexts)
AUTO_MIN_CALLS = 32  # calls of one shape bucket before it is compiled (a bucket seen once is not worth seconds)
AUTO_MARGIN = 0.95  # the compiled kernel takes over a bucket only when its median is at most this times the eager one
AUTO_WARMUP_CALLS = 3  # untimed calls of each path first (the first calls after a compile are slow)
AUTO_TIMING_CALLS = 7  # then timed calls of each path, alternating, whose medians decide a bucket
_TRIAL = "trial"  # a bucket's kernel is compiled and the caller's calls are timing both paths

class _AutoKernels:
    """The default decode path: eager everywhere, and for each long-context shape bucket in steady use, the fused
    kernel once it has been compiled in the background and then measured faster than the eager path on that shape.

    Nothing waits for a compile: the caller goes on eagerly while the "attention-compile" thread compiles (inductor
    keeps what it built in its on-disk cache, so a later run compiles again in a fraction of the time). The timing
    is done by the caller's own calls, which then take the two paths in turn (both give the same attention, to
    rounding): a thread of its own runs torch's kernels at another speed (its own OpenMP team, slower while the
    other team spins) and with another load, so only the caller measures what the caller gets. A compile that
    fails turns the fused kernel off for good (the eager path computes the same thing)."""

    def __init__(self):
        self.enabled = True
        self._lock = threading.Lock()
        self._calls: dict[tuple, int] = {}  # bucket -> calls seen before it was queued
        self._choice: dict[tuple, bool | str | None] = {}  # bucket -> True: fused, False: eager, None: compiling,
        #                                                     _TRIAL: compiled, being timed
        self._trials: dict[tuple, tuple[list, list]] = {}  # bucket -> (eager, fused) seconds of the timed calls
        self._jobs: list = []  # buckets waiting for the thread, with their inputs
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)
        self.decisions: dict[tuple, tuple[float, float]] = {}  # bucket -> (eager, fused) median seconds
        self.timer = time.perf_counter

    def kernel(self, query, key_cache, value_cache, plan: DecodePlan, scale: float) -> torch.Tensor | None:
        """The attention output where this shape's bucket takes the fused kernel or is being timed, else None (go
        eager); notes the shape, and queues its compile once it is in steady use."""
        if not self.enabled or _compiled.failed:
            return None
        key = plan.cache.get("auto")  # the first layer works it out for the step; the others reuse it
        if key is None:
            key = plan.cache["auto"] = self.key(query, key_cache, len(plan.lens), plan.max_len, scale)
        if not key:
            return None
        choice = self._choice.get(key, False)
        if choice is True:
            return _try_compiled(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale)
        if choice == _TRIAL:
            return self._trial(key, query, key_cache, value_cache, plan, scale)
        if choice is False and key not in self._choice:
            self._note(key, query, key_cache, value_cache, plan, scale)
        return None

    @staticmethod
    def key(query, key_cache, num_seqs: int, max_len: int, scale: float) -> tuple:
        """kernel_key of tables for ``num_seqs`` sequences of at most ``max_len`` tokens, without making them; ()
        for a context too short to consider."""
        if max_len < AUTO_MIN_POSITIONS or query.device.type != "cpu":  # a GPU's kernels run asynchronously: the
            return ()  # caller's clock would time their launch, not their work (there, use compile_attention)
        return kernel_key(query, key_cache, num_seqs, -(-max_len // key_cache.shape[1]), scale)

    def _trial(self, key, query, key_cache, value_cache, plan: DecodePlan, scale: float) -> torch.Tensor:
        """One call of a bucket being timed: the eager path and the fused kernel in turn."""
        trial = self._trials.get(key)
        if trial is None:  # decided (or reset) meanwhile by another caller
            return eager_path._paged_attention_eager(query, key_cache, value_cache, plan, scale)
        eager, fused = trial
        use_fused = len(fused) < len(eager)
        start = self.timer()
        out = _try_compiled(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale) if use_fused else None
        if out is None and use_fused:  # the kernel went away (a failure elsewhere): eager from now on
            with self._lock:
                self._choice[key] = False
                self._trials.pop(key, None)
            return eager_path._paged_attention_eager(query, key_cache, value_cache, plan, scale)
        if out is None:
            out = eager_path._paged_attention_eager(query, key_cache, value_cache, plan, scale)
        (fused if use_fused else eager).append(self.timer() - start)
        needed = AUTO_WARMUP_CALLS + AUTO_TIMING_CALLS
        if len(fused) >= needed and len(eager) >= needed:
            with self._lock:
                if self._trials.pop(key, None) is not None:  # once, whichever caller gets here first
                    e = statistics.median(eager[AUTO_WARMUP_CALLS:needed])
                    f = statistics.median(fused[AUTO_WARMUP_CALLS:needed])
                    self.decisions[key] = (e, f)
                    self._choice[key] = f <= AUTO_MARGIN * e
                    self._idle.notify_all()
        return out

    def _note(self, key, query, key_cache, value_cache, plan: DecodePlan, scale: float) -> None:
        with self._lock:
            if key in self._choice:
                return
            calls = self._calls[key] = self._calls.get(key, 0) + 1
            if calls < AUTO_MIN_CALLS or len(self._choice) >= _Compiled.MAX_KERNELS:
                return
            del self._calls[key]
            self._choice[key] = None
            # copies of what changes from step to step (the caches themselves are only read); the compile runs in
            # the caller's modes, which the kernel's guards check
            query, tables, seq_lens = (t.detach().clone() for t in (query, plan.tables, plan.seq_lens))
            modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
            self._jobs.append((key, modes, query, key_cache, value_cache, tables, seq_lens, scale))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="attention-compile", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._jobs:
                        return
                    job = self._jobs.pop(0)
                    if _compiled.failed:  # one compile failed: the others would too, each taking seconds
                        self._choice[job[0]] = False
                        continue
                key, modes, *inputs = job
                compiled = False
                try:
                    with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                        compiled = _compiled(*inputs) is not None  # None: no kernel left to compile for it
                except Exception as exc:  # no C++ compiler, an unsupported backend: eager for good
                    _compiled.failed, _compiled.enabled = True, False
                    log.warning("compiled paged attention unavailable (%s); using the eager path", exc)
                finally:
                    with self._lock:
                        if compiled:
                            self._trials[key] = ([], [])
                        self._choice[key] = _TRIAL if compiled else False
                del job, inputs
        finally:
            with self._lock:
                self._thread = None
                self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued bucket is compiled (its timing is then up to the caller's next calls); False if
        ``timeout`` passed first (for benches and tests)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._jobs and self._thread is None, timeout)

    def choice(self, key: tuple) -> bool | str | None:
        """What a bucket takes: True (fused), False (eager, or not seen), None (compiling), "trial" (being timed)."""
        return self._choice.get(key, False)

    def reset(self, timeout: float | None = 60.0) -> None:
        """Forget every shape seen and decided (kernels compiled stay compiled), after waiting up to ``timeout``
        for a compile under way."""
        self.wait(timeout)
        with self._lock:
            self._calls.clear()
            self._choice.clear()
            self._trials.clear()
            self.decisions.clear()


_auto = _AutoKernels()


def use_auto_kernels(enabled: bool = True) -> bool:
    """Let the default decode path switch long-context shapes to the fused kernel where a background compile found it
    faster (True, the default), or keep it eager everywhere (False). Returns the previous setting."""
    previous, _auto.enabled = _auto.enabled, bool(enabled)
    return previous


def wait_for_kernels(timeout: float | None = None) -> bool:
    """Wait until the background compiles queued so far have been built (the timing is then done by the next calls
    of each shape); False on timeout."""
    return _auto.wait(timeout)


def use_compiled_attention(enabled: bool = True) -> bool:
    """Route the public :func:`paged_attention` through the torch.compile'd fused kernel (True) or the eager gather
    (False); engines choose for themselves (EngineConfig.compile_attention). Returns whether the fused kernel is in
    use (False after a compile failure)."""
    _compiled.enabled = bool(enabled) and not _compiled.failed
    return _compiled.enabled


def _try_compiled(query, key_cache, value_cache, block_tables, seq_lens, scale, window=None) -> torch.Tensor | None:
    """The fused kernel's result, or None when it has failed (then it stays off for good) or has no kernel for this
    shape; the eager path computes the same thing."""
    if _compiled.failed:
        return None
    try:
        return _compiled(query, key_cache, value_cache, block_tables, seq_lens, scale, window)
    except Exception as exc:
        _compiled.failed, _compiled.enabled = True, False
        log.warning("compiled paged attention unavailable (%s); using the eager path", exc)
        return None



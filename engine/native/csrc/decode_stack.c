/* A decode step through every layer of the model in one call: the same kernels, in the same order, with the same
 * arguments as engine/model/causal_lm.py's CausalLM.forward takes them one by one from Python (so the same bits), without
 * the Python between them. Built with engine/native/__init__.py, with the other kernels in this folder.
 *
 * Why: at a decode step of a few rows, each of a layer's nine kernel calls from Python (argument checks, an output
 * tensor, a ctypes call) cost 5-15 us, about 2.5 ms of the 135M shape's 24 ms step at 16 conversations.
 *
 * Per layer l (weights[l]: the addresses of its input norm's weight, the fused q|k|v panels and bias, the output
 * projection's panels and bias, the post-attention norm's weight, the gate|up panels, the down panels; caches[l]:
 * its key and value caches):
 *   h = rmsnorm(x += delta)          (no delta before the first layer)
 *   qkv = h W_qkv^T + b              (panel_gemm_f32)
 *   q = rope(q); k, v -> their slots (rope_store_f32; an fp8 pool: quantised with the layer's scales)
 *   a = attention(q, the pool)       (paged_decode, with the layer's softmax scale, V's scale and the window)
 *   delta = a W_o^T + b
 *   h = rmsnorm(x += delta)
 *   delta = (silu(gate) * up)(h W_gate_up^T) W_down^T
 * and at the end out = rmsnorm(x += delta) with the final norm.
 *
 * Layouts (float32, contiguous): x [tokens, hidden] (the residual stream, updated in place); out [tokens, hidden];
 * scratch: at least tokens * (2 hidden + (heads + 2 kv_heads) dim + 2 heads dim + 3 inter) floats; cos, sin
 * [tokens, dim]; slots int64 [tokens]; tables int64 [tokens, table_stride]; lens int64 [tokens]; layer_scales
 * float [layers, 4]: each layer's softmax scale (K's scale folded in), K's and V's inverse scales for the cache
 * write, V's scale for the output (1 but for an fp8 pool); window: every layer's sliding window (0: none);
 * kv_kind: the pool's element kind (elements.h: the activations' own, or fp8).
 *
 * Returns 0, 1 when a shape is outside what the kernels take (checked before anything is written), or 2 when
 * scratch memory ran out in a kernel (x and the caches are then partly updated: the caller raises).
 */
#include <stdint.h>
#include <stdlib.h>

#include "elements.h"
#include "kernels.h"
#include "team.h"

#define FIELDS 8 /* addresses per layer in weights */

/* One walk for both element types (float32: the _f32 kernels; bfloat16, stored as uint16_t: the _bf16 ones, which
 * round where the layer-by-layer bfloat16 loop rounds, since they are the kernels it calls). The whole step is one
 * OpenMP region; each kernel is cut into CHUNKS parts (its `*_part` for part c of CHUNKS: where a kernel splits its
 * work, its output does not depend on how: tested) that the threads take as they come (team.h's team_step), and the
 * next kernel starts when every part is done; a failure any part meets (scratch memory) stops all of them. Decode
 * attention takes its items from its own counter (whole sequences, or KV heads of them: chosen by the team's size,
 * as the kernel alone chooses them), so its parts are the threads. */
#define DECODE_STACK(T, SUFFIX, KIND)                                                                                  \
int decode_stack_##SUFFIX(T *x, T *out, T *scratch, const int64_t *weights, const int64_t *caches, int layers,         \
                          const T *final_norm, const T *cos, const T *sin, const int64_t *slots,                       \
                          const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t tokens,            \
                          int hidden, int heads, int kv_heads, int dim, int inter, int block_size, float eps,          \
                          const float *layer_scales, int64_t window, int kv_kind, int threads) {                       \
    if (tokens < 1 || layers < 0 || hidden < 1 || inter < 1 || !rope_store_takes(heads, kv_heads, dim) ||             \
        !paged_decode_takes(heads, kv_heads, dim, block_size) || tokens > PANEL_ROWS_BF16 || window < 0 ||             \
        (kv_kind != KIND && (!el_fp8(kv_kind) || dim > MAX_DIM)))                                                      \
        return 1;                                                                                                      \
    const int64_t qkv_n = (int64_t)(heads + 2 * kv_heads) * dim, attn_n = (int64_t)heads * dim;                       \
    T *h = scratch, *qkv = h + tokens * hidden, *q = qkv + tokens * qkv_n, *attn = q + tokens * attn_n;               \
    T *delta = attn + tokens * attn_n, *gate_up = delta + tokens * hidden, *act = gate_up + tokens * 2 * inter;       \
    int64_t *next = calloc((size_t)(layers > 0 ? layers : 1), sizeof *next); /* each layer's attention items */       \
    if (!next) return 2;                                                                                               \
    if (threads < 1) threads = 1;                                                                                      \
    const int steps = 9 * layers + 1;                                                                                  \
    team_step *step = calloc((size_t)steps, sizeof *step); /* each kernel's parts: handed out, done */                 \
    if (!step) { free(next); return 2; }                                                                               \
    team_state team = {0};                                                                                             \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")                                                      \
    {                                                                                                                  \
        const int team_size = omp_get_num_threads();                                                                   \
        const int chunks = team_size > 1 ? CHUNKS_PER_THREAD * team_size : 1; /* parts of each kernel */               \
        int s = 0, failed = 0;                                                                                         \
        for (int l = 0; l < layers; l++) {                                                                             \
            const int64_t *w = weights + (int64_t)l * FIELDS;                                                          \
            void *key_cache = (void *)(intptr_t)caches[2 * l];                                                        \
            void *value_cache = (void *)(intptr_t)caches[2 * l + 1];                                                  \
            const float *ls = layer_scales + 4 * (int64_t)l; /* softmax scale, K's and V's inverse, V's scale */       \
            STEP(add_rms_norm_##SUFFIX##_part(x, l ? delta : 0, P(T, w[0]), h, tokens, hidden, eps, t, nt));           \
            STEP(panel_gemm_##SUFFIX##_part(h, P(T, w[1]), P(T, w[2]), qkv, tokens, qkv_n, hidden, t, nt));            \
            STEP(rope_store_##SUFFIX##_part(qkv, cos, sin, slots, q, key_cache, value_cache, tokens, heads, kv_heads,  \
                                            dim, kv_kind, ls[1], ls[2], t, nt));                                       \
            STEP(paged_decode_part(q, key_cache, value_cache, tables, table_stride, lens, attn, tokens, heads,         \
                                   kv_heads, dim, block_size, ls[0], ls[3], window, KIND | kv_kind << 4, next + l,     \
                                   t % team_size, team_size));                                                         \
            STEP(panel_gemm_##SUFFIX##_part(attn, P(T, w[3]), P(T, w[4]), delta, tokens, hidden, attn_n, t, nt));      \
            STEP(add_rms_norm_##SUFFIX##_part(x, delta, P(T, w[5]), h, tokens, hidden, eps, t, nt));                   \
            STEP(panel_gemm_##SUFFIX##_part(h, P(T, w[6]), 0, gate_up, tokens, 2 * inter, hidden, t, nt));             \
            STEP(silu_mul_##SUFFIX##_part(gate_up, act, tokens, inter, t, nt));                                        \
            STEP(panel_gemm_##SUFFIX##_part(act, P(T, w[7]), 0, delta, tokens, hidden, inter, t, nt));                 \
        }                                                                                                              \
        if (!failed)                                                                                                   \
            do {                                                                                                       \
                STEP(add_rms_norm_##SUFFIX##_part(x, layers ? delta : 0, final_norm, out, tokens, hidden, eps, t,      \
                                                  nt));                                                                \
            } while (0);                                                                                               \
    }                                                                                                                  \
    free(step);                                                                                                        \
    free(next);                                                                                                        \
    return __atomic_load_n(&team.failed, __ATOMIC_ACQUIRE);                                                            \
}

static int scratch_countdown; /* 0: allocations succeed; n > 0: the n-th from now fails (once) */

int kernels_fail_scratch(int n) {
    __atomic_store_n(&scratch_countdown, n > 0 ? n : 0, __ATOMIC_RELAXED);
    return 0;
}

void *team_scratch(size_t bytes) {
    if (__atomic_load_n(&scratch_countdown, __ATOMIC_RELAXED) > 0 &&
        __atomic_sub_fetch(&scratch_countdown, 1, __ATOMIC_RELAXED) == 0)
        return 0;
    return malloc(bytes);
}

#define P(T, address) ((T *)(intptr_t)(address))
#define CHUNKS_PER_THREAD 4 /* parts of a kernel per thread of the team: a part late for its thread waits a quarter */
/* one kernel: the parts this thread takes (`call`: its part t of nt = part t of chunks), then wait for the others'; a
 * failure anywhere ends the layer loop (`break`) for every thread */
#define STEP(call)                                                                                                     \
    {                                                                                                                  \
        team_step *step_ = step + s++;                                                                                 \
        for (int t; !__atomic_load_n(&team.failed, __ATOMIC_RELAXED) &&                                               \
                    (t = __atomic_fetch_add(&step_->next, 1, __ATOMIC_RELAXED)) < chunks;) {                           \
            const int nt = chunks; (void)nt; /* (attention takes the team's size instead) */                          \
            team_part_done(&team, step_, (call));                                                                      \
        }                                                                                                              \
        failed = chunks > 1 ? team_step_wait(&team, step_, chunks) : __atomic_load_n(&team.failed, __ATOMIC_RELAXED);  \
    }                                                                                                                  \
    if (failed) break

DECODE_STACK(float, f32, EL_F32)
DECODE_STACK(uint16_t, bf16, EL_BF16)

/* The functions the shared library exports (called from engine/native/__init__.py through ctypes, and from one another by
 * decode_stack.c), declared once so that the compiler holds every definition and every caller to one signature,
 * and the shape limits more than one of them checks. Each returns 0, 1 for shapes it does not take (before
 * writing anything), or 2 when scratch memory ran out. */
#ifndef PAGED_KV_KERNELS_H
#define PAGED_KV_KERNELS_H

#include <stdint.h>

#define MAX_HEADS 256 /* query heads of one sequence paged_decode handles (more: the caller goes eager) */
#define MAX_DIM 512   /* head size of the walks that hold a head's row on the stack (torch's order, an fp8 write) */

#define PANEL_WIDTH 48 /* outputs in a panel of the packed GEMMs (small_gemm.c, small_gemm_bf16.c): three vectors */
#define PANEL_ROWS_BF16 64 /* most rows of x panel_gemm_bf16 (and so decode_stack) takes: engine/native/__init__.py's
                            * PANEL_ROWS_BF16, the decode batches of engine/model/causal_lm.py's PANEL_ROWS_CACHED */
#define PANEL_MIN_WORK_PER_THREAD (32 * 1024) /* multiply-adds; less than this per thread: one thread */

/* threads a packed GEMM of this size takes: one where the work is small, at most one per panel */
static inline int panel_gemm_users(int64_t m_len, int64_t n_len, int64_t k_len, int threads) {
    const int64_t num_panels = (n_len + PANEL_WIDTH - 1) / PANEL_WIDTH;
    if (threads < 1 || m_len * n_len * k_len < (int64_t)threads * PANEL_MIN_WORK_PER_THREAD) threads = 1;
    return threads > num_panels ? (int)num_panels : threads;
}

static inline int paged_decode_takes(int heads, int kv_heads, int dim, int block_size) {
    return kv_heads >= 1 && heads % kv_heads == 0 && heads <= MAX_HEADS && dim >= 1 && block_size >= 1;
}

static inline int rope_store_takes(int heads, int kv_heads, int dim) {
    return dim >= 2 && dim % 2 == 0 && heads >= 1 && kv_heads >= 1;
}

int paged_decode(const void *query, const void *key_cache, const void *value_cache, const int64_t *tables,
                 int64_t table_stride, const int64_t *lens, void *out, int64_t seqs, int heads, int kv_heads, int dim,
                 int block_size, float scale, float out_scale, int64_t window, int kinds, int threads);
int rope_store_f32(const float *qkv, const float *cos, const float *sin, const int64_t *slots, float *q_out,
                   void *key_cache, void *value_cache, int64_t tokens, int heads, int kv_heads, int dim, int kv_kind,
                   float k_inverse, float v_inverse, int threads);
int add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int64_t rows, int n, float eps,
                     int threads);
int silu_mul_f32(const float *gate_up, float *out, int64_t rows, int n, int threads);
int panel_gemm_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m_len, int64_t n_len,
                   int64_t k_len, int threads);
int argmax_rows_f32(const float *x, int64_t *out, uint8_t *bad, int64_t rows, int64_t n, int threads);
int panel_gemm_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t m_len,
                    int64_t n_len, int64_t k_len, int threads);
int bf16_amx(int mode);
int bf16_decode_torch_order(int mode); /* paged_decode.c */
int bf16_softmax_row(const float *scores, int64_t n, uint16_t *weights, float *sum, float *top); /* tests */
int kernels_fail_scratch(int n);
int rope_store_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                    uint16_t *q_out, void *key_cache, void *value_cache, int64_t tokens, int heads, int kv_heads,
                    int dim, int kv_kind, float k_inverse, float v_inverse, int threads);
int add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out, int64_t rows, int n,
                      float eps, int threads);
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int n, int threads);
int decode_stack_f32(float *x, float *out, float *scratch, const int64_t *weights, const int64_t *caches, int layers,
                     const float *final_norm, const float *cos, const float *sin, const int64_t *slots,
                     const int64_t *tables, int64_t table_stride, const int64_t *lens, int64_t tokens, int hidden,
                     int heads, int kv_heads, int dim, int inter, int block_size, float eps,
                     const float *layer_scales, int64_t window, int kv_kind, int threads);
int decode_stack_bf16(uint16_t *x, uint16_t *out, uint16_t *scratch, const int64_t *weights, const int64_t *caches,
                      int layers, const uint16_t *final_norm, const uint16_t *cos, const uint16_t *sin,
                      const int64_t *slots, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                      int64_t tokens, int hidden, int heads, int kv_heads, int dim, int inter, int block_size, float eps,
                      const float *layer_scales, int64_t window, int kv_kind, int threads);


/* Each kernel's part for thread t of a team of nt (team.h): what the exported kernel runs in a region of its own,
 * and decode_stack.c runs one after another in the single region of a decode step. */
int add_rms_norm_f32_part(float *x, const float *delta, const float *weight, float *out, int64_t rows, int n,
                          float eps, int t, int nt);
int silu_mul_f32_part(const float *gate_up, float *out, int64_t rows, int n, int t, int nt);
int rope_store_f32_part(const float *qkv, const float *cos, const float *sin, const int64_t *slots, float *q_out,
                        void *key_cache, void *value_cache, int64_t tokens, int heads, int kv_heads, int dim,
                        int kv_kind, float k_inverse, float v_inverse, int t, int nt);
int panel_gemm_f32_part(const float *x, const float *panels, const float *bias, float *y, int64_t m_len,
                        int64_t n_len, int64_t k_len, int t, int nt);
int paged_decode_part(const void *query, const void *key_cache, const void *value_cache, const int64_t *tables,
                      int64_t table_stride, const int64_t *lens, void *out, int64_t seqs, int heads, int kv_heads,
                      int dim, int block_size, float scale, float out_scale, int64_t window, int kinds,
                      int64_t *next, int t, int nt);
int add_rms_norm_bf16_part(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out, int64_t rows,
                           int n, float eps, int t, int nt);
int silu_mul_bf16_part(const uint16_t *gate_up, uint16_t *out, int64_t rows, int n, int t, int nt);
int rope_store_bf16_part(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                         uint16_t *q_out, void *key_cache, void *value_cache, int64_t tokens, int heads, int kv_heads,
                         int dim, int kv_kind, float k_inverse, float v_inverse, int t, int nt);
int panel_gemm_bf16_part(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t m_len,
                         int64_t n_len, int64_t k_len, int t, int nt);
#endif

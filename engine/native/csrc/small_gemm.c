/* y = x W^T (+ bias) with W pre-packed into panels: the engine's linear layers at a decode step's few rows, on the
 * CPU in float32. Built with engine/native/__init__.py, with the other kernels in this folder.
 *
 * Layouts (float32, contiguous):
 *   x       [M, K]
 *   panels  [P, K, 48]: panel p holds W's rows 48p .. 48p + 47 (outputs), transposed so that for each k the 48
 *           weights sit side by side (rows past N are zeros), made once by engine/native/__init__.py's pack_panels
 *   bias    [N] or null
 *   y       [M, N]
 *
 * How: for one panel and up to 8 rows of x, 24 accumulators of 16 lanes (8 rows x 48 outputs) stay in registers while a
 * block of K passes; each step reads the panel's 48 weights for that k (three vectors) and broadcasts each row's x[k]
 * into fused multiply-adds (simd.h's fma16: the ISO C build would not fuse them itself, and a multiply and an add took
 * both of the core's multiply-add units for one product; fused, the 3M config's 17 linears at 64 rows on one core went
 * from 94 to 138 GFLOP/s). With more than 8 rows, the next 8 pass over the same block of the panel, now in L1. Threads
 * split the panels, so every output is summed by one thread in one fixed order (k ascending): a row's result depends
 * neither on the thread count nor on the other rows of the batch.
 *
 * Why: a decode step of a model larger than the last-level cache streams every weight from memory once, and at 16
 * rows each weight feeds 16 multiply-adds: the step is as long as the stream or the arithmetic, whichever is
 * longer, only if the two overlap. oneDNN's packed GEMM did not overlap them on the 135M shape (the two times
 * added up: 20-23 GB/s, against 43 GB/s for a plain read). Here each tile of rows asks for its share of the panel
 * block after next (prefetch), at an even rate through the arithmetic, so the stream never waits for a tile to
 * finish. The prefetch distance and the block length were measured on the 135M shape's 121 linears at 16 rows
 * (DIST 1-4 blocks and K_BLOCK 32-128 all within noise of each other, 19-21 ms against oneDNN's 26; asking for the
 * block being summed instead, which is already on its way: 41 ms; an earlier version that asked 3 KiB ahead from
 * its first tile of rows only was no faster than oneDNN). Models whose weights fit in the cache take it too, for up
 * to 64 rows (the 3M config's linears: 1.49x oneDNN's speed at 16 rows, 0.93x at 64), because it lets a whole decode
 * step run in one native call (decode_stack.c); the prefetches then find their lines already in the cache.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"
#include "team.h"

#define WIDTH PANEL_WIDTH
#define ROWS 8     /* rows of x in a tile */
#define K_BLOCK 64 /* rows of a panel (12 KiB) kept in L1 while the tiles of x pass over them */
#define DIST 2     /* blocks between the one summed and the one asked for (24 KiB ahead) */

/* mt rows of x against k0..k1 of one panel; mt is a constant where it is inlined (see the switch below). Tile t of
 * nt (the tiles of rows that pass over this block) asks for lines t/nt .. (t+1)/nt of the block at `ahead`, spread
 * over its steps. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, const float *restrict panel,
                                                       int64_t k_len, int64_t k0, int64_t k1, float *restrict out,
                                                       int64_t stride, const float *restrict bias,
                                                       const float *ahead, const int64_t t, const int64_t nt,
                                                       const int mt) {
    v16 acc[ROWS][3];
    if (k0 == 0)
        for (int m = 0; m < mt; m++) acc[m][0] = acc[m][1] = acc[m][2] = (v16){0};
    else  /* the sums so far, from the previous block of K: the same additions in the same order */
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < 3; v++) acc[m][v] = *(const v16 *)(out + m * stride + 16 * v);
    /* this tile's lines of the block at `ahead`: at step j, lines (3 (k1 - k0) t + 3 j) / nt up to (... + 3) / nt,
     * the quotient kept with its remainder as j advances (two 64-bit divisions a step cost more than its 24
     * multiply-adds at 64 rows) */
    int64_t line = 3 * (k1 - k0) * t / nt, rest = 3 * (k1 - k0) * t % nt;
    for (int64_t k = k0; k < k1; k++) {
        int64_t end = line, over = rest + 3;
        while (over >= nt) over -= nt, end++;
        for (; line < end; line++) __builtin_prefetch(ahead + 16 * line, 0, 3);
        rest = over;
        const float *p = panel + k * WIDTH;
        v16 w0 = *(const v16 *)p, w1 = *(const v16 *)(p + 16), w2 = *(const v16 *)(p + 32);
#ifdef __AVX512F__ /* (a 64-byte vector fits one register only there; elsewhere GCC splits it, and the build failed) */
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2)); /* held in registers: GCC otherwise reloads them per product */
#endif
        for (int m = 0; m < mt; m++) {
            const v16 s = splat16(x[m * k_len + k]);
            acc[m][0] = fma16(s, w0, acc[m][0]);
            acc[m][1] = fma16(s, w1, acc[m][1]);
            acc[m][2] = fma16(s, w2, acc[m][2]);
        }
    }
    if (k1 < k_len) {  /* more of K to come: the partial sums wait in the output */
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < 3; v++) *(v16 *)(out + m * stride + 16 * v) = acc[m][v];
        return;
    }
    v16 b0 = {0}, b1 = {0}, b2 = {0};
    if (bias) b0 = *(const v16 *)bias, b1 = *(const v16 *)(bias + 16), b2 = *(const v16 *)(bias + 32);
    for (int m = 0; m < mt; m++) {
        *(v16 *)(out + m * stride) = acc[m][0] + b0;
        *(v16 *)(out + m * stride + 16) = acc[m][1] + b1;
        *(v16 *)(out + m * stride + 32) = acc[m][2] + b2;
    }
}

static void panel_rows(const float *restrict x, const float *restrict panel, const float *restrict bias,
                       float *restrict y, int64_t m_len, int64_t n_len, int64_t k_len, int64_t n0,
                       float *restrict staged) {
    const int cols = n_len - n0 < WIDTH ? (int)(n_len - n0) : WIDTH;
    float padded_bias[WIDTH] = {0};
    /* a whole panel of outputs goes straight to y; the last, partial one through a staging tile */
    float *out = cols == WIDTH ? y + n0 : staged;
    const int64_t stride = cols == WIDTH ? n_len : WIDTH;
    const float *b = bias ? bias + n0 : 0;
    if (bias && cols < WIDTH) {
        for (int c = 0; c < cols; c++) padded_bias[c] = bias[n0 + c];
        b = padded_bias;
    }
    const int64_t tiles = (m_len + ROWS - 1) / ROWS;
    for (int64_t k0 = 0; k0 < k_len; k0 += K_BLOCK) {
        const int64_t k1 = k_len - k0 < K_BLOCK ? k_len : k0 + K_BLOCK;
        /* the panels of one thread lie one after another: past this panel's end, ahead is the next one's start */
        const float *ahead = panel + (k0 + DIST * K_BLOCK) * WIDTH;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = t * ROWS;
            const int mt = m_len - m0 < ROWS ? (int)(m_len - m0) : ROWS;
            const float *xm = x + m0 * k_len;
            float *dst = cols == WIDTH ? out + m0 * stride : staged + m0 * WIDTH;
            switch (mt) {  /* each row count its own inlined copy, loops unrolled */
                case 8: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 8); break;
                case 7: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 7); break;
                case 6: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 6); break;
                case 5: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 5); break;
                case 4: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 4); break;
                case 3: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 3); break;
                case 2: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 2); break;
                default: tile(xm, panel, k_len, k0, k1, dst, stride, b, ahead, t, tiles, 1); break;
            }
        }
    }
    if (cols < WIDTH)
        for (int64_t m = 0; m < m_len; m++)
            for (int c = 0; c < cols; c++) y[m * n_len + n0 + c] = staged[m * WIDTH + c];
}

/* thread t's part: its block of panels (the last, when partial, summed in a scratch tile [m_len, WIDTH]) */
int panel_gemm_f32_part(const float *x, const float *panels, const float *bias, float *y, int64_t m_len,
                        int64_t n_len, int64_t k_len, int t, int nt) {
    if (m_len < 1 || n_len < 1 || k_len < 1) return 1;
    const int users = panel_gemm_users(m_len, n_len, k_len, nt);
    if (t >= users) return 0;
    const int64_t num_panels = (n_len + WIDTH - 1) / WIDTH;
    int64_t lo, hi;
    team_share(num_panels, t, users, &lo, &hi);
    float *scratch = n_len % WIDTH && hi == num_panels ? malloc(sizeof(float) * (size_t)m_len * WIDTH) : 0;
    if (n_len % WIDTH && hi == num_panels && !scratch) return 2;
    for (int64_t p = lo; p < hi; p++)
        panel_rows(x, panels + p * k_len * WIDTH, bias, y, m_len, n_len, k_len, p * WIDTH, scratch);
    free(scratch);
    return 0;
}

/* Returns 0 on success, 1 for shapes it does not take, 2 when scratch memory ran out. */
int panel_gemm_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m_len, int64_t n_len,
                   int64_t k_len, int threads) {
    if (m_len < 1 || n_len < 1 || k_len < 1) return 1;
    TEAM_RUN(panel_gemm_users(m_len, n_len, k_len, threads),
             panel_gemm_f32_part(x, panels, bias, y, m_len, n_len, k_len, t, nt));
}

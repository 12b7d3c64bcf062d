/* y = x W^T (+ bias) with W pre-packed into panels: the engine's linear layers on the CPU in float32. Built with
 * engine/native.py, with paged_decode.c.
 *
 * Layouts (float32, contiguous):
 *   x       [M, K]
 *   panels  [P, K, 48]: panel p holds W's rows 48p .. 48p + 47 (outputs), transposed so that for each k the 48
 *           weights sit side by side (rows past N are zeros), made once by engine/native.py's pack_panels
 *   bias    [N] or null
 *   y       [M, N]
 *
 * How: for one panel and up to 8 rows of x, 24 accumulators of 16 lanes (8 rows x 48 outputs) stay in registers
 * across K; each step reads the panel's 48 weights for that k (three vectors, one sequential stream through the
 * panel) and broadcasts each row's x[k]. The panel is then reused from L2 for the next 8 rows. Threads split the
 * panels, so every output is summed by one thread in one fixed order (k ascending): a row's result depends neither
 * on the thread count nor on the other rows of the batch.
 *
 * Why not oneDNN's packed GEMM (the engine's path before): at a decode step's few rows it spends about 10 us a call
 * before any arithmetic, and the 135M-shape model's 30 layers read 540 MB of weights a step, which this reads as
 * one stream per thread.
 */
#include <stdint.h>
#include <stdlib.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define WIDTH 48  /* outputs in a panel: three vectors */
#define ROWS 8    /* rows of x in a tile */
#define AHEAD 16  /* rows of a panel (3 KiB) asked for ahead of their use */
#define K_BLOCK 128 /* rows of a panel (24 KiB) kept in L1 while the tiles of x pass over them */
#define MIN_WORK_PER_THREAD (32 * 1024) /* multiply-adds; less than this per thread: one thread */

/* mt rows of x against one panel; mt is a constant where it is inlined (see the switch below). */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t rs, int64_t ks,
                                                       const float *restrict panel,
                                                       int64_t k_len, int64_t k0, int64_t k1, float *restrict out,
                                                       int64_t stride, const float *restrict bias, const int fetch,
                                                       const int mt) {
    v16 acc[ROWS][3];
    if (k0 == 0)
        for (int m = 0; m < mt; m++) acc[m][0] = acc[m][1] = acc[m][2] = (v16){0};
    else  /* the sums so far, from the previous block of K: the same additions in the same order */
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < 3; v++) acc[m][v] = *(const v16 *)(out + m * stride + 16 * v);
    for (int64_t k = k0; k < k1; k++) {
        const float *p = panel + k * WIDTH;
        if (fetch) {  /* the first tile of rows asks for the panel ahead of its use: one thread's single stream
                       * did not keep the multiply-adds fed from memory (the 135M shape's head at 16 rows) */
            __builtin_prefetch(p + AHEAD * WIDTH);
            __builtin_prefetch(p + AHEAD * WIDTH + 16);
            __builtin_prefetch(p + AHEAD * WIDTH + 32);
        }
        v16 w0 = *(const v16 *)p, w1 = *(const v16 *)(p + 16), w2 = *(const v16 *)(p + 32);
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2)); /* held in registers: GCC otherwise reloads them per product */
        for (int m = 0; m < mt; m++) {
            const float s = x[m * rs + k * ks];
            acc[m][0] += s * w0;
            acc[m][1] += s * w1;
            acc[m][2] += s * w2;
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
                       float *restrict scratch, const int packed) {
    const int cols = n_len - n0 < WIDTH ? (int)(n_len - n0) : WIDTH;
    float *staged = scratch, padded_bias[WIDTH] = {0};
    /* a whole panel of outputs goes straight to y; the last, partial one through a staging tile */
    float *out = cols == WIDTH ? y + n0 : staged;
    const int64_t stride = cols == WIDTH ? n_len : WIDTH;
    const float *b = bias ? bias + n0 : 0;
    if (bias && cols < WIDTH) {
        for (int c = 0; c < cols; c++) padded_bias[c] = bias[n0 + c];
        b = padded_bias;
    }
    /* with more rows than one tile, K is taken in blocks whose stretch of the panel stays in L1 while every tile
     * of rows passes over it (a whole panel is 2-3x L1 at K = 576-1536; re-read from L2 for each tile of rows, a
     * prefill's 384 rows ran 10-30% slower than oneDNN) */
    const int64_t block = m_len > ROWS ? K_BLOCK : k_len;
    for (int64_t k0 = 0; k0 < k_len; k0 += block) {
        const int64_t k1 = k_len - k0 < block ? k_len : k0 + block;
        for (int64_t m0 = 0; m0 < m_len; m0 += ROWS) {
            const int mt = m_len - m0 < ROWS ? (int)(m_len - m0) : ROWS;
            /* rows of x as given (row after row), or packed: tile t's rows interleaved, [t][k][ROWS] */
            const float *xm = x + m0 * k_len;  /* both layouts: tile m0 / ROWS starts there */
            const int64_t rs = packed ? 1 : k_len, ks = packed ? ROWS : 1;
            float *dst = cols == WIDTH ? out + m0 * stride : staged + m0 * WIDTH;
            switch (mt) {  /* each row count its own inlined copy, loops unrolled */
                case 8: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 8); break;
                case 7: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 7); break;
                case 6: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 6); break;
                case 5: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 5); break;
                case 4: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 4); break;
                case 3: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 3); break;
                case 2: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 2); break;
                default: tile(xm, rs, ks, panel, k_len, k0, k1, dst, stride, b, m0 == 0, 1); break;
            }
        }
    }
    if (cols < WIDTH)
        for (int64_t m = 0; m < m_len; m++)
            for (int c = 0; c < cols; c++) y[m * n_len + n0 + c] = staged[m * WIDTH + c];
}

/* Returns 0 on success, 1 for shapes it does not take, 2 when scratch memory ran out. */
int panel_gemm_f32(const float *x, const float *panels, const float *bias, float *y, int64_t m_len, int64_t n_len,
                   int64_t k_len, int threads) {
    if (m_len < 1 || n_len < 1 || k_len < 1) return 1;
    const int64_t num_panels = (n_len + WIDTH - 1) / WIDTH;
    if (threads < 1 || m_len * n_len * k_len < (int64_t)threads * MIN_WORK_PER_THREAD) threads = 1;
    if (threads > num_panels) threads = (int)num_panels;
    /* the last panel, when partial, is summed in a scratch tile [m_len, WIDTH]; with more rows than a tile, x is
     * packed first, each tile's rows interleaved ([tiles][K][ROWS], zero rows past the end), so that a tile's
     * step reads one cache line of x instead of one from each of eight rows (a prefill's 384 rows: 10-30% slower
     * than oneDNN unpacked) */
    const int pack = m_len > ROWS;
    const int64_t tiles_of_rows = (m_len + ROWS - 1) / ROWS;
    float *scratch = n_len % WIDTH ? malloc(sizeof(float) * (size_t)m_len * WIDTH) : 0;
    float *xp = pack ? malloc(sizeof(float) * (size_t)(tiles_of_rows * ROWS * k_len)) : 0;
    if ((n_len % WIDTH && !scratch) || (pack && !xp)) {
        free(scratch);
        free(xp);
        return 2;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (pack) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles_of_rows; t++)
                for (int r = 0; r < ROWS; r++) {
                    const int64_t row = t * ROWS + r;
                    float *dst = xp + t * ROWS * k_len + r;
                    if (row < m_len)
                        for (int64_t k = 0; k < k_len; k++) dst[k * ROWS] = x[row * k_len + k];
                    else
                        for (int64_t k = 0; k < k_len; k++) dst[k * ROWS] = 0.0f;
                }
        }  /* the implied barrier: every tile packed before any is read */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++)
            panel_rows(pack ? xp : x, panels + p * k_len * WIDTH, bias, y, m_len, n_len, k_len, p * WIDTH, scratch,
                       pack);
    }
    free(scratch);
    free(xp);
    return 0;
}

/* y = x W^T (+ bias) in bfloat16 with W pre-packed into panels of 48 outputs: the bfloat16 path's linear layers at a
 * decode step's few rows (small_gemm.c's walk for float32). Built with engine/native/__init__.py, with the other kernels here.
 *
 * Layouts (bfloat16 stored as uint16_t, contiguous):
 *   x       [M, K]
 *   panels  [P, K2, 48, 2] with K2 = ceil(K / 2): panel p holds W's rows 48p .. 48p + 47 (outputs); for each pair of
 *           inputs (2j, 2j + 1) the 48 outputs' two weights sit side by side, w[o][2j] then w[o][2j + 1] (zeros past
 *           N and past K), made once by engine/native/__init__.py's pack_panels_bf16: the layout vdpbf16ps reads, 16 outputs
 *           by 2 inputs in one register
 *   bias    [N] or null
 *   y       [M, N]
 *
 * How: as small_gemm.c, for one panel and up to 8 rows of x, 24 float32 accumulators of 16 lanes stay in registers
 * while a block of K passes; each step reads the panel's 48 x 2 weights of one pair of inputs (three vectors) and
 * broadcasts each row's (x[2j], x[2j + 1]); vdpbf16ps adds both products to the float32 sums. Every sum runs over
 * K in one fixed order, whatever the thread count or the other rows of the batch; the result, with the bias added
 * in float32, is rounded to bfloat16 once, as oneDNN's bfloat16 GEMM (what F.linear reaches on the CPU) does.
 * Threads split the panels.
 *
 * Why: a decode step of a model larger than the last-level cache streams every weight from memory once for a few
 * multiply-adds each; oneDNN's packed bfloat16 GEMM, like its float32 one (small_gemm.c), does not overlap that
 * stream with its arithmetic at a few rows. Here each tile of rows asks for its share of the panel block after
 * next (prefetch) through its arithmetic, the same schedule as small_gemm.c (a block of 64 pairs is 12 KiB, as
 * there). Figures: docs/engine.md, "bfloat16".
 *
 * Without AVX-512 BF16 the same walk runs with the pair widened to float32 and the two products added in
 * vdpbf16ps's order (the odd input's first), in two fused multiply-adds: the products of two bfloat16 values are
 * exact in float32, so each step rounds as vdpbf16ps does (denormal inputs aside, which vdpbf16ps flushes).
 *
 * With AMX (Intel's tile unit: lscpu's amx_bf16; the build's -march=native defines __AMX_BF16__, and Linux must grant
 * the tile state at run time) the sums are made in tiles instead: the same packed panels, one tile instruction per 16
 * rows x 16 pairs x 16 outputs, zeros past K in the last step. The arithmetic stays at the speed of the weights' stream
 * where vdpbf16ps, at 16 rows on two cores, could not keep up with it (docs/engine.md, "bfloat16": the 135M shape's
 * linears 1.5x faster). The tile unit adds its products in an order of its own, not vdpbf16ps's; it is the order
 * oneDNN's AMX GEMM gets too, so at up to 32 rows these are F.linear's bits (tested). bf16_amx(0) keeps to the
 * vdpbf16ps walk.
 */
#define _GNU_SOURCE /* syscall(), for the AMX permission */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"
#include "simd.h"
#include "team.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define WIDTH PANEL_WIDTH
#define ROWS 8     /* rows of x in a tile */
#define K_BLOCK 64 /* pairs of a panel (12 KiB) kept in L1 while the tiles of x pass over them */
#define DIST 2     /* blocks between the one summed and the one asked for */
#define MAX_ROWS PANEL_ROWS_BF16

typedef uint32_t v16w __attribute__((vector_size(64), aligned(2))); /* a row of 16 pairs, anywhere */

/* the weights of one pair of inputs for 16 outputs, ready for pair_madd */
#if HAVE_DPBF16
typedef __m512bh wpair;
static inline wpair load_pair(const uint16_t *w) { return (wpair)_mm512_loadu_si512(w); }
static inline v16 pair_madd(v16 acc, wpair w, uint32_t pair) {
    return (v16)_mm512_dpbf16_ps((__m512)acc, w, (__m512bh)_mm512_set1_epi32((int)pair));
}
#else
typedef struct { v16 even, odd; } wpair;
static inline wpair load_pair(const uint16_t *w) {
    const v16w raw = *(const v16w *)w;
    return (wpair){(v16)(raw << 16), (v16)(raw & 0xffff0000u)};
}
static inline v16 pair_madd(v16 acc, wpair w, uint32_t pair) {
    acc += w.odd * widen((uint16_t)(pair >> 16)); /* exact products: each addition rounds once, as vdpbf16ps's */
    return acc + w.even * widen((uint16_t)pair);
}
#endif

/* mt rows of x (k2 pairs each, row stride x_stride values) against pairs j0..j1 of one panel, into the float32
 * sums acc_out [mt, WIDTH] (started at zero when j0 == 0). Tile t of nt asks for its share of the block at
 * `ahead`, as small_gemm.c's tile. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *restrict x, int64_t x_stride,
                                                            const uint16_t *restrict panel, int64_t j0, int64_t j1,
                                                            float *restrict sums, const uint16_t *ahead,
                                                            const int64_t t, const int64_t nt, const int mt) {
    v16 acc[ROWS][3];
    if (j0 == 0)
        for (int m = 0; m < mt; m++) acc[m][0] = acc[m][1] = acc[m][2] = (v16){0};
    else
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < 3; v++) acc[m][v] = *(const v16 *)(sums + m * WIDTH + 16 * v);
    const int64_t lines = 3 * (j1 - j0); /* 64-byte lines in this block of the panel */
    for (int64_t j = j0; j < j1; j++) {
        const int64_t i = j - j0;
        for (int64_t l = (lines * t + 3 * i) / nt; l < (lines * t + 3 * i + 3) / nt; l++)
            __builtin_prefetch(ahead + 32 * l, 0, 3);
        const uint16_t *p = panel + j * 2 * WIDTH;
        const wpair w0 = load_pair(p), w1 = load_pair(p + 32), w2 = load_pair(p + 64);
        for (int m = 0; m < mt; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * x_stride + 2 * j, sizeof pair);
            acc[m][0] = pair_madd(acc[m][0], w0, pair);
            acc[m][1] = pair_madd(acc[m][1], w1, pair);
            acc[m][2] = pair_madd(acc[m][2], w2, pair);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < 3; v++) *(v16 *)(sums + m * WIDTH + 16 * v) = acc[m][v];
}

#if HAVE_AMX
/* The AMX walk (the machine's tile unit: tdpbf16ps multiplies a tile of up to 16 rows x 16 pairs of inputs by one
 * of 16 pairs x 16 outputs into 16 x 16 float32 sums, 512 multiply-adds of one row in one instruction where
 * vdpbf16ps does 32). Tiles: 0-2 the sums of 16 rows x the panel's 48 outputs, 3 the rows of x (16 pairs), 4-6 the
 * panel's 16 pairs x 48 outputs: the packed panel is already the tile's layout (one pair of 16 outputs is 64
 * bytes), read with a row stride of 48 outputs. */
#define AMX_PAIRS 16     /* pairs of inputs per tile step */
#define AMX_ROWS 16      /* rows of x per tile */
#ifndef AMX_AHEAD
#define AMX_AHEAD 12288  /* bytes of the panel asked for ahead of the step summed (four steps) */
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_granted = -1; /* -1: not asked yet; 0: the kernel refused the tile state; 1: granted */
static int amx_wanted = 1;   /* bf16_amx(0) turns the AMX walk off (benchmarks, tests of both walks) */

/* Linux gives a process the 8 KiB tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, since 5.16); without
 * it the first tile instruction kills the process. Asked once; a refusal leaves the vdpbf16ps walk. */
static int amx_usable(void) {
    int granted = __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);
    if (granted < 0) {
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&amx_granted, granted, __ATOMIC_RELEASE);
    }
    return granted && __atomic_load_n(&amx_wanted, __ATOMIC_RELAXED);
}

static void amx_configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = (uint8_t)rows; c.colsb[t] = 64; } /* sums and x: rows x 64 bytes */
    for (int t = 4; t < 7; t++) { c.rows[t] = AMX_PAIRS; c.colsb[t] = 64; }     /* weights: 16 pairs x 64 bytes */
    _tile_loadconfig(&c);
}

/* one step: 16 pairs of the tile of x at column 2j against the panel's 16 pairs at p (rows 2 * WIDTH apart) */
static inline __attribute__((always_inline)) void amx_step(const uint16_t *x, int64_t x_stride, int64_t j,
                                                           const uint16_t *p) {
    _tile_loadd(3, x + 2 * j, x_stride * 2);
    _tile_loadd(4, p, 2 * WIDTH * 2);
    _tile_loadd(5, p + 32, 2 * WIDTH * 2);
    _tile_loadd(6, p + 64, 2 * WIDTH * 2);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
}

/* one tile of rows (as configured) of x against all k2 pairs of one panel, into sums [rows, WIDTH]; x's rows are
 * read to the next whole step (zeros past K: the caller pads them), and a last partial step of the panel is
 * copied with zero pairs after it, so that the tile adds nothing but zero products past K, as a tile configured
 * to fewer pairs would (oneDNN's tail) */
static void amx_tile(const uint16_t *restrict x, int64_t x_stride, const uint16_t *restrict panel, int64_t k2,
                     float *restrict sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    const int64_t whole = k2 - k2 % AMX_PAIRS;
    for (int64_t j = 0; j < whole; j += AMX_PAIRS) {
        const uint16_t *p = panel + j * 2 * WIDTH;
        const char *ahead = (const char *)p + AMX_AHEAD; /* past the panel: the next one, the thread's next */
        for (int l = 0; l < AMX_PAIRS * 2 * WIDTH * 2 / 64; l++) __builtin_prefetch(ahead + 64 * l, 0, 3);
        amx_step(x, x_stride, j, p);
    }
    if (whole < k2) {
        uint16_t last[AMX_PAIRS * 2 * WIDTH] __attribute__((aligned(64)));
        const size_t used = (size_t)(k2 - whole) * 2 * WIDTH;
        memcpy(last, panel + whole * 2 * WIDTH, used * sizeof *last);
        memset(last + used, 0, sizeof last - used * sizeof *last);
        amx_step(x, x_stride, whole, last);
    }
    _tile_stored(0, sums, WIDTH * 4);
    _tile_stored(1, sums + 16, WIDTH * 4);
    _tile_stored(2, sums + 32, WIDTH * 4);
}
#endif

/* x's rows against one panel: float32 sums by the AMX walk (amx: x's rows past the last whole tile of 16 are read
 * from tail, a copy padded to 16 rows) or the vdpbf16ps one, then the bias and one rounding to bfloat16 */
static void panel_rows_bf16(const uint16_t *restrict x, int64_t x_stride, const uint16_t *restrict panel,
                            const uint16_t *restrict bias, uint16_t *restrict y, int64_t m_len, int64_t n_len,
                            int64_t k2, int64_t n0, int amx, const uint16_t *tail) {
    float sums[MAX_ROWS * WIDTH] __attribute__((aligned(64)));
#if HAVE_AMX
    if (amx) {
        for (int64_t m0 = 0; m0 < m_len; m0 += AMX_ROWS) {
            const int whole = m_len - m0 >= AMX_ROWS || m0 == 0; /* a first tile of fewer rows is configured so */
            amx_tile(whole ? x + m0 * x_stride : tail, x_stride, panel, k2, sums + m0 * WIDTH);
        }
    }
#else
    (void)tail;
#endif
    const int64_t tiles = amx ? 0 : (m_len + ROWS - 1) / ROWS;
    for (int64_t j0 = 0; tiles && j0 < k2; j0 += K_BLOCK) {
        const int64_t j1 = k2 - j0 < K_BLOCK ? k2 : j0 + K_BLOCK;
        /* the panels of one thread lie one after another: past this panel's end, ahead is the next one's start */
        const uint16_t *ahead = panel + (j0 + DIST * K_BLOCK) * 2 * WIDTH;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = t * ROWS;
            const int mt = m_len - m0 < ROWS ? (int)(m_len - m0) : ROWS;
            const uint16_t *xm = x + m0 * x_stride;
            float *s = sums + m0 * WIDTH;
            switch (mt) {  /* each row count its own inlined copy, loops unrolled */
                case 8: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 8); break;
                case 7: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 7); break;
                case 6: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 6); break;
                case 5: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 5); break;
                case 4: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 4); break;
                case 3: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 3); break;
                case 2: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 2); break;
                default: tile_bf16(xm, x_stride, panel, j0, j1, s, ahead, t, tiles, 1); break;
            }
        }
    }
    const int cols = n_len - n0 < WIDTH ? (int)(n_len - n0) : WIDTH;
    float b[WIDTH] __attribute__((aligned(64))) = {0};
    if (bias)
        for (int c = 0; c < cols; c++) b[c] = widen(bias[n0 + c]);
    for (int64_t m = 0; m < m_len; m++) {
        const float *s = sums + m * WIDTH;
        uint16_t *out = y + m * n_len + n0;
        if (cols == WIDTH) {
            for (int v = 0; v < 3; v++) narrow16(out + 16 * v, *(const v16 *)(s + 16 * v) + *(const v16 *)(b + 16 * v));
        } else {
            for (int c = 0; c < cols; c++) out[c] = narrow(s[c] + b[c]);
        }
    }
}

/* thread t's part: its block of panels. Copies of x that the walk needs (zero columns past an odd K or, for the AMX
 * walk, to a whole step; zero rows past the last whole tile) are the thread's own: x is a decode batch's few rows. */
int panel_gemm_bf16_part(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t m_len,
                         int64_t n_len, int64_t k_len, int t, int nt) {
    if (m_len < 1 || m_len > MAX_ROWS || n_len < 1 || k_len < 1) return 1;
    const int users = panel_gemm_users(m_len, n_len, k_len, nt);
    if (t >= users) return 0;
    const int64_t num_panels = (n_len + WIDTH - 1) / WIDTH, k2 = (k_len + 1) / 2;
    int64_t lo, hi;
    team_share(num_panels, t, users, &lo, &hi);
    int amx = 0, tile_rows = 0;
#if HAVE_AMX
    amx = amx_usable();
    const int64_t row_pairs = amx ? (k2 + AMX_PAIRS - 1) / AMX_PAIRS * AMX_PAIRS : k2;
#else
    const int64_t row_pairs = k2;
#endif
    /* an odd K (or, for the AMX walk, one of no whole number of 16-pair steps): the rows copied with zeros after
     * each, so that every pair (step) read is whole */
    uint16_t *padded = 0, *tail = 0;
    int64_t x_stride = k_len;
    if (2 * row_pairs != k_len) {
        padded = calloc((size_t)(m_len * 2 * row_pairs), sizeof *padded);
        if (!padded) return 2;
        for (int64_t m = 0; m < m_len; m++)
            memcpy(padded + m * 2 * row_pairs, x + m * k_len, sizeof *x * (size_t)k_len);
        x = padded;
        x_stride = 2 * row_pairs;
    }
#if HAVE_AMX
    if (amx) {
        tile_rows = m_len < AMX_ROWS ? (int)m_len : AMX_ROWS;
        const int64_t left = m_len % AMX_ROWS;
        if (m_len > AMX_ROWS && left) { /* the last rows, padded to a whole tile with zero rows */
            tail = calloc((size_t)(AMX_ROWS * x_stride), sizeof *tail);
            if (!tail) { free(padded); return 2; }
            memcpy(tail, x + (m_len - left) * x_stride, sizeof *x * (size_t)(left * x_stride));
        }
        amx_configure(tile_rows);
    }
#endif
    for (int64_t p = lo; p < hi; p++)
        panel_rows_bf16(x, x_stride, panels + p * k2 * 2 * WIDTH, bias, y, m_len, n_len, k2, p * WIDTH, amx, tail);
#if HAVE_AMX
    if (amx) _tile_release(); /* the 8 KiB tile state need not follow the thread through context switches */
#endif
    (void)tile_rows;
    free(padded);
    free(tail);
    return 0;
}

/* Returns 0 on success, 1 for shapes it does not take, 2 when scratch memory ran out. */
int panel_gemm_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int64_t m_len,
                    int64_t n_len, int64_t k_len, int threads) {
    if (m_len < 1 || m_len > MAX_ROWS || n_len < 1 || k_len < 1) return 1;
    TEAM_RUN(panel_gemm_users(m_len, n_len, k_len, threads),
             panel_gemm_bf16_part(x, panels, bias, y, m_len, n_len, k_len, t, nt));
}

/* mode 0: the vdpbf16ps walk only; 1: the AMX walk where it serves (the default); any other: unchanged. Returns
 * whether the AMX walk serves now (0 on machines or builds without AMX, or where Linux refused the tile state). */
int bf16_amx(int mode) {
#if HAVE_AMX
    if (mode == 0 || mode == 1) __atomic_store_n(&amx_wanted, mode, __ATOMIC_RELAXED);
    return amx_usable();
#else
    (void)mode;
    return 0;
#endif
}

/* Sharing a kernel's work among the threads of one OpenMP region: each kernel's part for thread t of nt
 * (`*_part`), run either in a region of its own (the exported kernel, called from Python) or, one after another
 * with a barrier between them, in the single region of decode_stack.c's whole decode step.
 *
 * Why: the app runs torch's OpenMP threads with OMP_WAIT_POLICY=PASSIVE (main.py: spinning workers starved the
 * GUI thread), and there every parallel region puts the second thread to sleep at its end and wakes it at the
 * next one. A decode step of the 135M shape opened about 270 regions; its 121 linears took 21.2 ms under PASSIVE
 * and 9.4 ms without the waking. One region per step wakes the team once; between kernels it waits here, spinning
 * briefly and then yielding the core (docs/engine.md, "One region per decode step"). */
#ifndef PAGED_KV_TEAM_H
#define PAGED_KV_TEAM_H

#include <omp.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TEAM_PAUSE() _mm_pause()
#else
#define TEAM_PAUSE() ((void)0)
#endif

#define TEAM_SPINS 20000 /* pauses before a waiting thread yields its core on each further check (~0.1-1 ms) */

/* thread t's share [*lo, *hi) of n items among nt: contiguous blocks, the first n % nt one item longer (what
 * schedule(static) gives) */
static inline void team_share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    const int64_t q = n / nt, r = n % nt;
    *lo = t * q + (t < r ? t : r);
    *hi = *lo + q + (t < r ? 1 : 0);
}

/* A barrier that also agrees on failure: every thread of the team arrives with its status (0, or a kernel's
 * nonzero status) and leaves with the first nonzero one any thread brought to this crossing, so that all of them
 * stop together. `result` is written by the last to arrive and read by each after it leaves; the next crossing's
 * last arrival, which overwrites it, needs every thread to have arrived there first, so no one reads it late. */
typedef struct {
    int arrived, generation, failed, result;
    char own_line[64 - 4 * sizeof(int)]; /* a cache line of its own: the waiting thread polls it while the working
                                           * one writes the stack around it (false sharing slowed the step 5%) */
} __attribute__((aligned(64))) team_barrier;

static inline int team_wait(team_barrier *b, int nt, int status) {
    if (status) {
        int none = 0;
        __atomic_compare_exchange_n(&b->failed, &none, status, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    if (nt <= 1) return __atomic_exchange_n(&b->failed, 0, __ATOMIC_RELAXED);
    const int generation = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == nt) {
        b->result = __atomic_exchange_n(&b->failed, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->generation, generation + 1, __ATOMIC_RELEASE);
    } else {
        for (long spins = 0; __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) == generation; spins++) {
            if (spins < TEAM_SPINS) TEAM_PAUSE();
            else sched_yield();
        }
    }
    return b->result;
}

/* scratch memory for a kernel's thread (decode_stack.c): malloc, or null where kernels_fail_scratch asked the n-th
 * allocation from then on to fail (tests: a failure on one thread of the one-call step) */
void *team_scratch(size_t bytes);

/* The exported form of a kernel: PART (an expression of t and nt, the thread and the team's size) on `users`
 * threads of a region of its own; returns the first nonzero status a thread's part gave, else 0. */
#define TEAM_RUN(users, PART)                                                                                          \
    do {                                                                                                             \
        int team_status_ = 0;                                                                                        \
        const int team_users_ = (users) < 1 ? 1 : (users);                                                           \
        _Pragma("omp parallel num_threads(team_users_) if (team_users_ > 1)")                                        \
        {                                                                                                            \
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();                                          \
            const int team_part_ = (PART);                                                                           \
            if (team_part_) __atomic_store_n(&team_status_, team_part_, __ATOMIC_RELAXED);                          \
        }                                                                                                            \
        return team_status_;                                                                                         \
    } while (0)

#endif

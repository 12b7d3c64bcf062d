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

#if defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* glibc's, declared by unistd.h only outside ISO C (the build is -std=c11) */
#define TEAM_FUTEX 1
#else
#define TEAM_FUTEX 0
#endif

#define TEAM_SPINS 20000    /* most pauses a waiting thread spins before it sleeps (~0.1-1 ms) */
#define TEAM_MIN_SPINS 64   /* fewest: a machine busy with other work still gets a short spin */

/* thread t's share [*lo, *hi) of n items among nt: contiguous blocks, the first n % nt one item longer (what
 * schedule(static) gives) */
static inline void team_share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    const int64_t q = n / nt, r = n % nt;
    *lo = t * q + (t < r ? t : r);
    *hi = *lo + q + (t < r ? 1 : 0);
}

/* One kernel of a step shared among a team by chunks (decode_stack.c): the kernel's work is cut into `chunks`
 * parts (each kernel's `*_part` for part c of `chunks`), which the threads take one at a time from `next`; `done`
 * counts the parts finished, and the next kernel starts when all are. A thread that is off its core (a machine
 * whose cores other processes also want) holds no part unless it was preempted inside one, so the others carry on
 * without it, and when it is back it joins whichever kernel is current; a barrier that every thread must reach made
 * each of a step's 270 crossings wait a time slice for the thread that was away (the 135M shape's step: about 60 ms
 * on one thread, 900 ms on two; docs/engine.md, "One region per decode step"). */
typedef struct {
    int next, done;
} team_step;

/* The team's shared state for one call: the first failure any part reported, the threads asleep on a `done`. Waiting
 * is a spin first (between two kernels of a step the parts left are usually microseconds from done), then sleep on
 * the futex of the `done` awaited until a thread that finishes a part wakes the sleepers. The spin adapts: a wait that
 * had to sleep halves the next spin, one that ended spinning doubles it (up to TEAM_SPINS). */
typedef struct {
    int failed, sleepers, spins;
    char own_line[64 - 3 * sizeof(int)]; /* a cache line of its own, away from the stack the threads write */
} __attribute__((aligned(64))) team_state;

static inline void team_sleep(int *word, int value) {
#if TEAM_FUTEX
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)word, (void)value;
    sched_yield();
#endif
}

static inline void team_wake(int *word) {
#if TEAM_FUTEX
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* part c of a step is finished, with `status` (0, or a kernel's nonzero status: the first is kept for everyone) */
static inline void team_part_done(team_state *team, team_step *step, int status) {
    if (status) {
        int none = 0;
        __atomic_compare_exchange_n(&team->failed, &none, status, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
    }
    __atomic_add_fetch(&step->done, 1, __ATOMIC_SEQ_CST); /* releases what the part wrote */
    if (__atomic_load_n(&team->sleepers, __ATOMIC_SEQ_CST)) team_wake(&step->done);
}

/* Wait until all `chunks` parts of a step are done (or a part failed); returns the failure, else 0. */
static inline int team_step_wait(team_state *team, team_step *step, int chunks) {
    int limit = __atomic_load_n(&team->spins, __ATOMIC_RELAXED);
    if (limit < TEAM_MIN_SPINS || limit > TEAM_SPINS) limit = TEAM_SPINS;
    int slept = 0, spins = 0;
    for (int done; (done = __atomic_load_n(&step->done, __ATOMIC_ACQUIRE)) < chunks &&
                   !__atomic_load_n(&team->failed, __ATOMIC_ACQUIRE);) {
        if (spins++ < limit) {
            TEAM_PAUSE();
            continue;
        }
        /* counted before the futex compares `done` again: a finishing part, which moves `done` first and reads the
         * count after, either sees this sleeper or moved `done` before the compare (the wait then returns at once) */
        __atomic_add_fetch(&team->sleepers, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&step->done, __ATOMIC_SEQ_CST) == done && !__atomic_load_n(&team->failed, __ATOMIC_SEQ_CST))
            team_sleep(&step->done, done);
        __atomic_sub_fetch(&team->sleepers, 1, __ATOMIC_SEQ_CST);
        slept = 1;
    }
    if (spins) {
        const int next = slept ? limit / 2 : limit * 2;
        __atomic_store_n(&team->spins, next < TEAM_MIN_SPINS ? TEAM_MIN_SPINS : next > TEAM_SPINS ? TEAM_SPINS : next,
                         __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&team->failed, __ATOMIC_ACQUIRE);
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

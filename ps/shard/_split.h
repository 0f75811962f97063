/* A large key's SGD over several cores, for ps/shard/_compiled.c: the key is cut into chunks
 * that the calling thread and the pool's threads take one at a time, so that a helper woken
 * late takes only what is left.
 *
 * Measured on this 2-core machine (a key's SGD after its gradient was written, a sleep
 * between updates, medians of 100 through _compiled.sgd, six runs each): 2 MiB took 260-324 us
 * on one thread, 266-323 split in two; 3 MiB 457-600 against 278-457; 4 MiB 586-894 against
 * 366-462. Waking a sleeping thread here costs about 90 us (a C loop's 1 MiB key with the
 * helper spinning: 104-108 us, 173-181 on one), so only a key of at least SPLIT_MIN_BYTES is
 * split; Python's threads (ps.shard.slices) cost 40 to 80 us more a hand-off, and split only
 * from 8 MiB.
 *
 * The helpers sleep on a futex between keys (they hold no core while the shard waits on its
 * sockets); the caller, once no chunk is left to take, spins a short while for the chunks
 * still being updated (at most one a helper), then sleeps. Chunks are claimed from one 64-bit
 * word, the key's number above the chunks left below, so a helper that wakes after its key is
 * done finds nothing to take and cannot touch the next key's memory: a claim succeeds only
 * while the key it names is being updated, and the key's description is read only after it.
 * Each element is updated once by the same arithmetic, so the bits are the whole key's. One
 * key at a time a process: a caller that finds the pool busy (another shard's thread in the
 * same process) updates on its own thread. A forked child starts with no helpers (they were
 * the parent's) and makes its own. */
#ifndef PSAR_SPLIT_H
#define PSAR_SPLIT_H
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>

#include "_sgd.h"

/* A thread's floating-point controls (MXCSR's flush-to-zero, denormals-are-zero, rounding and
 * exception masks, not its flags): a helper takes the caller's for each chunk, or its bits
 * would differ from the caller's where those were changed (torch.set_flush_denormal).
 * FP_VALID: the bits a thread's controls may have (others fault on x86). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FP_CONTROLS() (_mm_getcsr() & ~0x3fu)
#define FP_SET(c) _mm_setcsr(((c) & 0xffc0u) | (_mm_getcsr() & 0x3fu))
#define FP_VALID(c) (((c) & ~0xffc0u) == 0)
#else
#include <fenv.h>
#define FP_CONTROLS() ((unsigned)fegetround())
#define FP_SET(c) fesetround((int)(c))
#define FP_VALID(c) ((c) == FE_TONEAREST || (c) == FE_UPWARD || (c) == FE_DOWNWARD || (c) == FE_TOWARDZERO)
#endif

#define SPLIT_MIN_BYTES (3 << 20)
#define CHUNK_BYTES (256 << 10)
#define SPLIT_MAX_THREADS 64
#define SPIN_NS 50000 /* the caller's wait for the helpers' last chunks before it sleeps */

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static struct {
    pthread_mutex_t lock;       /* one key at a time */
    atomic_int threads;         /* asked for: the caller and threads - 1 helpers */
    int started;                /* helpers running */
    atomic_int failed;          /* a helper could not be started: no more tries until set_threads */
    atomic_uint gen;            /* bumped to wake the helpers */
    _Atomic uint64_t claim;     /* key number << 32 | chunks left to claim */
    atomic_uint left;           /* chunks not yet updated */
    uint32_t number;            /* the current key's number */
    atomic_ullong keys, helped; /* keys split, and chunks the helpers updated */
    int f64;                    /* the current key: read only after a successful claim */
    char *p, *g, *buf;
    Py_ssize_t n, chunk, size;
    Step step;
    unsigned controls;          /* FP_CONTROLS() of the caller */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void futex_wait(atomic_uint *a, unsigned v) { syscall(SYS_futex, a, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0); }
static void futex_wake(atomic_uint *a, int n) { syscall(SYS_futex, a, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0); }

/* Take and update chunks of the current key until none is left to take. */
static Py_ssize_t split_work(void) {
    Py_ssize_t taken = 0;
    uint64_t v = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        uint32_t chunks = (uint32_t)v;
        if (chunks == 0) return taken;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &v, v - 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* chunk chunks - 1 of the key is ours, and the key stays until we say it is done */
        if (FP_CONTROLS() != pool.controls) FP_SET(pool.controls);
        Py_ssize_t first = (Py_ssize_t)(chunks - 1) * pool.chunk;
        Py_ssize_t count = pool.n - first < pool.chunk ? pool.n - first : pool.chunk;
        Py_ssize_t at = first * pool.size;
        sgd(pool.f64, pool.p + at, pool.g + at, pool.buf ? pool.buf + at : NULL, count, &pool.step);
        taken++;
        if (atomic_fetch_sub_explicit(&pool.left, 1, memory_order_acq_rel) == 1) futex_wake(&pool.left, 1);
        v = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *split_helper(void *unused) {
    (void)unused;
    unsigned seen = atomic_load(&pool.gen);
    for (;;) {
        unsigned now;
        while ((now = atomic_load(&pool.gen)) == seen) futex_wait(&pool.gen, seen);
        seen = now;
        Py_ssize_t taken = split_work();
        if (taken) atomic_fetch_add_explicit(&pool.helped, (unsigned long long)taken, memory_order_relaxed);
    }
    return NULL;
}

/* A forked child has the parent's memory but none of its threads. */
static void split_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.started = 0;
}

/* The fork handler, registered before the lock is first taken (a child forked while it is held
 * gets it reset), once a process. */
static pthread_once_t split_once = PTHREAD_ONCE_INIT;
static int split_registered;
static void split_register(void) { split_registered = pthread_atfork(NULL, NULL, split_after_fork) == 0; }

/* Helpers up to threads - 1 (under the lock), with every signal blocked (Python's are the main
 * thread's); how many run. One that cannot be started is not tried again until set_threads. */
static int split_start(void) {
    if (!split_registered) return 0;
    sigset_t all, before;
    sigfillset(&all);
    if (pthread_sigmask(SIG_BLOCK, &all, &before) != 0) return pool.started;
    while (!atomic_load_explicit(&pool.failed, memory_order_relaxed) && pool.started < atomic_load_explicit(&pool.threads, memory_order_relaxed) - 1) {
        pthread_t t;
        pthread_attr_t attr;
        int rc = pthread_attr_init(&attr);
        if (rc == 0) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            rc = pthread_create(&t, &attr, split_helper, NULL);
            pthread_attr_destroy(&attr);
        }
        if (rc != 0)
            atomic_store_explicit(&pool.failed, 1, memory_order_relaxed);
        else
            pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    return pool.started;
}

static long long split_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* sgd() over the pool's threads where the key is large enough and the pool free, else on
 * this thread alone. Call it with or without the GIL: it touches no Python object. */
static void sgd_split(int f64, void *p, const void *g, void *buf, Py_ssize_t n, const Step *a) {
    Py_ssize_t size = f64 ? 8 : 4;
    if (atomic_load_explicit(&pool.threads, memory_order_relaxed) < 2 || n * size < SPLIT_MIN_BYTES) {
        sgd(f64, p, g, buf, n, a);
        return;
    }
    pthread_once(&split_once, split_register);
    if (pthread_mutex_trylock(&pool.lock) != 0) {
        sgd(f64, p, g, buf, n, a);
        return;
    }
    if (split_start() < 1) {
        pthread_mutex_unlock(&pool.lock);
        sgd(f64, p, g, buf, n, a);
        return;
    }
    pool.f64 = f64;
    pool.p = p;
    pool.g = (char *)g;
    pool.buf = buf;
    pool.n = n;
    pool.size = size;
    pool.chunk = CHUNK_BYTES / size;
    pool.step = *a;
    pool.controls = FP_CONTROLS();
    uint32_t chunks = (uint32_t)((n + pool.chunk - 1) / pool.chunk);
    atomic_store_explicit(&pool.left, chunks, memory_order_relaxed);
    pool.number++;
    atomic_store_explicit(&pool.claim, (uint64_t)pool.number << 32 | chunks, memory_order_release);
    atomic_fetch_add(&pool.gen, 1);
    futex_wake(&pool.gen, atomic_load_explicit(&pool.threads, memory_order_relaxed) - 1);
    atomic_fetch_add_explicit(&pool.keys, 1, memory_order_relaxed);
    split_work();
    unsigned left;
    long long spin_until = 0;
    for (int i = 0; (left = atomic_load_explicit(&pool.left, memory_order_acquire)) != 0; i++) {
        if (i % 64 == 0) { /* the clock read now and then: a pause costs 10 to 140 cycles by the core */
            long long now = split_now_ns();
            if (!spin_until) spin_until = now + SPIN_NS;
            if (now >= spin_until) {
                futex_wait(&pool.left, left);
                continue;
            }
        }
        spin_pause();
    }
    pthread_mutex_unlock(&pool.lock);
}

/* The threads a large key is updated on (the caller's among them; at least 1, at most
 * SPLIT_MAX_THREADS); from the next key on (a key being updated keeps its own). Helpers started
 * are kept, asleep, when there are fewer: threads - 1 are woken for a key (one still awake from
 * the last may join). */
static void split_threads(long threads) {
    atomic_store_explicit(&pool.threads, threads < 1 ? 1 : threads > SPLIT_MAX_THREADS ? SPLIT_MAX_THREADS : (int)threads,
                          memory_order_relaxed);
    atomic_store_explicit(&pool.failed, 0, memory_order_relaxed);
}

static int split_threads_now(void) { return atomic_load_explicit(&pool.threads, memory_order_relaxed); }

#else /* no futex: one thread */
static struct { unsigned long long keys, helped; } pool = {0, 0};
static void sgd_split(int f64, void *p, const void *g, void *buf, Py_ssize_t n, const Step *a) {
    sgd(f64, p, g, buf, n, a);
}
static void split_threads(long threads) { (void)threads; }
static int split_threads_now(void) { return 1; }
#endif

#endif

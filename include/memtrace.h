/*
 * memtrace.h: report subsystem memory counters to memtrace, from C or C++.
 *
 * Header-only. Needs <sys/sdt.h> (Debian/Ubuntu: systemtap-sdt-dev; Fedora: systemtap-sdt-devel).
 *
 *     #include "memtrace.h"
 *
 *     MEMTRACE_REPORT_TOTAL("textures", texture_bytes);   // the subsystem now holds this many bytes
 *     MEMTRACE_REPORT_DELTA("cache", +4096);              // the subsystem grew (or shrank) by this much
 *
 *     if (MEMTRACE_ENABLED()) { ...expensive counting... } // is memtrace listening right now?
 *
 *     if (MEMTRACE_REPORT_DUE(500)) {                      // listening, and nothing reported by this
 *         MEMTRACE_REPORT_TOTAL("cache", cache_bytes());   // call site in the last 500 ms
 *     }
 *
 * memtrace samples every subsystem of every traced process at the same moment, once per interval,
 * and shows each as a `subsystem:<name>` counter, as an allocator next to "malloc" in the memory
 * dump, and in the summary's `subsystems`.
 *
 * Cost when nobody traces: MEMTRACE_REPORT_* and MEMTRACE_ENABLED() load one 16-bit semaphore and
 * branch on it; the probe itself is a nop that is never reached: on x86-64 a 5-byte nop, which
 * kernels from 6.18 probe with a call instead of a trap (traced, a report measured ~20% cheaper
 * there than on sdt.h's 1-byte nop: see `cargo xtask bench`); define MEMTRACE_ONE_BYTE_SITES
 * before including this header for sdt.h's 1-byte nop instead. The arguments of
 * MEMTRACE_REPORT_* are not even evaluated then. The kernel raises the semaphore while memtrace (or
 * any tracer) is attached to a memtrace probe of this object, and lowers it when the tracer goes.
 *
 * The probes are USDT probes `memtrace:report_total(const char *subsystem, int64_t bytes)` and
 * `memtrace:report_delta(const char *subsystem, int64_t delta)`. A subsystem name is a C string of up
 * to 63 bytes (longer names are cut); it is read when the probe fires, so it need only live that long.
 * A delta is added to the subsystem's last total (a subsystem first reported by a delta starts at 0).
 *
 * Registered dumpers, for subsystems whose totals are best read together (optional; pthreads):
 *
 *     static void dump_renderer(void *ctx) {                 // called from memtrace's dumper thread
 *         struct renderer *r = ctx;
 *         MEMTRACE_REPORT_TOTAL("textures", r->texture_bytes);
 *         MEMTRACE_REPORT_TOTAL("meshes", r->mesh_bytes);
 *     }
 *
 *     memtrace_dump_interval_ms(250);                         // default 1000
 *     int id = memtrace_register_dumper(dump_renderer, renderer);   // > 0, or -1
 *     ...
 *     memtrace_deregister_dumper(id);                          // never called again once it returns
 *
 * The first registration starts a thread (its signals blocked) that wakes once an interval and,
 * only while memtrace listens (MEMTRACE_ENABLED(); from the interval after it began to, so that
 * every probe site is in place), runs a round: it calls every registered dumper, in slot order,
 * between the probes `memtrace:dump_begin(uint64_t dump_no)` and `memtrace:dump_end(uint64_t
 * dump_no)` (dump_no counts rounds from 1). Nobody listening, it checks the semaphore once an
 * interval and calls nothing. memtrace reads one round as one dump:
 * every sample shows each subsystem a dumper reported as of the last round complete by then, in
 * the trace's memory dump and counters and in the summary, never half a round. A subsystem
 * reported outside the rounds too shows its latest value whenever that latest report was outside.
 * Registering and deregistering are thread-safe (a mutex). Deregistering waits for a round under
 * way to end, so the dumper is never called after memtrace_deregister_dumper() returns; a dumper
 * may deregister itself or another one (no wait then: the round calls no dumper deregistered
 * before its turn). A dumper must not block on a thread that is deregistering one. At most
 * MEMTRACE_MAX_DUMPERS (64; define it before including for more) at once per object; the registry
 * allocates nothing. Like the semaphore, the registry and its thread are one per object
 * (executable or shared library) that uses them; the thread runs until the process ends, so a
 * library that registers dumpers must stay loaded (no dlclose). A child made by fork() keeps the
 * registrations but has no thread until it registers a dumper itself.
 *
 * The header works whether or not the including file uses <sys/sdt.h> for other probes, with or
 * without _SDT_HAS_SEMAPHORES: it writes its probe notes with sdt.h's own building blocks and names its
 * semaphore itself. Every object (executable or shared library) that includes it gets its own hidden
 * semaphore, shared by all its probes.
 */
#ifndef MEMTRACE_H
#define MEMTRACE_H

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <sys/sdt.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Nonzero while a tracer listens to this object's memtrace probes. Weak and hidden: one per object,
 * however many files include this header; in .probes, where <sys/sdt.h> puts semaphores. */
__extension__ volatile unsigned short memtrace_semaphore
    __attribute__((weak, visibility("hidden"), section(".probes"), used)) = 0;

/* Is memtrace listening? One load of the semaphore. */
#define MEMTRACE_ENABLED() __builtin_expect(memtrace_semaphore != 0, 0)

/* The probe site's instruction: on x86-64 the 5-byte nop an optimized uprobe replaces with a call
 * (as libbpf's usdt.h writes it), elsewhere or with MEMTRACE_ONE_BYTE_SITES sdt.h's 1-byte nop. */
#if defined(__x86_64__) && !defined(MEMTRACE_ONE_BYTE_SITES)
/* 0f 1f 44 00 00, written without commas (they would split sdt.h's macro arguments). */
#define _MEMTRACE_SITE _SDT_ASM_1(990:	.4byte 0x00441f0f) _SDT_ASM_1(		.byte 0x00)
#else
#define _MEMTRACE_SITE _SDT_ASM_1(990:	_SDT_NOP)
#endif

/* The note <sys/sdt.h> writes for a probe with `n` arguments (`operands`: sdt.h's
 * _SDT_ASM_OPERANDS_<n>), with memtrace_semaphore as its semaphore (sdt.h would name it
 * memtrace_<probe>_semaphore, and only under _SDT_HAS_SEMAPHORES). */
#define _MEMTRACE_PROBE(probe, n, operands)                                                     \
    do {                                                                                        \
        __asm__ __volatile__(                                                                   \
            _SDT_DEF_MACROS                                                                     \
            _MEMTRACE_SITE                                                                      \
            _SDT_ASM_3(		.pushsection .note.stapsdt,_SDT_ASM_AUTOGROUP,"note")                 \
            _SDT_ASM_1(		.balign 4)                                                          \
            _SDT_ASM_3(		.4byte 992f-991f, 994f-993f, _SDT_NOTE_TYPE)                        \
            _SDT_ASM_1(991:	.asciz _SDT_NOTE_NAME)                                             \
            _SDT_ASM_1(992:	.balign 4)                                                         \
            _SDT_ASM_1(993:	_SDT_ASM_ADDR 990b)                                                \
            _SDT_ASM_1(		_SDT_ASM_ADDR _.stapsdt.base)                                       \
            _SDT_ASM_1(		_SDT_ASM_ADDR memtrace_semaphore)                                   \
            _SDT_ASM_STRING(memtrace)                                                           \
            _SDT_ASM_STRING(probe)                                                              \
            _SDT_ASM_ARGS(n)                                                                    \
            _SDT_ASM_SUBSTR(\x00)                                                               \
            _SDT_UNDEF_MACROS                                                                   \
            _SDT_ASM_1(994:	.balign 4)                                                         \
            _SDT_ASM_1(		.popsection)                                                        \
            :: operands);                                                                       \
        __asm__ __volatile__(_SDT_ASM_BASE);                                                    \
    } while (0)

#define _MEMTRACE_PROBE1(probe, a1) _MEMTRACE_PROBE(probe, 1, _SDT_ASM_OPERANDS_1(a1))
#define _MEMTRACE_PROBE2(probe, a1, a2) _MEMTRACE_PROBE(probe, 2, _SDT_ASM_OPERANDS_2(a1, a2))

/* The subsystem `name` (a C string) now holds `bytes` bytes. */
#define MEMTRACE_REPORT_TOTAL(name, bytes)                                                      \
    do {                                                                                        \
        if (MEMTRACE_ENABLED())                                                                 \
            _MEMTRACE_PROBE2(report_total, (const char *)(name), (int64_t)(bytes));             \
    } while (0)

/* The subsystem `name` grew by `delta` bytes (shrank, if negative). */
#define MEMTRACE_REPORT_DELTA(name, delta)                                                      \
    do {                                                                                        \
        if (MEMTRACE_ENABLED())                                                                 \
            _MEMTRACE_PROBE2(report_delta, (const char *)(name), (int64_t)(delta));             \
    } while (0)

/* When a call site last said a report was due, in CLOCK_MONOTONIC nanoseconds (0: never). */
typedef struct {
    int64_t last_ns;
} memtrace_report_clock;

/* True when memtrace listens and `clock` has not said so within the last `interval_ms`
 * milliseconds; then it restarts `clock`. Thread-safe: of threads asking at the same moment, one
 * gets true. Costs one semaphore load when nobody listens. */
static inline int memtrace_report_due(memtrace_report_clock *clock, uint32_t interval_ms) {
    struct timespec now;
    int64_t now_ns, last_ns;
    if (!MEMTRACE_ENABLED())
        return 0;
    if (clock_gettime(CLOCK_MONOTONIC, &now) != 0)
        return 0;
    now_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
    last_ns = __atomic_load_n(&clock->last_ns, __ATOMIC_RELAXED);
    if (last_ns != 0 && now_ns - last_ns < (int64_t)interval_ms * 1000000)
        return 0;
    return __atomic_compare_exchange_n(&clock->last_ns, &last_ns, now_ns, 0, __ATOMIC_RELAXED,
                                       __ATOMIC_RELAXED);
}

/* memtrace_report_due with a clock of its own per call site (a GNU statement expression). */
#define MEMTRACE_REPORT_DUE(interval_ms)                                                        \
    __extension__({                                                                             \
        static memtrace_report_clock _memtrace_clock;                                           \
        memtrace_report_due(&_memtrace_clock, (interval_ms));                                   \
    })

/* ---- Registered dumpers ------------------------------------------------------------------- */

/* At most this many dumpers are registered at once in one object (define it before including the
 * header for more); a registration beyond it fails. */
#ifndef MEMTRACE_MAX_DUMPERS
#define MEMTRACE_MAX_DUMPERS 64
#endif

/* The interval between rounds until memtrace_dump_interval_ms() sets one. */
#define MEMTRACE_DEFAULT_DUMP_INTERVAL_MS 1000

/* A dumper: reports its subsystems' totals (MEMTRACE_REPORT_TOTAL) when called. */
typedef void (*memtrace_dumper_fn)(void *ctx);

struct _memtrace_dumper {
    memtrace_dumper_fn fn; /* NULL: a free slot */
    void *ctx;
    int id;
};

/* The registry of one object: its dumpers and its dumper thread, guarded by _memtrace_dumpers_lock
 * (but `ticks` and `interval_ms`, which are atomic). Weak and hidden like the semaphore: one per
 * object, however many files include this header. */
struct _memtrace_dumpers {
    struct _memtrace_dumper slots[MEMTRACE_MAX_DUMPERS];
    int used;                   /* slots at and past this index are free */
    int last_id;                /* the id handed out last */
    int started;                /* the dumper thread runs */
    int running;                /* it is in a round */
    int atfork_set;             /* the fork handlers are registered */
    pthread_t thread;
    uint64_t rounds;            /* rounds run: the last round's dump_no */
    uint64_t ticks;             /* times the thread woke (atomic; rounds or not) */
    uint32_t interval_ms;       /* atomic; 0: MEMTRACE_DEFAULT_DUMP_INTERVAL_MS */
};

__extension__ struct _memtrace_dumpers _memtrace_dumpers __attribute__((weak, visibility("hidden")));
__extension__ pthread_mutex_t _memtrace_dumpers_lock __attribute__((weak, visibility("hidden"))) =
    PTHREAD_MUTEX_INITIALIZER;
/* Broadcast when a round ends. */
__extension__ pthread_cond_t _memtrace_round_done __attribute__((weak, visibility("hidden"))) =
    PTHREAD_COND_INITIALIZER;

/* Sets the interval between rounds, from the next one on (0: the default, 1000 ms). */
static inline void memtrace_dump_interval_ms(uint32_t interval_ms) {
    __atomic_store_n(&_memtrace_dumpers.interval_ms, interval_ms, __ATOMIC_RELAXED);
}

/* Copies the dumper in slot `index` (fn NULL: a free slot); 0 once past the last one used. */
static inline int _memtrace_dumper_at(struct _memtrace_dumpers *d, int index, struct _memtrace_dumper *dumper) {
    int within;
    pthread_mutex_lock(&_memtrace_dumpers_lock);
    within = index < d->used;
    if (within)
        *dumper = d->slots[index];
    pthread_mutex_unlock(&_memtrace_dumpers_lock);
    return within;
}

/* One round: every registered dumper, between memtrace:dump_begin and memtrace:dump_end. Each slot
 * is read under the lock just before its call, so a dumper deregistered by an earlier one of the
 * round is not called. */
static inline void _memtrace_dump_round(struct _memtrace_dumpers *d) {
    struct _memtrace_dumper dumper;
    uint64_t dump_no;
    int index;
    pthread_mutex_lock(&_memtrace_dumpers_lock);
    if (d->used == 0) {
        pthread_mutex_unlock(&_memtrace_dumpers_lock);
        return;
    }
    d->running = 1;
    dump_no = ++d->rounds;
    pthread_mutex_unlock(&_memtrace_dumpers_lock);
    _MEMTRACE_PROBE1(dump_begin, (uint64_t)dump_no);
    for (index = 0; _memtrace_dumper_at(d, index, &dumper); index++) {
        if (dumper.fn)
            dumper.fn(dumper.ctx);
    }
    _MEMTRACE_PROBE1(dump_end, (uint64_t)dump_no);
    pthread_mutex_lock(&_memtrace_dumpers_lock);
    d->running = 0;
    pthread_cond_broadcast(&_memtrace_round_done);
    pthread_mutex_unlock(&_memtrace_dumpers_lock);
}

/* The dumper thread: wakes once an interval, and runs a round only while memtrace listens, from
 * the second tick it listens on: the semaphore rises with the first probe site attached, and the
 * others may take a moment more (a round half probed would show half). */
static inline void *_memtrace_dumper_thread(void *unused) {
    struct _memtrace_dumpers *d = &_memtrace_dumpers;
    int listened = 0;
    (void)unused;
    for (;;) {
        uint32_t ms = __atomic_load_n(&d->interval_ms, __ATOMIC_RELAXED);
        struct timespec pause;
        if (ms == 0)
            ms = MEMTRACE_DEFAULT_DUMP_INTERVAL_MS;
        pause.tv_sec = ms / 1000;
        pause.tv_nsec = (long)(ms % 1000) * 1000000;
        while (nanosleep(&pause, &pause) != 0)
            ; /* a signal cut the sleep short: sleep the rest */
        __atomic_add_fetch(&d->ticks, 1, __ATOMIC_RELAXED);
        if (!MEMTRACE_ENABLED())
            listened = 0;
        else if (!listened)
            listened = 1;
        else
            _memtrace_dump_round(d);
    }
    return 0;
}

/* fork(): the registry is copied under its lock; the child has no dumper thread (and no round under
 * way) until it registers a dumper, and a condition variable no thread waits on. */
static inline void _memtrace_dumpers_prefork(void) { pthread_mutex_lock(&_memtrace_dumpers_lock); }
static inline void _memtrace_dumpers_postfork(void) { pthread_mutex_unlock(&_memtrace_dumpers_lock); }
static inline void _memtrace_dumpers_child(void) {
    _memtrace_dumpers.started = 0;
    _memtrace_dumpers.running = 0;
    pthread_cond_init(&_memtrace_round_done, 0);
    pthread_mutex_unlock(&_memtrace_dumpers_lock);
}

/* Starts the dumper thread, with every signal blocked (they are the application's threads' to
 * take); called with the lock held. Returns 0 on success. */
static inline int _memtrace_start_dumper_thread(struct _memtrace_dumpers *d) {
    sigset_t all, previous;
    int failed;
    if (!d->atfork_set) {
        if (pthread_atfork(_memtrace_dumpers_prefork, _memtrace_dumpers_postfork, _memtrace_dumpers_child))
            return -1;
        d->atfork_set = 1;
    }
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    failed = pthread_create(&d->thread, 0, _memtrace_dumper_thread, 0);
    pthread_sigmask(SIG_SETMASK, &previous, 0);
    if (failed)
        return -1;
    pthread_detach(d->thread);
    d->started = 1;
    return 0;
}

/* Registers `fn`, to be called with `ctx` in every round from now on (from the dumper thread,
 * started by the first registration). Returns the dumper's id (> 0), or -1 when fn is NULL, all
 * MEMTRACE_MAX_DUMPERS slots are taken or the thread cannot start. Any thread may call it. */
static inline int memtrace_register_dumper(memtrace_dumper_fn fn, void *ctx) {
    struct _memtrace_dumpers *d = &_memtrace_dumpers;
    int index, id = -1;
    if (!fn)
        return -1;
    pthread_mutex_lock(&_memtrace_dumpers_lock);
    for (index = 0; index < MEMTRACE_MAX_DUMPERS && d->slots[index].fn; index++)
        ;
    if (index < MEMTRACE_MAX_DUMPERS && (d->started || _memtrace_start_dumper_thread(d) == 0)) {
        id = d->last_id = d->last_id % 0x7fffffff + 1;
        d->slots[index].fn = fn;
        d->slots[index].ctx = ctx;
        d->slots[index].id = id;
        if (index >= d->used)
            d->used = index + 1;
    }
    pthread_mutex_unlock(&_memtrace_dumpers_lock);
    return id;
}

/* Deregisters the dumper `id`. Once it returns, the dumper is never called again: a round under
 * way that may still call it is waited for (unless the caller is that round's own dumper thread, a
 * dumper deregistering itself or another one). Returns 0, or -1 when no dumper has that id. */
static inline int memtrace_deregister_dumper(int id) {
    struct _memtrace_dumpers *d = &_memtrace_dumpers;
    int index, found = -1;
    pthread_mutex_lock(&_memtrace_dumpers_lock);
    for (index = 0; index < d->used; index++) {
        if (d->slots[index].fn && d->slots[index].id == id) {
            d->slots[index].fn = 0;
            d->slots[index].id = 0;
            found = 0;
            break;
        }
    }
    while (d->used > 0 && !d->slots[d->used - 1].fn)
        d->used--;
    if (found == 0 && d->running && !pthread_equal(pthread_self(), d->thread)) {
        uint64_t round = d->rounds;
        while (d->running && d->rounds == round)
            pthread_cond_wait(&_memtrace_round_done, &_memtrace_dumpers_lock);
    }
    pthread_mutex_unlock(&_memtrace_dumpers_lock);
    return found;
}

#ifdef __cplusplus
}
#endif

#endif /* MEMTRACE_H */

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
 * The header works whether or not the including file uses <sys/sdt.h> for other probes, with or
 * without _SDT_HAS_SEMAPHORES: it writes its probe notes with sdt.h's own building blocks and names its
 * semaphore itself. Every object (executable or shared library) that includes it gets its own hidden
 * semaphore, shared by both probes.
 */
#ifndef MEMTRACE_H
#define MEMTRACE_H

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

/* The note <sys/sdt.h> writes for a probe with two arguments, with memtrace_semaphore as its
 * semaphore (sdt.h would name it memtrace_<probe>_semaphore, and only under _SDT_HAS_SEMAPHORES). */
#define _MEMTRACE_PROBE2(probe, a1, a2)                                                         \
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
            _SDT_ASM_ARGS(2)                                                                    \
            _SDT_ASM_SUBSTR(\x00)                                                               \
            _SDT_UNDEF_MACROS                                                                   \
            _SDT_ASM_1(994:	.balign 4)                                                         \
            _SDT_ASM_1(		.popsection)                                                        \
            :: _SDT_ASM_OPERANDS_2(a1, a2));                                                    \
        __asm__ __volatile__(_SDT_ASM_BASE);                                                    \
    } while (0)

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

#ifdef __cplusplus
}
#endif

#endif /* MEMTRACE_H */

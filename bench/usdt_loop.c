/* `cargo xtask bench`: the traced cost of a subsystem report. Waits (at most 10 s) until a tracer
 * raises the probe's semaphore, then times N reports of MEMTRACE_REPORT_DELTA and writes the
 * nanoseconds per report to stdout. Built twice: with include/memtrace.h's sites (5-byte nops,
 * which kernels from 6.18 probe without a trap), and with -DONE_BYTE_NOP as <sys/sdt.h>'s
 * STAP_PROBE2 writes the site (a 1-byte nop), to compare. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#ifdef ONE_BYTE_NOP
#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>
__extension__ volatile unsigned short memtrace_report_delta_semaphore
    __attribute__((section(".probes"), used)) = 0;
#define LISTENING() (memtrace_report_delta_semaphore != 0)
#define REPORT(name, delta) STAP_PROBE2(memtrace, report_delta, (const char *)(name), (long)(delta))
#else
#include "memtrace.h"
#define LISTENING() MEMTRACE_ENABLED()
#define REPORT(name, delta) MEMTRACE_REPORT_DELTA(name, delta)
#endif

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    long reports = argc > 1 ? atol(argv[1]) : 200000;
    for (double give_up = now_ns() + 10e9; !LISTENING(); usleep(1000))
        if (now_ns() > give_up)
            return 2;
    double start = now_ns();
    for (long i = 0; i < reports; i++)
        REPORT("bench", 1);
    double ns = (now_ns() - start) / reports;
    char line[64];
    int len = snprintf(line, sizeof line, "%.1f\n", ns);
    write(1, line, len);
    return 0;
}

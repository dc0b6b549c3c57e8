/*
 * Example: an application that reports its subsystems' memory to memtrace through
 * include/memtrace.h.
 *
 * Build:  cc -O2 -I include -o memtrace_subsystems examples/memtrace_subsystems.c
 * Trace:  sudo memtrace --summary summary.json -- ./memtrace_subsystems
 *         (the summary's "subsystems" then holds "textures", "cache" and "requests", and the trace
 *         shows them as subsystem:<name> counters and as allocators next to "malloc")
 *
 * The program keeps its own counters, as an application does anyway, and publishes them:
 * - "textures" as a total whenever it changes (MEMTRACE_REPORT_TOTAL);
 * - "cache" as changes (MEMTRACE_REPORT_DELTA), from wherever memory is added or dropped;
 * - "requests" only when a report is due (MEMTRACE_REPORT_DUE): counting it is "expensive", so the
 *   program counts only while memtrace listens, and at most every 100 ms.
 * Untraced, each report costs one load of the semaphore and a branch.
 *
 * At the end it prints the last value it reported for each subsystem (`reported NAME BYTES`).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "memtrace.h"

enum { FRAMES = 30 };

static int64_t textures;
static int64_t cache;
static int64_t requests_reported = -1;

/* Stands in for a walk over live requests, too costly to do when nobody looks. */
static int64_t count_request_bytes(int frame) { return 2048 * (int64_t)(frame % 7 + 1); }

static void sleep_ms(long ms) {
    struct timespec pause = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&pause, NULL);
}

int main(void) {
    for (int frame = 0; frame < FRAMES; frame++) {
        /* Load a texture every frame, drop them all every 10 frames. */
        textures = frame % 10 == 9 ? 0 : textures + 256 * 1024;
        MEMTRACE_REPORT_TOTAL("textures", textures);

        /* The cache grows by 4 KiB a frame and is trimmed by 10 KiB every 5 frames. */
        MEMTRACE_REPORT_DELTA("cache", 4096);
        cache += 4096;
        if (frame % 5 == 4) {
            MEMTRACE_REPORT_DELTA("cache", -10240);
            cache -= 10240;
        }

        if (MEMTRACE_REPORT_DUE(100)) {
            requests_reported = count_request_bytes(frame);
            MEMTRACE_REPORT_TOTAL("requests", requests_reported);
        }
        sleep_ms(10);
    }
    if (MEMTRACE_ENABLED()) {
        printf("reported textures %lld\n", (long long)textures);
        printf("reported cache %lld\n", (long long)cache);
        if (requests_reported >= 0)
            printf("reported requests %lld\n", (long long)requests_reported);
    } else {
        printf("memtrace was not listening\n");
    }
    return 0;
}

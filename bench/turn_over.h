/* The timed loop of the benchmarks: a thread turns over 64 live slots with mixed sizes, as an
 * allocation-heavy program does: every iteration frees the block in one slot and allocates a new
 * one there. Returns the nanoseconds per malloc/free pair. */
#include <stdlib.h>
#include <time.h>

#define SLOTS 64

/* How iteration i allocates; a bench may route allocations through call sites of its own. */
#ifndef ALLOCATE
#define ALLOCATE(i, size) malloc(size)
#endif

static const size_t sizes[] = {16, 24, 40, 64, 100, 256, 1000};

static __attribute__((noinline)) double turn_over(long pairs) {
    void *volatile slots[SLOTS] = {0};
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < pairs; i++) {
        free(slots[i % SLOTS]);
        slots[i % SLOTS] = ALLOCATE(i, sizes[i % (sizeof sizes / sizeof sizes[0])]);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    for (int i = 0; i < SLOTS; i++)
        free(slots[i]);
    return ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / pairs;
}

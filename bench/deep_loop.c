/* `cargo xtask bench`: the unwinder's cost per frame. Descends DEPTH calls (each a real frame: not
 * inlined, not a tail call), then times N malloc/free pairs there, so that every allocation's stack
 * is DEPTH frames deeper than main's. Built twice, with and without frame pointers. Writes the
 * nanoseconds per pair to stdout.
 *
 * With SITES 1 every allocation has the same stack, the stack of the one before it (memtrace takes
 * it from its memo of the CPU's last walk); with SITES 2 allocations alternate between two call
 * sites, so that each stack differs from the last one and is unwound in full. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int sites = 1;
static volatile int last_site;

/* Two call sites of malloc, each a frame of its own (the store after the call keeps malloc from
 * being a tail call, and the stores differ so that the two are not merged). */
static __attribute__((noinline)) void *allocate_here(size_t size) {
    void *block = malloc(size);
    last_site = 1;
    return block;
}

static __attribute__((noinline)) void *allocate_there(size_t size) {
    void *block = malloc(size);
    last_site = 2;
    return block;
}

#define ALLOCATE(i, size) ((sites == 2 && ((i) & 1)) ? allocate_there(size) : allocate_here(size))

#include "turn_over.h"

/* The volatile local and the use of the result after the call keep each level a frame of its own. */
static __attribute__((noinline)) double descend(int depth, long pairs) {
    volatile int keep = depth;
    if (depth == 0)
        return turn_over(pairs);
    double ns = descend(depth - 1, pairs);
    return ns + keep * 0.0;
}

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 200000;
    int depth = argc > 2 ? atoi(argv[2]) : 16;
    sites = argc > 3 ? atoi(argv[3]) : 1;
    if (pairs <= 0 || depth < 0 || depth > 200 || sites < 1 || sites > 2) {
        fprintf(stderr, "usage: %s [PAIRS] [DEPTH <= 200] [SITES 1|2]\n", argv[0]);
        return 2;
    }
    char line[64];
    int len = snprintf(line, sizeof line, "%.1f\n", descend(depth, pairs));
    write(1, line, len);
    return 0;
}

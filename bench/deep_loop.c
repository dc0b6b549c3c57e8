/* `cargo xtask bench`: the unwinder's cost per frame. Descends DEPTH calls (each a real frame: not
 * inlined, not a tail call), then times N malloc/free pairs there, so that every allocation's stack
 * is DEPTH frames deeper than main's. Built twice, with and without frame pointers. Writes the
 * nanoseconds per pair to stdout. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

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
    if (pairs <= 0 || depth < 0 || depth > 200) {
        fprintf(stderr, "usage: %s [PAIRS] [DEPTH <= 200]\n", argv[0]);
        return 2;
    }
    char line[64];
    int len = snprintf(line, sizeof line, "%.1f\n", descend(depth, pairs));
    write(1, line, len);
    return 0;
}

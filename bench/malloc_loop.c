/* `cargo xtask bench`: times N malloc/free pairs and writes the nanoseconds per pair to stdout.
 * A single thread turns over 64 live slots with mixed sizes, as an allocation-heavy program does:
 * every iteration frees the block in one slot and allocates a new one there. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 64

static const size_t sizes[] = {16, 24, 40, 64, 100, 256, 1000};

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 200000;
    void *volatile slots[SLOTS] = {0};
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < pairs; i++) {
        free(slots[i % SLOTS]);
        slots[i % SLOTS] = malloc(sizes[i % (sizeof sizes / sizeof sizes[0])]);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    for (int i = 0; i < SLOTS; i++)
        free(slots[i]);
    double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
    char line[64];
    int len = snprintf(line, sizeof line, "%.1f\n", ns / pairs);
    write(1, line, len);
    return 0;
}

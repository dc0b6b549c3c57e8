/* `cargo xtask bench`: times N malloc/free pairs and writes the nanoseconds per pair to stdout.
 * A thread turns over 64 live slots with mixed sizes, as an allocation-heavy program does: every
 * iteration frees the block in one slot and allocates a new one there. With a second argument T,
 * T threads do so at once, each N pairs, and the figure is the mean of the threads' own figures. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 64
#define MAX_THREADS 64

static const size_t sizes[] = {16, 24, 40, 64, 100, 256, 1000};
static long pairs;

static void *turn_over(void *ns_per_pair) {
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
    *(double *)ns_per_pair = ns / pairs;
    return NULL;
}

int main(int argc, char **argv) {
    pairs = argc > 1 ? atol(argv[1]) : 200000;
    int threads = argc > 2 ? atoi(argv[2]) : 1;
    if (pairs <= 0 || threads < 1 || threads > MAX_THREADS) {
        fprintf(stderr, "usage: %s [PAIRS] [THREADS <= %d]\n", argv[0], MAX_THREADS);
        return 2;
    }
    double ns[MAX_THREADS];
    double sum = 0;
    if (threads == 1) {
        turn_over(&ns[0]);
        sum = ns[0];
    } else {
        pthread_t ids[MAX_THREADS];
        for (int t = 0; t < threads; t++)
            pthread_create(&ids[t], NULL, turn_over, &ns[t]);
        for (int t = 0; t < threads; t++) {
            pthread_join(ids[t], NULL);
            sum += ns[t];
        }
    }
    char line[64];
    int len = snprintf(line, sizeof line, "%.1f\n", sum / threads);
    write(1, line, len);
    return 0;
}

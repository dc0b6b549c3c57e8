/* `cargo xtask bench`: times N malloc/free pairs and writes the nanoseconds per pair to stdout.
 * One thread runs turn_over.h's loop; with a second argument T,
 * T threads do so at once, each N pairs, and the figure is the mean of the threads' own figures. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "turn_over.h"

#define MAX_THREADS 64

static long pairs;

static void *run_thread(void *ns_per_pair) {
    *(double *)ns_per_pair = turn_over(pairs);
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
        sum = turn_over(pairs);
    } else {
        pthread_t ids[MAX_THREADS];
        for (int t = 0; t < threads; t++)
            pthread_create(&ids[t], NULL, run_thread, &ns[t]);
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

/* `cargo xtask bench`: times N malloc/free pairs and writes the nanoseconds per pair to stdout. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 200000;
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < pairs; i++) {
        void *volatile block = malloc(64);
        free(block);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
    char line[64];
    int len = snprintf(line, sizeof line, "%.1f\n", ns / pairs);
    write(1, line, len);
    return 0;
}

/* `cargo xtask bench`: a quiet traced process, as most of a machine's are. For SECONDS seconds it
 * makes 100 malloc/free pairs every 10 ms, keeping a few blocks live. The collector's own CPU use
 * is measured over 100 of these. */
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int seconds = argc > 1 ? atoi(argv[1]) : 10;
    void *volatile keep[8] = {0};
    time_t end = time(NULL) + seconds;
    for (long round = 0; time(NULL) < end; round++) {
        for (int i = 0; i < 100; i++)
            free(malloc(32 + (size_t)(i % 7) * 40));
        free(keep[round % 8]);
        keep[round % 8] = malloc(128);
        usleep(10000);
    }
    return 0;
}

/* The demo workload of `cargo xtask demo`: for about two seconds it builds and tears down a working
 * set, keeps a small cache, and leaks a little on every round. It uses no stdio, so its allocations
 * are exactly the ones below: per round 64 blocks of 1 KiB made and freed, one 4 KiB cache entry
 * kept, and one 100-byte leak. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ROUNDS = 20, WORKING_SET = 64 };

static void *cache[ROUNDS];
/* Volatile, so the compiler cannot drop the leaking allocation as unused. */
static void *volatile leaked;

static void pause_ms(long ms) {
    struct timespec delay = {0, ms * 1000000L};
    nanosleep(&delay, NULL);
}

int main(void) {
    for (int round = 0; round < ROUNDS; round++) {
        void *working[WORKING_SET];
        for (int i = 0; i < WORKING_SET; i++) {
            working[i] = malloc(1024);
            memset(working[i], round, 1024);
        }
        cache[round] = calloc(1, 4096);
        leaked = malloc(100);
        pause_ms(100);
        for (int i = 0; i < WORKING_SET; i++)
            free(working[i]);
    }
    for (int round = 0; round < ROUNDS / 2; round++)
        free(cache[round]);
    pause_ms(200);
    return 0;
}

/* The arm64 matrix's fixture (tests/matrix-arm64/run.sh), linked against each allocator. No stdio, so no
 * hidden buffer. No arguments: main makes 100 allocations of 1000 bytes and frees 50 (live: 50 blocks,
 * 50,000 bytes, all from main). "threads": 4 threads each make 5,000 malloc/free pairs of 16 to 520 bytes,
 * nothing left live (20,000 allocations and frees, beside pthread_create's own). */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static void *churn(void *arg) {
    (void)arg;
    for (int i = 0; i < 5000; i++) {
        void *volatile p = malloc(16 + (i % 64) * 8);
        free(p);
    }
    return 0;
}

int main(int argc, char **argv) {
    (void)argv;
    if (argc > 1) {
        pthread_t t[4];
        for (int i = 0; i < 4; i++) pthread_create(&t[i], 0, churn, 0);
        for (int i = 0; i < 4; i++) pthread_join(t[i], 0);
        return 0;
    }
    void *keep[100];
    for (int i = 0; i < 100; i++) keep[i] = malloc(1000);
    for (int i = 0; i < 50; i++) free(keep[i]);
    write(1, "fixture done\n", 13);
    return 0;
}

/* `cargo xtask bench`: one process with a big heap, 1 GiB live in 1,048,576 blocks of 1024 bytes,
 * every page touched; then, for SECONDS seconds, 100 malloc/free pairs every 10 ms, as a quiet
 * server's would. Says "ready" once the heap is made. The collector's own CPU is measured over it:
 * reading smaps and pagemap, and the free pool over a million live blocks, must stay bounded. */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOCKS (1 << 20)

static void *blocks[BLOCKS];

int main(int argc, char **argv) {
    int seconds = argc > 1 ? atoi(argv[1]) : 10;
    for (int i = 0; i < BLOCKS; i++) {
        blocks[i] = malloc(1024);
        memset(blocks[i], 1, 1024);
    }
    if (write(1, "ready\n", 6) != 6)
        return 1;
    time_t end = time(NULL) + seconds;
    while (time(NULL) < end) {
        for (int i = 0; i < 100; i++)
            free(malloc(32 + (size_t)(i % 7) * 40));
        usleep(10000);
    }
    return 0;
}

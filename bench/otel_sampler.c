/* An LD_PRELOAD shim that makes glibc's malloc a sampling allocator with OpenTelemetry's
 * memory-profiling probes, as jemalloc's and libdatadog's heap samplers are proposed to be: each
 * thread samples a point every SAMPLE_BYTES allocated bytes on average (a geometric distance, as
 * tcmalloc does), and a sampled block fires otel_memory:alloc(ptr, size, weighted_bytes); its free
 * fires otel_memory:free(ptr). Unsampled calls cost a subtraction and, on free, one look into a
 * small table of the sampled blocks. `cargo xtask bench` runs Python's json work with it under
 * memtrace --app-sampled, beside exact tracing and heaptrack.
 *
 * Build: cc -O2 -shared -fPIC -o otel_sampler.so otel_sampler.c */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/sdt.h>

#define SAMPLE_BYTES (512 * 1024)
/* Sampled blocks live at once, at most (open addressing; a full table samples nothing more). */
#define SLOTS (1 << 16)
#define PROBES 64
#define TOMBSTONE ((uintptr_t)1)

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);

static _Atomic uintptr_t sampled[SLOTS];
static __thread int64_t until_sample = -1;
static __thread uint64_t random_state;

static size_t slot_of(uintptr_t block) { return (size_t)((block >> 4) * 0x9e3779b97f4a7c15ull >> 48); }

/* A geometric distance with mean SAMPLE_BYTES, from a per-thread xorshift. */
static int64_t next_distance(void) {
    if (random_state == 0)
        random_state = (uint64_t)(uintptr_t)&random_state | 1;
    random_state ^= random_state << 13;
    random_state ^= random_state >> 7;
    random_state ^= random_state << 17;
    double uniform = ((random_state >> 11) + 1) * (1.0 / 9007199254740993.0);
    return (int64_t)(-log(uniform) * SAMPLE_BYTES) + 1;
}

static int remember(uintptr_t block) {
    for (size_t i = 0, at = slot_of(block); i < PROBES; i++, at = (at + 1) & (SLOTS - 1)) {
        uintptr_t seen = atomic_load_explicit(&sampled[at], memory_order_relaxed);
        if ((seen == 0 || seen == TOMBSTONE) &&
            atomic_compare_exchange_strong(&sampled[at], &seen, block))
            return 1;
    }
    return 0;
}

static int forget(uintptr_t block) {
    for (size_t i = 0, at = slot_of(block); i < PROBES; i++, at = (at + 1) & (SLOTS - 1)) {
        uintptr_t seen = atomic_load_explicit(&sampled[at], memory_order_relaxed);
        if (seen == 0)
            return 0;
        if (seen == block && atomic_compare_exchange_strong(&sampled[at], &seen, TOMBSTONE))
            return 1;
    }
    return 0;
}

/* Samples `block` of `size` bytes when a sample point falls in it: it then stands for the
 * expected bytes between points, at least its own size. */
static void *maybe_sample(void *block, size_t size) {
    if (until_sample < 0)
        until_sample = next_distance();
    until_sample -= (int64_t)size;
    if (block == NULL || until_sample > 0)
        return block;
    until_sample = next_distance();
    unsigned long weighted = size > SAMPLE_BYTES ? size : SAMPLE_BYTES;
    if (remember((uintptr_t)block))
        DTRACE_PROBE3(otel_memory, alloc, block, size, weighted);
    return block;
}

static void note_free(void *block) {
    if (block != NULL && forget((uintptr_t)block))
        DTRACE_PROBE1(otel_memory, free, block);
}

void *malloc(size_t size) { return maybe_sample(__libc_malloc(size), size); }

void *calloc(size_t n, size_t size) { return maybe_sample(__libc_calloc(n, size), n * size); }

void *realloc(void *old, size_t size) {
    void *block = __libc_realloc(old, size);
    if (block != NULL || size == 0)
        note_free(old);
    return maybe_sample(block, size);
}

void free(void *block) {
    note_free(block);
    __libc_free(block);
}

/* The demo workload of `cargo xtask demo`: a small request-serving service, about three seconds
 * long untraced, that gives every section of memtrace's report something true to show.
 *
 * `demo [SCRIPT.py]`: with a script, it first starts `/usr/bin/python3 SCRIPT.py` as a child (the
 * bundled examples/demo.py, whose functions then show in that process's stacks) and waits for it
 * at the end. Then 4 worker threads, each allocating from a glibc arena of its own (5 arenas with
 * the main one), serve 2,400 requests each (9,600 in all) in 24 batches of 100, a 120 ms pause
 * after each batch. Per request, from handle_request():
 *   - parse_request() mallocs a 1,200-byte scratch buffer and frees it at once, before the thread
 *     allocates anything else: the temporary-allocation hot spot, 9,600 temporary allocations of
 *     11,520,000 bytes in all;
 *   - every 10th request, remember_session() mallocs a 2,048-byte session record and keeps it in a
 *     table nobody ever expires: the leak, growing all run long, 960 blocks of 1,966,080 bytes at
 *     the end (240 a worker), all from one stack;
 *   - build_response() mallocs a 4,096-byte response (9,600 in all, 39,321,600 bytes), held until
 *     send_responses() frees the batch's 100 at its end (the first it frees is the batch's last
 *     allocation: by the same definition 96 temporary allocations, one a batch, from there).
 * So in every pause a worker's arena holds its sessions with the freed responses between them:
 * resident free chunks in the arena's free lists (the free pool, what malloc_trim(0) could give
 * back), about 400 KiB a worker, reused by the next batch.
 * A dumper registered with memtrace_register_dumper (include/memtrace.h) reports the USDT
 * subsystem `sessions` (the session tables' bytes: 1,966,080 at the end) every 250 ms while
 * memtrace listens; once the workers are done, the service waits (traced only, polling, at most
 * 2 s) for a round that began after them, so the last report is the final figure.
 * Live at the end besides the sessions: only what glibc's pthread_create keeps per thread (TLS).
 * Nothing is printed; exits 0, or 1 when a thread or the script's child fails. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "memtrace.h"

enum {
    WORKERS = 4,
    BATCHES = 24,
    BATCH = 100,
    PAUSE_MS = 120,
    SCRATCH_BYTES = 1200,
    SESSION_EVERY = 10,
    SESSION_BYTES = 2048,
    RESPONSE_BYTES = 4096,
};

/* A session record; sessions are chained through their first bytes. */
struct session {
    struct session *next;
    uint64_t id;
    char user[SESSION_BYTES - 16];
};

struct worker {
    pthread_t thread;
    int id;
    struct session *sessions; /* never expired: the leak */
    char *responses[BATCH]; /* the batch being served */
};

static struct worker workers[WORKERS];
/* What the dumper reports: bytes held by the session tables. */
static int64_t session_bytes;
/* Dumper rounds so far. */
static int rounds;

static void pause_ms(long ms) {
    struct timespec delay = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&delay, &delay) != 0)
        ;
}

/* Keeps `buffer` as if something read it: the compiler may not drop a malloc/free pair. */
static void use(void *buffer) { __asm__ __volatile__("" : : "r"(buffer) : "memory"); }

/* Parses a request into a scratch buffer, freed before anything else is allocated. */
static __attribute__((noinline)) uint64_t parse_request(uint64_t request) {
    char *scratch = malloc(SCRATCH_BYTES);
    uint64_t checksum = 0;
    memset(scratch, (int)(request & 0x7f), SCRATCH_BYTES);
    use(scratch);
    for (int i = 0; i < SCRATCH_BYTES; i += 64)
        checksum += (unsigned char)scratch[i];
    free(scratch);
    return checksum;
}

/* Records a session in the worker's table, which nothing ever expires. */
static __attribute__((noinline)) void remember_session(struct worker *worker, uint64_t request) {
    struct session *session = malloc(sizeof *session);
    session->id = request;
    memset(session->user, 'u', sizeof session->user);
    session->next = worker->sessions;
    worker->sessions = session;
    __atomic_add_fetch(&session_bytes, (int64_t)sizeof *session, __ATOMIC_RELAXED);
}

/* Builds the request's response, held until its batch is sent. */
static __attribute__((noinline)) char *build_response(uint64_t checksum) {
    char *response = malloc(RESPONSE_BYTES);
    memset(response, (int)(checksum & 0x7f), RESPONSE_BYTES);
    use(response);
    return response;
}

static __attribute__((noinline)) char *handle_request(struct worker *worker, uint64_t request) {
    uint64_t checksum = parse_request(request);
    char *response;
    if (request % SESSION_EVERY == 0)
        remember_session(worker, request);
    response = build_response(checksum);
    use(response);
    return response;
}

/* Sends a batch's responses and frees them: holes in the arena between the batch's sessions. */
static __attribute__((noinline)) void send_responses(char **responses, int count) {
    for (int i = 0; i < count; i++) {
        use(responses[i]);
        free(responses[i]);
    }
}

static void *worker_main(void *arg) {
    struct worker *worker = arg;
    uint64_t request = 0;
    for (int batch = 0; batch < BATCHES; batch++) {
        for (int i = 0; i < BATCH; i++)
            worker->responses[i] = handle_request(worker, request++);
        send_responses(worker->responses, BATCH);
        pause_ms(PAUSE_MS);
    }
    return NULL;
}

/* The dumper: called from memtrace.h's dumper thread once a round while memtrace listens. */
static void dump_service(void *unused) {
    (void)unused;
    MEMTRACE_REPORT_TOTAL("sessions", __atomic_load_n(&session_bytes, __ATOMIC_RELAXED));
    __atomic_add_fetch(&rounds, 1, __ATOMIC_RELAXED);
}

/* Starts `python3 script` as a child; its pid, or -1. */
static pid_t start_script(const char *script) {
    pid_t pid = fork();
    if (pid == 0) {
        execl("/usr/bin/python3", "python3", script, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Traced, waits until a dumper round began after the workers ended (its figures are the final
 * ones): two more rounds, polled, for at most 2 s. */
static void wait_for_a_final_round(void) {
    int seen = __atomic_load_n(&rounds, __ATOMIC_RELAXED);
    for (int waited = 0; waited < 2000 && MEMTRACE_ENABLED(); waited += 10) {
        if (__atomic_load_n(&rounds, __ATOMIC_RELAXED) >= seen + 2)
            return;
        pause_ms(10);
    }
}

int main(int argc, char **argv) {
    pid_t script = argc > 1 ? start_script(argv[1]) : 0;
    int status = 0;
    if (script < 0)
        return 1;
    memtrace_dump_interval_ms(250);
    if (memtrace_register_dumper(dump_service, NULL) <= 0)
        return 1;
    for (int i = 0; i < WORKERS; i++) {
        workers[i].id = i;
        if (pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]) != 0)
            return 1;
    }
    for (int i = 0; i < WORKERS; i++)
        pthread_join(workers[i].thread, NULL);
    wait_for_a_final_round();
    if (script > 0 && (waitpid(script, &status, 0) != script || !WIFEXITED(status) || WEXITSTATUS(status)))
        return 1;
    return 0;
}

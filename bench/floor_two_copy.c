/*
 * The floor of a mid-sized direct broadcast (or a gather's/scatter's one lane) on this host:
 * two threads pinned to cores 0 and 1, no software around them. Each op the producer copies a
 * fresh block into a shared buffer (whose lines the consumer read last op, so every store
 * first takes the line back), raises a flag, and the consumer copies the block out (every
 * load pulls a line from the other core). This is the scheme of oxcomm's chunk halves
 * (crates/oxcomm/src/algorithms/shm_direct/broadcast.rs) reduced to two memcpy calls.
 *
 *   gcc -O2 -o /tmp/floor2 bench/floor_two_copy.c -lpthread && for k in 64 128 256 512; do /tmp/floor2 $k; done
 *
 * A benchmark, not a test. Compare with `oxcomm bench --op broadcast --world-size 2 -b 64K -e 512K`.
 */
#define _GNU_SOURCE
#include "floor_common.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define OPS 2000L

static size_t bytes;
static char *shared, *input, *output;
static _Atomic long copied_in, copied_out;
static double in_ns, out_ns;

static void *consumer(void *arg) {
    (void)arg;
    pin(1);
    for (long k = 1; k <= OPS; k++) {
        while (atomic_load(&copied_in) < k)
            __builtin_ia32_pause();
        double t = now_ns();
        memcpy(output, shared, bytes);
        out_ns += now_ns() - t;
        atomic_store(&copied_out, k);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 2 || atol(argv[1]) <= 0) {
        fprintf(stderr, "usage: %s KIB\n", argv[0]);
        return 2;
    }
    bytes = (size_t)atol(argv[1]) * 1024;
    shared = aligned_alloc(4096, bytes);
    input = aligned_alloc(4096, bytes);
    output = aligned_alloc(4096, bytes);
    memset(shared, 1, bytes);
    memset(output, 3, bytes);
    pthread_t t;
    pthread_create(&t, NULL, consumer, NULL);
    pin(0);
    double t0 = now_ns();
    for (long k = 1; k <= OPS; k++) {
        memset(input, (int)k, bytes); /* a fresh block every op, as training writes it */
        while (atomic_load(&copied_out) < k - 1)
            __builtin_ia32_pause();
        double t = now_ns();
        memcpy(shared, input, bytes);
        in_ns += now_ns() - t;
        atomic_store(&copied_in, k);
    }
    pthread_join(t, NULL);
    double per_op = (now_ns() - t0) / OPS;
    printf("%6zu KiB: copy in %6.2f us (%5.1f GB/s), copy out %6.2f us (%5.1f GB/s), op %6.2f us (incl. the refill)\n",
           bytes / 1024, in_ns / OPS / 1e3, bytes / (in_ns / OPS), out_ns / OPS / 1e3, bytes / (out_ns / OPS),
           per_op / 1e3);
    return 0;
}

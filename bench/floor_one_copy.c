/*
 * The ceiling of a large 2-rank data-moving op on this host: two threads pinned to cores 0
 * and 1, no software and no protocol. Each op both threads copy the other's block into their
 * own output at the same time (memcpy), between two barriers: one copy of every byte that must
 * move, the least any implementation (single copy by cross-memory attach included) can do.
 * For an in-place all_gather of S bytes on 2 ranks each rank moves S/2 bytes, so its busbw
 * (`oxcomm bench`, nccl-tests: algbw * (n-1)/n) can at most equal the copy rate printed here;
 * the out-of-place form also copies the rank's own block, as does gather's root.
 *
 * Two input modes: "unchanged" (the blocks are written once, as `oxcomm bench` and
 * bench/mpi_collectives.c resend unchanged buffers) and "fresh" (each thread rewrites its
 * block before every op, untimed, as `--fresh-inputs` / `-F`).
 *
 *   gcc -O2 -o /tmp/floor1 bench/floor_one_copy.c -lpthread && /tmp/floor1 16 64 256
 *
 * Arguments: op sizes S in MiB (each thread copies S/2). A benchmark, not a test. Compare with
 * `FRESH=1 MIN=16M bash bench/vs_openmpi.sh` (all_gather, in-place column).
 */
#define _GNU_SOURCE
#include "floor_common.h"
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define OPS 20
#define WARMUP 3

static size_t half;
static char *block[2], *output[2];
static int fresh;
static pthread_barrier_t bar;
static double copy_ns[2];

static void *rank(void *arg) {
    int me = (int)(long)arg;
    pin(me);
    double sum = 0;
    for (int k = 0; k < WARMUP + OPS; k++) {
        if (fresh || k == 0) memset(block[me], k & 0x7f, half);
        pthread_barrier_wait(&bar);
        double t = now_ns();
        memcpy(output[me], block[1 - me], half);
        double dt = now_ns() - t;
        pthread_barrier_wait(&bar);
        if (k >= WARMUP) sum += dt;
    }
    copy_ns[me] = sum / OPS;
    return NULL;
}

int main(int argc, char **argv) {
    pthread_barrier_init(&bar, NULL, 2);
    for (int a = 1; a < argc; a++) {
        size_t mib = strtoul(argv[a], NULL, 10);
        half = mib << 19;
        for (int r = 0; r < 2; r++) {
            block[r] = aligned_alloc(4096, half);
            output[r] = aligned_alloc(4096, half);
            memset(output[r], 1, half);
        }
        for (fresh = 0; fresh < 2; fresh++) {
            pthread_t t;
            pthread_create(&t, NULL, rank, (void *)1L);
            rank((void *)0L);
            pthread_join(t, NULL);
            double ns = copy_ns[0] > copy_ns[1] ? copy_ns[0] : copy_ns[1];
            printf("%4zu MiB op, %9s inputs: %8.1f us per copy of %zu MiB, %5.2f GB/s (slower thread)\n", mib,
                   fresh ? "fresh" : "unchanged", ns / 1e3, mib / 2, half / ns);
        }
        for (int r = 0; r < 2; r++) {
            free(block[r]);
            free(output[r]);
        }
    }
    return 0;
}

/*
 * The floor of a mid-sized direct broadcast (or a gather's/scatter's one lane) when the reader
 * follows the writer part by part, as oxcomm's chunk protocol does since the fresh-inputs work
 * (crates/oxcomm/src/algorithms/shm_direct/mod.rs, "Parts"): two threads pinned to cores 0
 * and 1, no software around them. Each op the producer rewrites its input (untimed), waits
 * until the consumer is done with the last op, then copies the block into a shared buffer
 * PART bytes at a time, publishing a counter after each part; the consumer copies each part
 * out as soon as it is published. The time of an op runs from the producer's first store to
 * the consumer's last (one clock, both cores). With PART = the block this is
 * bench/floor_two_copy.c's scheme (two copies in a row).
 *
 *   gcc -O2 -o /tmp/floorp bench/floor_parts.c -lpthread
 *   for k in 64 128 256 512; do for p in $k 64 32 16 8; do /tmp/floorp $k $p; done; done
 *
 * Arguments: block and part size in KiB, and "nt" to copy in with non-temporal stores. A benchmark, not a test. Compare with
 * `oxcomm bench --op broadcast --world-size 2 -b 64K -e 512K --fresh-inputs` (in-place p50).
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
#include <immintrin.h>

/* memcpy with non-temporal stores (len a multiple of 32, both 32-aligned), then a store fence:
 * the lines leave for memory without first being taken back from the consumer's cache. */
__attribute__((target("avx2"))) static void copy_nt(char *dst, const char *src, size_t len) {
    for (size_t i = 0; i < len; i += 32)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_load_si256((const __m256i *)(src + i)));
    _mm_sfence();
}

#define OPS 2000L

static size_t bytes, part, parts;
static int streaming; /* copy in with non-temporal stores (third argument "nt") */
static char *shared, *input, *output;
static _Atomic long parts_in, copied_out;
static _Atomic double started;
static double took[OPS + 1];

static void *consumer(void *arg) {
    (void)arg;
    pin(1);
    for (long k = 1; k <= OPS; k++) {
        for (size_t j = 0; j < parts; j++) {
            while (atomic_load(&parts_in) < (k - 1) * (long)parts + (long)j + 1)
                __builtin_ia32_pause();
            size_t at = j * part, len = at + part > bytes ? bytes - at : part;
            memcpy(output + at, shared + at, len);
        }
        took[k] = now_ns() - atomic_load(&started);
        atomic_store(&copied_out, k);
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 4 || atol(argv[1]) <= 0 || atol(argv[2]) <= 0) {
        fprintf(stderr, "usage: %s BLOCK_KIB PART_KIB [nt]\n", argv[0]);
        return 2;
    }
    bytes = (size_t)atol(argv[1]) * 1024;
    part = (size_t)atol(argv[2]) * 1024;
    if (part > bytes)
        part = bytes;
    parts = (bytes + part - 1) / part;
    streaming = argc == 4 && strcmp(argv[3], "nt") == 0;
    shared = aligned_alloc(4096, bytes);
    input = aligned_alloc(4096, bytes);
    output = aligned_alloc(4096, bytes);
    memset(shared, 1, bytes);
    memset(output, 3, bytes);
    pthread_t t;
    pthread_create(&t, NULL, consumer, NULL);
    pin(0);
    for (long k = 1; k <= OPS; k++) {
        memset(input, (int)k, bytes); /* a fresh block every op, as training writes it */
        while (atomic_load(&copied_out) < k - 1)
            __builtin_ia32_pause();
        atomic_store(&started, now_ns());
        for (size_t j = 0; j < parts; j++) {
            size_t at = j * part, len = at + part > bytes ? bytes - at : part;
            if (streaming)
                copy_nt(shared + at, input + at, len);
            else
                memcpy(shared + at, input + at, len);
            atomic_store(&parts_in, (k - 1) * (long)parts + (long)j + 1);
        }
    }
    pthread_join(t, NULL);
    qsort(took + 1, OPS, sizeof took[0], by_value);
    printf("%6zu KiB in parts of %4zu KiB%s: op p50 %7.2f us, p10 %7.2f us\n", bytes / 1024, part / 1024,
           streaming ? ", copied in by non-temporal stores" : "", took[OPS / 2] / 1e3, took[OPS / 10] / 1e3);
    return 0;
}

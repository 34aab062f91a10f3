/*
 * The cross-process floor of a large 2-rank data-moving op on this host. bench/floor_one_copy.c
 * is two threads of ONE process copying each other's block with memcpy; ranks are processes
 * with private buffers, and between those a byte moves one of two ways:
 *
 *   cma     cross-memory attach: each process reads the peer's block straight into its own
 *           output with process_vm_readv (one copy, in the kernel, which pins the peer's pages
 *           for it), in one call or in pieces of PIECE bytes (one call per piece);
 *   shm     two copies through shared memory, the scheme of oxcomm's chunked path
 *           (shm_direct/all_gather.rs) without its software: per 512 KiB chunk each process
 *           copies its piece into one of its two chunk halves in 16 KiB parts, publishing a
 *           counter after each, then copies the peer's parts out as the peer publishes them,
 *           with oxcomm's copy loop (32-byte vector moves; "stream out": non-temporal stores
 *           into the output, as oxcomm's copy-out from 16 MiB of output).
 *
 * Both processes (fork) are pinned to cores 0 and 1. Each op: each rewrites its block
 * (memset, untimed: "fresh inputs", as `--fresh-inputs` / `mpi_collectives -F`), a barrier in
 * shared memory, the timed move, a barrier. Time = mean of OPS ops after WARMUP, slower
 * process, as floor_one_copy.c. An op of S bytes moves S/2 per process, so the GB/s printed is
 * the most an in-place 2-rank all_gather of S bytes could show as busbw; out of place each rank
 * also copies its own block ("+own": a memcpy of the own block before the move).
 *
 *   gcc -O2 -o /tmp/floorcma bench/floor_cma.c && /tmp/floorcma 16 32 64
 *
 * Arguments: op sizes S in MiB. Environment: MODES ("cma shm" by default) picks the schemes; THP=1 madvises the outputs and the shared buffer
 * for transparent huge pages (this VM's default is "madvise", which Rust's allocator never
 * asks for), THP=0 (default) leaves them alone. A benchmark, not a test. Compare with
 * bench/floor_one_copy.c and `FRESH=1 MIN=16M bash bench/vs_openmpi.sh` (all_gather in place).
 */
#define _GNU_SOURCE
#include "floor_common.h"
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define OPS 20
#define WARMUP 3

/* What the two processes share (mapped before fork). */
struct control {
    _Alignas(64) _Atomic long arrived; /* barrier: arrivals so far */
    uint64_t block[2];    /* each process's block address (in its own address space) */
    pid_t pid[2];
    /* shm mode, each process's counters on a line of their own: parts it has copied into
     * its halves, and chunks it has copied out of the peer's */
    struct {
        _Alignas(64) _Atomic long parts_in;
        _Atomic long copied_out;
    } rank[2];
    double ns[2];              /* mean time per op, per process */
    double in_ns[2];           /* shm mode: of which copying in */
    _Alignas(64) _Atomic long ball; /* round_trip() */
};

static struct control *ctl;
#define CHUNK (512 << 10) /* oxcomm's CHUNK_BYTES */
#define PART (16 << 10)   /* oxcomm's PART_BYTES */

static char *shared; /* shm mode: each process's two chunk halves */
static size_t half;
static int thp;

static void barrier(long *gen) {
    long want = (*gen += 2);
    atomic_fetch_add(&ctl->arrived, 1);
    while (atomic_load(&ctl->arrived) < want)
        __builtin_ia32_pause();
}

static char *alloc(size_t bytes) {
    char *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    if (thp) madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

static void cma_read(int peer, char *dst, size_t piece) {
    for (size_t at = 0; at < half; at += piece) {
        size_t len = half - at < piece ? half - at : piece;
        size_t done = 0;
        while (done < len) {
            struct iovec local = {dst + at + done, len - done};
            struct iovec remote = {(void *)(uintptr_t)(ctl->block[peer] + at + done), len - done};
            ssize_t got = process_vm_readv(ctl->pid[peer], &local, 1, &remote, 1, 0);
            if (got <= 0) {
                perror("process_vm_readv");
                exit(1);
            }
            done += (size_t)got;
        }
    }
}

/* Copies as oxcomm's crate::copy does: 32-byte vector loads and stores (glibc's memcpy uses
 * `rep movsb` from a few KiB, which this VM runs slowly on lines another core just wrote),
 * with non-temporal stores when `stream` (then a store fence). */
__attribute__((target("avx2"))) static void copy32(char *dst, const char *src, size_t n, int stream) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(src + i));
        if (stream)
            _mm256_stream_si256((__m256i *)(dst + i), v);
        else
            _mm256_storeu_si256((__m256i *)(dst + i), v);
    }
    memcpy(dst + i, src + i, n - i);
    if (stream) _mm_sfence();
}

/* shm mode, oxcomm's chunked path without its software: per chunk of CHUNK bytes, wait until
 * the peer has copied out chunk g-2 of my half, copy my chunk in PART bytes at a time
 * (publishing each part), then copy the peer's parts out as it publishes them, then publish
 * that. `how`: STREAM_OUT, non-temporal stores into the output (oxcomm's copy-out from 16 MiB
 * of output); STREAM_IN, non-temporal stores into the half (oxcomm's copy-in of small steps).
 * `k` numbers the op; the time spent copying in is added to `in_ns`. */
#define STREAM_OUT 1
#define STREAM_IN 2
static void two_copy(int me, const char *block, char *dst, int how, long k, double *in_ns) {
    long chunks = (long)((half + CHUNK - 1) / CHUNK), parts = CHUNK / PART;
    for (long c = 0; c < chunks; c++) {
        long g = k * chunks + c; /* chunk number over all ops */
        size_t at = (size_t)c * CHUNK, len = half - at < CHUNK ? half - at : CHUNK;
        char *mine = shared + ((size_t)me * 2 + (size_t)(g & 1)) * CHUNK;
        const char *theirs = shared + ((size_t)(1 - me) * 2 + (size_t)(g & 1)) * CHUNK;
        while (atomic_load_explicit(&ctl->rank[1 - me].copied_out, memory_order_acquire) < g - 1)
            __builtin_ia32_pause();
        double t = now_ns();
        for (long j = 0; (size_t)j * PART < len; j++) {
            size_t off = (size_t)j * PART, n = len - off < PART ? len - off : PART;
            copy32(mine + off, block + at + off, n, how & STREAM_IN);
            atomic_store_explicit(&ctl->rank[me].parts_in, g * parts + j + 1, memory_order_release);
        }
        *in_ns += now_ns() - t;
        for (long j = 0; (size_t)j * PART < len; j++) {
            size_t off = (size_t)j * PART, n = len - off < PART ? len - off : PART;
            while (atomic_load_explicit(&ctl->rank[1 - me].parts_in, memory_order_acquire) < g * parts + j + 1)
                __builtin_ia32_pause();
            copy32(dst + at + off, theirs + off, n, how & STREAM_OUT);
        }
        atomic_store_explicit(&ctl->rank[me].copied_out, g + 1, memory_order_release);
    }
}

/* The round trip of one cache line between the two processes (ns): how far apart the host
 * placed the two vCPUs right now (this VM showed ~80-140 ns, and at times 250-540 ns, when
 * every cross-core copy ran several times slower). */
static double round_trip(int me, long *gen) {
    enum { N = 20000 };
    pin(me);
    barrier(gen);
    double t = now_ns();
    for (long i = 1; i <= N; i++) {
        if (me == 0) {
            atomic_store(&ctl->ball, 2 * i - 1);
            while (atomic_load(&ctl->ball) != 2 * i)
                __builtin_ia32_pause();
        } else {
            while (atomic_load(&ctl->ball) != 2 * i - 1)
                __builtin_ia32_pause();
            atomic_store(&ctl->ball, 2 * i);
        }
    }
    return (now_ns() - t) / N;
}

/* One process's side of a run: mode 0 cma (`piece`: bytes per call), 1 shm (`piece`: the
 * `how` of two_copy); own: copy the own block too (out of place). */
static void run(int me, int mode, size_t piece, int fresh, int own, long *gen) {
    pin(me);
    char *block = alloc(half), *out = alloc(half), *own_out = own ? alloc(half) : NULL;
    memset(block, 0x11 + me, half);
    memset(out, 1, half);
    if (own) memset(own_out, 1, half);
    ctl->block[me] = (uint64_t)(uintptr_t)block;
    ctl->pid[me] = getpid();
    barrier(gen);
    double sum = 0, in_ns = 0;
    for (long k = 0; k < WARMUP + OPS; k++) {
        if (fresh) memset(block, (int)(k & 0x7f), half);
        barrier(gen);
        double t = now_ns();
        if (own) memcpy(own_out, block, half);
        if (mode == 0)
            cma_read(1 - me, out, piece);
        else
            two_copy(me, block, out, (int)piece, k, &in_ns);
        double dt = now_ns() - t;
        barrier(gen);
        if (k >= WARMUP) sum += dt;
        if (k == WARMUP - 1) in_ns = 0;
    }
    if (out[half - 1] != (fresh ? (char)((WARMUP + OPS - 1) & 0x7f) : (char)(0x11 + 1 - me))) {
        fprintf(stderr, "wrong data\n");
        exit(1);
    }
    ctl->ns[me] = sum / OPS;
    ctl->in_ns[me] = in_ns / OPS;
    munmap(block, half);
    munmap(out, half);
    if (own) munmap(own_out, half);
}

static void measure(size_t mib, int mode, size_t piece, int fresh, int own) {
    atomic_store(&ctl->arrived, 0);
    for (int r = 0; r < 2; r++) ctl->rank[r].parts_in = ctl->rank[r].copied_out = 0;
    /* barrier() counts both processes' arrivals: the g-th barrier ends at 2g. */
    long gen = 0;
    pid_t child = fork();
    if (child == 0) {
        long g = 0;
        run(1, mode, piece, fresh, own, &g);
        _exit(0);
    }
    run(0, mode, piece, fresh, own, &gen);
    waitpid(child, NULL, 0);
    double ns = ctl->ns[0] > ctl->ns[1] ? ctl->ns[0] : ctl->ns[1];
    char how[32];
    if (mode == 1)
        snprintf(how, sizeof how, "%s in, %s out", piece & STREAM_IN ? "stream" : "plain",
                 piece & STREAM_OUT ? "stream" : "plain");
    else if (piece >= half)
        snprintf(how, sizeof how, "whole");
    else
        snprintf(how, sizeof how, "%zu KiB pieces", piece >> 10);
    printf("%4zu MiB op, %3s %-26s %9s inputs%s: %8.1f us per op (%zu MiB each way), %5.2f GB/s (slower process)",
           mib, mode ? "shm" : "cma", how, fresh ? "fresh" : "unchanged", own ? " +own" : "", ns / 1e3, mib / 2,
           half / ns);
    if (mode == 1) printf("; copy-in %.1f / %.1f us", ctl->in_ns[0] / 1e3, ctl->in_ns[1] / 1e3);
    printf("\n");
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *t = getenv("THP");
    thp = t && t[0] == '1';
    const char *m = getenv("MODES");
    int cma = !m || strstr(m, "cma"), shm = !m || strstr(m, "shm");
    ctl = mmap(NULL, sizeof *ctl, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    shared = mmap(NULL, 4 * CHUNK, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(shared, 1, 4 * CHUNK);
    printf("# floor_cma: 2 processes pinned to cores 0/1, mean of %d ops after %d, THP %s\n", OPS, WARMUP,
           thp ? "madvised" : "not asked for");
    atomic_store(&ctl->arrived, 0);
    long gen = 0;
    if (fork() == 0) {
        long g = 0;
        round_trip(1, &g);
        _exit(0);
    }
    double rt = round_trip(0, &gen);
    wait(NULL);
    printf("# cache-line round trip between the two processes: %.0f ns\n", rt);
    for (int a = 1; a < argc; a++) {
        size_t mib = strtoul(argv[a], NULL, 10);
        half = mib << 19;
        size_t pieces[] = {half, 4 << 20, 1 << 20, 256 << 10};
        if (cma) {
            measure(mib, 0, half, 0, 0);
            for (int p = 0; p < 4; p++)
                if (p == 0 || pieces[p] < half) measure(mib, 0, pieces[p], 1, 0);
            measure(mib, 0, half, 1, 1);
        }
        if (shm)
            for (int how = 0; how < 4; how++) measure(mib, 1, (size_t)how, 1, 0);
    }
    return 0;
}

/* MPI_Allreduce (f32, sum) timed the way `oxcomm bench` times all_reduce, with the same
 * table, so bench/vs_openmpi.sh can put the two side by side.
 *
 *   mpirun -np 4 ./mpi_allreduce [-b 8] [-e 64M] [-f 2] [-n 20] [-w 5]
 *
 * Per size and mode (out-of-place: separate send/receive buffers; in-place: MPI_IN_PLACE):
 * a barrier, -w warm-up calls, a barrier, then -n calls back to back timed with MPI_Wtime as a
 * whole (mean) and one by one (median). Each rank measures its own mean and median; the table
 * shows the maximum over ranks of each, as oxcomm bench does. Then one checked call: inputs are
 * small integers whose float sum is exact, and #wrong counts the elements that differ, summed
 * over ranks. size = count * 4 bytes; algbw = size / time (1e9 B/s = GB/s);
 * busbw = algbw * 2(n-1)/n (nccl-tests). Buffers are allocated and touched once, at the
 * largest size.
 *
 * Columns: size count type redop root | time algbw busbw #wrong (out-of-place) |
 * time algbw busbw #wrong (in-place) | oop_p50 ip_p50. Lines starting with '#' are headers.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int parse_size(const char *s, size_t *out) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return -1;
    int shift = 0;
    if (*end) {
        switch (*end) {
            case 'k': case 'K': shift = 10; break;
            case 'm': case 'M': shift = 20; break;
            case 'g': case 'G': shift = 30; break;
            default: return -1;
        }
        end++;
        if (*end && strcasecmp(end, "b") && strcasecmp(end, "ib")) return -1;
    }
    *out = (size_t)(v << shift);
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Rank r's input at index i: 0..3, so the sum over <= 2^22 ranks is exact in f32. */
static float input(int r, size_t i) {
    uint64_t x = (uint64_t)i * 0x9E3779B97F4A7C15ull ^ (uint64_t)(r + 1) * 0xC2B2AE3D27D4EB4Full;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (float)(x % 4);
}

static void fmt_us(char *buf, size_t len, double us) {
    if (us >= 10000.0) snprintf(buf, len, "%.0f", us);
    else if (us >= 100.0) snprintf(buf, len, "%.1f", us);
    else snprintf(buf, len, "%.2f", us);
}

/* One mode at one size: mean and median (max over ranks, us), and #wrong (sum over ranks). */
static void measure(float *send, float *recv, size_t count, int in_place, int warmup, int iters,
                    double *each, double *mean_us, double *median_us, long long *wrong, int rank,
                    int nranks) {
    const void *sbuf = in_place ? MPI_IN_PLACE : (const void *)send;
    float *rbuf = in_place ? send : recv;
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < warmup; i++) MPI_Allreduce(sbuf, rbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; i++) {
        double t = MPI_Wtime();
        MPI_Allreduce(sbuf, rbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        each[i] = MPI_Wtime() - t;
    }
    double total = MPI_Wtime() - start;
    qsort(each, (size_t)iters, sizeof(double), cmp_double);
    double med = iters % 2 ? each[iters / 2] : (each[iters / 2 - 1] + each[iters / 2]) / 2;
    double local[2] = {total / iters * 1e6, med * 1e6}, global[2];
    MPI_Allreduce(local, global, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *mean_us = global[0];
    *median_us = global[1];

    /* Check: exact inputs, a sentinel in the output, one call, compare. */
    for (size_t i = 0; i < count; i++) send[i] = input(rank, i);
    if (!in_place)
        for (size_t i = 0; i < count; i++) recv[i] = 113.0f;
    MPI_Allreduce(sbuf, rbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long long bad = 0;
    for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int r = 0; r < nranks; r++) want += input(r, i);
        if (rbuf[i] != want) bad++;
    }
    MPI_Allreduce(&bad, wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t minb = 8, maxb = 64u << 20;
    long factor = 2, iters = 20, warmup = 5;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = v != NULL;
        if (ok && !strcmp(argv[i], "-b")) ok = parse_size(v, &minb) == 0;
        else if (ok && !strcmp(argv[i], "-e")) ok = parse_size(v, &maxb) == 0;
        else if (ok && !strcmp(argv[i], "-f")) factor = atol(v);
        else if (ok && !strcmp(argv[i], "-n")) iters = atol(v);
        else if (ok && !strcmp(argv[i], "-w")) warmup = atol(v);
        else ok = 0;
        if (!ok || factor < 2 || iters < 1 || warmup < 0 || minb < 1 || minb > maxb) {
            if (rank == 0) fprintf(stderr, "mpi_allreduce: bad arguments near %s\n", argv[i]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        i++;
    }
    size_t maxcount = maxb / sizeof(float);
    if (maxcount > 0x7fffffff) {
        if (rank == 0) fprintf(stderr, "mpi_allreduce: -e too large for an int count\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    float *send = malloc(maxcount * sizeof(float) + 64), *recv = malloc(maxcount * sizeof(float) + 64);
    double *each = malloc((size_t)iters * sizeof(double));
    if (!send || !recv || !each) {
        fprintf(stderr, "mpi_allreduce: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < maxcount; i++) send[i] = recv[i] = 1.0f; /* first touch, untimed */

    if (rank == 0) {
        printf("# mpi_allreduce  ranks: %d  transport: mpi  dtype: f32  minBytes: %zu  maxBytes: %zu  step: %ld(factor)  "
               "warmup iters: %ld  iters: %ld  validation: 1\n", n, minb, maxb, factor, warmup, iters);
        printf("# time: mean of %ld back-to-back ops, max over ranks; p50: median of the per-op times, max over ranks\n#\n", iters);
        printf("# Collective: all_reduce  (MPI_Allreduce; in-place = MPI_IN_PLACE)\n");
        printf("#%11s  %12s  %8s  %6s  %6s  %9s  %6s  %6s  %6s  %9s  %6s  %6s  %6s  %9s %9s\n", "size", "count",
               "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong",
               "oop_p50", "ip_p50");
        printf("#%11s  %12s  %8s  %6s  %6s  %9s  %6s  %6s  %6s  %9s  %6s  %6s  %6s  %9s %9s\n", "(B)",
               "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)",
               "(us)");
        fflush(stdout);
    }
    double factor_bus = 2.0 * (n - 1) / n, bw_sum = 0;
    long long wrong_total = 0;
    int lines = 0;
    for (size_t size = minb; size <= maxb; size *= (size_t)factor) {
        size_t count = size / sizeof(float);
        double t[2], med[2];
        long long wrong[2];
        for (int mode = 0; mode < 2; mode++)
            measure(send, recv, count, mode, (int)warmup, (int)iters, each, &t[mode], &med[mode], &wrong[mode], rank, n);
        if (rank == 0) {
            char ts[2][32], ms[2][32];
            double alg[2];
            for (int m = 0; m < 2; m++) {
                fmt_us(ts[m], sizeof ts[m], t[m]);
                fmt_us(ms[m], sizeof ms[m], med[m]);
                alg[m] = t[m] > 0 ? (double)(count * sizeof(float)) / t[m] / 1e3 : 0;
                bw_sum += alg[m] * factor_bus;
                wrong_total += wrong[m];
            }
            lines += 2;
            printf("%12zu  %12zu  %8s  %6s  %6d  %9s  %6.2f  %6.2f  %6lld  %9s  %6.2f  %6.2f  %6lld  %9s %9s\n",
                   count * sizeof(float), count, "f32", "sum", -1, ts[0], alg[0], alg[0] * factor_bus, wrong[0],
                   ts[1], alg[1], alg[1] * factor_bus, wrong[1], ms[0], ms[1]);
            fflush(stdout);
        }
        if (size > maxb / (size_t)factor) break;
    }
    if (rank == 0) {
        printf("# Out of bounds values : %lld %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
        printf("# Avg bus bandwidth : %.6f\n#\n", lines ? bw_sum / lines : 0.0);
    }
    free(send);
    free(recv);
    free(each);
    MPI_Finalize();
    return wrong_total ? 1 : 0;
}

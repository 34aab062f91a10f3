/* Open MPI's collectives (f32) timed the way `oxcomm bench` times oxcomm's, with the same
 * table, so bench/vs_openmpi.sh can put the two side by side.
 *
 *   mpirun -np 4 ./mpi_collectives [-o all_reduce] [-b 8] [-e 64M] [-f 2] [-n 20] [-w 5] [-F]
 *
 * -o is one of all_reduce (MPI_Allreduce, sum), all_gather (MPI_Allgather), reduce_scatter
 * (MPI_Reduce_scatter_block, sum), broadcast (MPI_Bcast), reduce (MPI_Reduce, sum), all_to_all
 * (MPI_Alltoall), gather (MPI_Gather), scatter (MPI_Scatter); the root is rank 0.
 *
 * Sizes follow oxcomm bench (nccl-tests): size is the full buffer in bytes: the tensor for
 * all_reduce, broadcast and reduce; the gathered output for all_gather and gather; the full
 * input for reduce_scatter and scatter; the whole send buffer for all_to_all. Per-rank blocks
 * are size / n, rounded down to whole elements. algbw = size / time (1e9 B/s = GB/s); busbw =
 * algbw * 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter, all_to_all, gather
 * and scatter, 1 for broadcast and reduce (oxcomm's `bus_factor`).
 *
 * Per size and mode: a barrier, -w warm-up calls, a barrier, then -n calls back to back timed
 * with MPI_Wtime as a whole (mean) and one by one (median); the table shows the maximum over
 * ranks of each. With -F (fresh inputs, as `oxcomm bench --fresh-inputs`), every call is
 * preceded, untimed, by a rewrite of what the rank contributes and a barrier, and the mean is
 * the sum of the per-call times / -n. Then one checked call with exact inputs; #wrong counts
 * the elements that differ, summed over ranks. In-place mode is MPI_IN_PLACE where MPI defines it (all_reduce,
 * all_gather, reduce_scatter, all_to_all, and at the root of reduce, gather, scatter; for
 * reduce_scatter MPI puts the result at the start of the buffer); broadcast has no
 * out-of-place form in MPI, so out-of-place is a copy at the root and then MPI_Bcast, as
 * oxcomm bench emulates it. Buffers are allocated and touched once, at the largest size.
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

enum op { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, ALL_TO_ALL, GATHER, SCATTER };
static const char *OP_NAMES[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                 "reduce", "all_to_all", "gather", "scatter"};
static const char *MPI_NAMES[] = {"MPI_Allreduce", "MPI_Allgather", "MPI_Reduce_scatter_block", "MPI_Bcast",
                                  "MPI_Reduce", "MPI_Alltoall", "MPI_Gather", "MPI_Scatter"};

/* One line's buffers: `total` elements of the full buffer (see the header), `block` per rank. */
struct line {
    enum op op;
    size_t total, block;
    int in_place, rank, n;
    float *send, *recv;
};

static int is_reducing(enum op op) { return op == ALL_REDUCE || op == REDUCE_SCATTER || op == REDUCE; }

static double bus_factor(enum op op, int n) {
    if (op == ALL_REDUCE) return 2.0 * (n - 1) / n;
    if (op == BROADCAST || op == REDUCE) return 1.0;
    return (double)(n - 1) / n;
}

/* The full-buffer element count of a line of `size` bytes (whole blocks where the op splits). */
static size_t total_of(enum op op, size_t size, int n) {
    size_t count = size / sizeof(float);
    if (op == ALL_REDUCE || op == BROADCAST || op == REDUCE) return count;
    return count / (size_t)n * (size_t)n;
}

/* Runs the op once (in place or not). */
static void run(const struct line *l) {
    const int root = 0, c = (int)l->total, b = (int)l->block;
    const int at_root = l->rank == root, ip = l->in_place;
    float *s = l->send, *r = l->recv;
    switch (l->op) {
        case ALL_REDUCE:
            MPI_Allreduce(ip ? MPI_IN_PLACE : s, ip ? s : r, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            break;
        case ALL_GATHER:
            MPI_Allgather(ip ? MPI_IN_PLACE : s, b, MPI_FLOAT, r, b, MPI_FLOAT, MPI_COMM_WORLD);
            break;
        case REDUCE_SCATTER:
            MPI_Reduce_scatter_block(ip ? MPI_IN_PLACE : s, ip ? s : r, b, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            break;
        case BROADCAST:
            if (!ip && at_root) memcpy(r, s, l->total * sizeof(float));
            MPI_Bcast(ip ? s : r, c, MPI_FLOAT, root, MPI_COMM_WORLD);
            break;
        case REDUCE:
            MPI_Reduce(ip && at_root ? MPI_IN_PLACE : s, ip ? s : r, c, MPI_FLOAT, MPI_SUM, root, MPI_COMM_WORLD);
            break;
        case ALL_TO_ALL:
            MPI_Alltoall(ip ? MPI_IN_PLACE : s, b, MPI_FLOAT, ip ? s : r, b, MPI_FLOAT, MPI_COMM_WORLD);
            break;
        case GATHER:
            MPI_Gather(ip && at_root ? MPI_IN_PLACE : s, b, MPI_FLOAT, r, b, MPI_FLOAT, root, MPI_COMM_WORLD);
            break;
        case SCATTER:
            MPI_Scatter(s, b, MPI_FLOAT, ip && at_root ? MPI_IN_PLACE : r, b, MPI_FLOAT, root, MPI_COMM_WORLD);
            break;
    }
}

/* -F (fresh inputs): rewrites what this rank contributes to the op with a value that changes
 * with `iter`, then waits at a barrier (oxcomm bench --fresh-inputs does the same). */
static void rewrite_inputs(const struct line *l, int iter) {
    const size_t b = l->block, t = l->total;
    const int me = l->rank, ip = l->in_place, at_root = me == 0;
    float *dst = l->send;
    size_t len = t;
    switch (l->op) {
        case BROADCAST: case SCATTER:
            if (!at_root) len = 0;
            break;
        case ALL_GATHER: case GATHER:
            len = b;
            if (ip && (l->op == ALL_GATHER || at_root)) dst = l->recv + (size_t)me * b;
            break;
        default:
            break;
    }
    const float v = (float)(iter % 3);
    for (size_t i = 0; i < len; i++) dst[i] = v;
    MPI_Barrier(MPI_COMM_WORLD);
}

/* Fills the buffers for the checked call: every value the op reads is input(rank of origin,
 * index in the origin's buffer) (all_to_all: input(origin * n + destination, i)); 113 marks
 * what the op should overwrite. Returns the elements that differ from the expected result. */
static long long checked_call(const struct line *l) {
    const size_t b = l->block, t = l->total;
    const int me = l->rank, n = l->n, ip = l->in_place;
    float *s = l->send, *r = l->recv;
    for (size_t i = 0; i < t; i++) s[i] = r[i] = 113.0f;
    switch (l->op) {
        case ALL_REDUCE: case REDUCE: case REDUCE_SCATTER:
            for (size_t i = 0; i < t; i++) s[i] = input(me, i);
            break;
        case BROADCAST:
            if (me == 0)
                for (size_t i = 0; i < t; i++) s[i] = input(0, i);
            break;
        case ALL_GATHER: case GATHER: {
            /* In place the block is already in the output (gather: at the root only). */
            int in_output = ip && (l->op == ALL_GATHER || me == 0);
            for (size_t i = 0; i < b; i++) (in_output ? r + (size_t)me * b : s)[i] = input(me, i);
            break;
        }
        case ALL_TO_ALL:
            for (int p = 0; p < n; p++)
                for (size_t i = 0; i < b; i++) s[(size_t)p * b + i] = input(me * n + p, i);
            break;
        case SCATTER:
            if (me == 0)
                for (int p = 0; p < n; p++)
                    for (size_t i = 0; i < b; i++) s[(size_t)p * b + i] = input(p, i);
            break;
    }
    run(l);
    long long bad = 0;
    /* Where the result lands in each mode. */
    const float *out = ip && (l->op == ALL_REDUCE || l->op == REDUCE || l->op == REDUCE_SCATTER ||
                              l->op == BROADCAST || l->op == ALL_TO_ALL) ? s : r;
    switch (l->op) {
        case ALL_REDUCE: case REDUCE:
            if (l->op == REDUCE && me != 0) break;
            for (size_t i = 0; i < t; i++) {
                float want = 0;
                for (int q = 0; q < n; q++) want += input(q, i);
                bad += out[i] != want;
            }
            break;
        case REDUCE_SCATTER:
            for (size_t i = 0; i < b; i++) {
                float want = 0;
                for (int q = 0; q < n; q++) want += input(q, (size_t)me * b + i);
                bad += out[i] != want;
            }
            break;
        case BROADCAST:
            for (size_t i = 0; i < t; i++) bad += out[i] != input(0, i);
            break;
        case ALL_GATHER: case GATHER:
            if (l->op == GATHER && me != 0) break;
            for (int p = 0; p < n; p++)
                for (size_t i = 0; i < b; i++) bad += out[(size_t)p * b + i] != input(p, i);
            break;
        case ALL_TO_ALL:
            for (int p = 0; p < n; p++)
                for (size_t i = 0; i < b; i++) bad += out[(size_t)p * b + i] != input(p * n + me, i);
            break;
        case SCATTER:
            /* In place the root's block stays where it is, in the send buffer. */
            for (size_t i = 0; i < b; i++)
                bad += (ip && me == 0 ? s[i] : out[i]) != input(me, i);
            break;
    }
    return bad;
}

/* One mode at one size: mean and median (max over ranks, us), and #wrong (sum over ranks). */
static void measure(const struct line *l, int warmup, int iters, int fresh, double *each,
                    double *mean_us, double *median_us, long long *wrong) {
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < warmup; i++) {
        if (fresh) rewrite_inputs(l, i);
        run(l);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime(), sum = 0;
    for (int i = 0; i < iters; i++) {
        if (fresh) rewrite_inputs(l, i);
        double t = MPI_Wtime();
        run(l);
        each[i] = MPI_Wtime() - t;
        sum += each[i];
    }
    /* Fresh inputs: the rewrites and barriers between the calls are not the op's time. */
    double total = fresh ? sum : MPI_Wtime() - start;
    qsort(each, (size_t)iters, sizeof(double), cmp_double);
    double med = iters % 2 ? each[iters / 2] : (each[iters / 2 - 1] + each[iters / 2]) / 2;
    double local[2] = {total / iters * 1e6, med * 1e6}, global[2];
    MPI_Allreduce(local, global, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *mean_us = global[0];
    *median_us = global[1];
    long long bad = checked_call(l);
    MPI_Allreduce(&bad, wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t minb = 8, maxb = 64u << 20;
    long factor = 2, iters = 20, warmup = 5;
    int op = ALL_REDUCE, fresh = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-F")) {
            fresh = 1;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = v != NULL;
        if (ok && !strcmp(argv[i], "-o")) {
            for (op = 0; op <= SCATTER && strcmp(v, OP_NAMES[op]); op++) {}
            ok = op <= SCATTER;
        } else if (ok && !strcmp(argv[i], "-b")) ok = parse_size(v, &minb) == 0;
        else if (ok && !strcmp(argv[i], "-e")) ok = parse_size(v, &maxb) == 0;
        else if (ok && !strcmp(argv[i], "-f")) factor = atol(v);
        else if (ok && !strcmp(argv[i], "-n")) iters = atol(v);
        else if (ok && !strcmp(argv[i], "-w")) warmup = atol(v);
        else ok = 0;
        if (!ok || factor < 2 || iters < 1 || warmup < 0 || minb < 1 || minb > maxb) {
            if (rank == 0) fprintf(stderr, "mpi_collectives: bad arguments near %s\n", argv[i]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        i++;
    }
    size_t maxcount = maxb / sizeof(float);
    if (maxcount > 0x7fffffff) {
        if (rank == 0) fprintf(stderr, "mpi_collectives: -e too large for an int count\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    float *send = malloc(maxcount * sizeof(float) + 64), *recv = malloc(maxcount * sizeof(float) + 64);
    double *each = malloc((size_t)iters * sizeof(double));
    if (!send || !recv || !each) {
        fprintf(stderr, "mpi_collectives: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < maxcount; i++) send[i] = recv[i] = 1.0f; /* first touch, untimed */

    if (rank == 0) {
        printf("# mpi_collectives  ranks: %d  transport: mpi  dtype: f32  minBytes: %zu  maxBytes: %zu  step: %ld(factor)  "
               "warmup iters: %ld  iters: %ld  validation: 1\n", n, minb, maxb, factor, warmup, iters);
        if (fresh)
            printf("# time: mean of %ld ops, each after rewriting the inputs and a barrier (untimed), max over ranks; p50: median of the per-op times, max over ranks\n#\n", iters);
        else
            printf("# time: mean of %ld back-to-back ops, max over ranks; p50: median of the per-op times, max over ranks\n#\n", iters);
        printf("# Collective: %s  (%s; in-place = MPI_IN_PLACE, see bench/mpi_collectives.c)\n", OP_NAMES[op], MPI_NAMES[op]);
        printf("#%11s  %12s  %8s  %6s  %6s  %9s  %6s  %6s  %6s  %9s  %6s  %6s  %6s  %9s %9s\n", "size", "count",
               "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong",
               "oop_p50", "ip_p50");
        printf("#%11s  %12s  %8s  %6s  %6s  %9s  %6s  %6s  %6s  %9s  %6s  %6s  %6s  %9s %9s\n", "(B)",
               "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)",
               "(us)");
        fflush(stdout);
    }
    double factor_bus = bus_factor((enum op)op, n), bw_sum = 0;
    long long wrong_total = 0;
    int lines = 0;
    for (size_t size = minb; size <= maxb; size *= (size_t)factor) {
        size_t count = total_of((enum op)op, size, n);
        double t[2], med[2];
        long long wrong[2];
        for (int mode = 0; mode < 2; mode++) {
            struct line l = {(enum op)op, count, count / (size_t)n, mode, rank, n, send, recv};
            if (op == ALL_REDUCE || op == BROADCAST || op == REDUCE) l.block = count;
            measure(&l, (int)warmup, (int)iters, fresh, each, &t[mode], &med[mode], &wrong[mode]);
        }
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
                   count * sizeof(float), count, "f32", is_reducing((enum op)op) ? "sum" : "none",
                   op == BROADCAST || op == REDUCE || op == GATHER || op == SCATTER ? 0 : -1, ts[0], alg[0],
                   alg[0] * factor_bus, wrong[0], ts[1], alg[1], alg[1] * factor_bus, wrong[1], ms[0], ms[1]);
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

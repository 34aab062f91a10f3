/*
 * The floor of oxcomm's small direct ops on this host, with no software around them: two
 * threads pinned to cores 0 and 1 run the bare shared-memory protocol of
 * crates/oxcomm/src/algorithms/shm_direct/mod.rs (16 slots of 128-byte lines, a stamp per
 * slot) and nothing else — no fingerprint, no turn, no flight record, no error paths.
 *
 *   ping-pong:   one line written on one core and read on the other, and back (half of it is
 *                the one-way latency);
 *   all_reduce:  each rank writes its slot for op k (stamp, 8-byte payload) and waits for the
 *                peer's stamp of op k, then reads its payload (the 8 B direct all_reduce);
 *   broadcast:   the root writes its slot for op k once the peer has stamped op k - 15 (so it
 *                runs up to 15 ops ahead); the non-root stamps op k and waits for the root's
 *                (the 8 B direct broadcast with loose arrivals). As in the code, a rank that
 *                waits for op k - 15 then reads ahead the stamps the peer already wrote, and
 *                waits again only once it is 15 ops past the last one it saw.
 *
 * Each of the two ops runs twice: back to back, then with every op between two clock reads, as
 * `oxcomm bench` and bench/mpi_collectives.c time each call for their medians (clock_gettime
 * costs tens of ns in a VM, so a per-call time includes a share of it). The second line is the
 * least any 8 B op can show in those tables on this host. The last two lines add the
 * doorbell's fence after every stamp (see `fenced`), which oxcomm keeps so that a rank can
 * sleep instead of polling: what the protocol costs with that check on.
 *
 *   gcc -O2 -o /tmp/floor bench/floor_small_ops.c -lpthread && /tmp/floor
 *
 * A benchmark, not a test: it measures what the protocol costs on this machine, so that
 * oxcomm's own figures (`oxcomm bench -b 8 -e 8`) split into protocol and software.
 */
#define _GNU_SOURCE
#include "floor_common.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#define OPS 2000000L
#define SLOTS 16
#define EAGER (SLOTS - 1)

struct slot {
    _Atomic long stamp;
    long check;
    long len;
    float payload[10];
} __attribute__((aligned(128)));

static struct slot slots[2][SLOTS];
static volatile float sink;
/* Whether every op is bracketed by two clock reads (see the header). */
static int time_each;

static void wait_stamp(struct slot *s, long stamp) {
    while (atomic_load_explicit(&s->stamp, memory_order_acquire) < stamp)
        __builtin_ia32_pause();
}

/* Whether every stamp is followed by the doorbell's check for a sleeping peer, as oxcomm's
 * write_slot does (transport/shm/futex.rs, ring_if_sleeping): a sequentially consistent fence,
 * then a load of the peer's count of sleepers. The fence waits until the stamp's line is this
 * core's, which the peer may hold since its last read: the one cost of the doorbell that a
 * protocol whose ranks never sleep (Open MPI's shared-memory path polls) does not pay. */
static int fenced;
static _Atomic int sleepers[2];

static void publish(struct slot *s, long stamp, float value) {
    s->check = 42;
    s->len = 8;
    s->payload[0] = value;
    atomic_store_explicit(&s->stamp, stamp, memory_order_release);
    if (fenced) {
        atomic_thread_fence(memory_order_seq_cst);
        int peer = s < &slots[1][0] ? 1 : 0;
        if (atomic_load_explicit(&sleepers[peer], memory_order_relaxed) > 0)
            sink = 0;
    }
}

/* One rank of the modelled op; returns ns per op. */
typedef double (*rank_fn)(int me);

static double ping_pong(int me) {
    double t0 = now_ns();
    for (long k = 1; k <= OPS; k++) {
        if (me == 0) {
            publish(&slots[0][0], k, 0);
            wait_stamp(&slots[1][0], k);
        } else {
            wait_stamp(&slots[0][0], k);
            publish(&slots[1][0], k, 0);
        }
    }
    return (now_ns() - t0) / OPS;
}

static double all_reduce(int me) {
    float acc = 0;
    double t0 = now_ns(), timed = 0;
    for (long k = 0; k < OPS; k++) {
        if (time_each) timed -= now_ns();
        struct slot *mine = &slots[me][k % SLOTS], *theirs = &slots[1 - me][k % SLOTS];
        publish(mine, k + 1, (float)(me + 1));
        wait_stamp(theirs, k + 1);
        acc += theirs->payload[0] + mine->payload[0];
        if (time_each) timed += now_ns();
    }
    sink = acc + (float)timed;
    return (now_ns() - t0) / OPS;
}

static double broadcast(int me) {
    float acc = 0;
    double t0 = now_ns(), timed = 0;
    /* Ops 0..checked had the peer's stamp seen (check_through / check_stamped in the code). */
    long checked = 0;
    for (long k = 0; k < OPS; k++) {
        if (time_each) timed -= now_ns();
        if (k >= EAGER && checked <= k - EAGER) {
            wait_stamp(&slots[1 - me][(k - EAGER) % SLOTS], k - EAGER + 1);
            checked = k - EAGER + 1;
            while (checked < k &&
                   atomic_load_explicit(&slots[1 - me][checked % SLOTS].stamp, memory_order_acquire) > checked)
                checked++;
        }
        publish(&slots[me][k % SLOTS], k + 1, (float)k);
        if (me == 1) {
            wait_stamp(&slots[0][k % SLOTS], k + 1);
            acc += slots[0][k % SLOTS].payload[0];
            /* Its wait covered the only peer: nothing is left to check late (as in the code). */
            checked = k + 1;
        }
        if (time_each) timed += now_ns();
    }
    sink = acc + (float)timed;
    return (now_ns() - t0) / OPS;
}

struct job {
    rank_fn fn;
    double ns;
};

static void *rank1(void *arg) {
    struct job *j = arg;
    pin(1);
    j->ns = j->fn(1);
    return NULL;
}

static void run(const char *name, rank_fn fn, double scale) {
    for (int round = 0; round < 3; round++) {
        for (int r = 0; r < 2; r++)
            for (int s = 0; s < SLOTS; s++)
                atomic_store(&slots[r][s].stamp, 0);
        struct job j = {fn, 0};
        pthread_t t;
        pthread_create(&t, NULL, rank1, &j);
        pin(0);
        double ns0 = fn(0);
        pthread_join(t, NULL);
        printf("%-26s %6.1f ns per op (rank 0), %6.1f (rank 1)\n", name, ns0 * scale, j.ns * scale);
    }
}

int main(void) {
    run("one-way", ping_pong, 0.5);
    run("all_reduce", all_reduce, 1.0);
    run("broadcast", broadcast, 1.0);
    time_each = 1;
    run("all_reduce, each op timed", all_reduce, 1.0);
    run("broadcast, each op timed", broadcast, 1.0);
    fenced = 1;
    run("all_reduce, timed, fenced", all_reduce, 1.0);
    run("broadcast, timed, fenced", broadcast, 1.0);
    return 0;
}

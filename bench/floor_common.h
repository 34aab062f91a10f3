/* What the bench/floor_*.c programs share: pinning the calling thread to a core, and a
 * monotonic clock in nanoseconds. */
#ifndef OXCOMM_FLOOR_COMMON_H
#define OXCOMM_FLOOR_COMMON_H

#define _GNU_SOURCE
#include <sched.h>
#include <time.h>

static void pin(int core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

#endif

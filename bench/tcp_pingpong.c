/* An 8-byte TCP ping-pong: the one-way time (alpha) of a link, for bench/many_hosts.sh's floor.
 *
 *   tcp_pingpong server PORT             accepts one connection, echoes until it closes
 *   tcp_pingpong client ADDR PORT [N]    N round trips (default 2000) after N/10 warm-up ones;
 *                                        prints "alpha_us <median one-way> mean <mean one-way>"
 *
 * Both ends use TCP_NODELAY and blocking sockets (the wait sleeps in the kernel, as a rank that
 * has fewer cores than peers must): one-way = round trip / 2. Every wait has a deadline (10 s,
 * SO_RCVTIMEO/SO_SNDTIMEO); the server exits when the client closes. Not a test: a tool.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MSG 8

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void tune(int fd) {
    int one = 1;
    struct timeval tv = {10, 0};
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* Reads exactly MSG bytes; 0 when the peer closed, -1 on error or timeout. */
static int read_msg(int fd, char *buf) {
    int got = 0;
    while (got < MSG) {
        ssize_t n = recv(fd, buf + got, MSG - got, 0);
        if (n == 0) return 0;
        if (n < 0) return -1;
        got += (int)n;
    }
    return 1;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    char buf[MSG] = {0};
    if (argc >= 3 && !strcmp(argv[1], "server")) {
        int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
        setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1)) { perror("listen"); return 1; }
        struct timeval tv = {30, 0};
        setsockopt(ls, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) { perror("accept"); return 1; }
        tune(fd);
        int r;
        while ((r = read_msg(fd, buf)) == 1)
            if (send(fd, buf, MSG, 0) != MSG) return 1;
        return r < 0;
    }
    if (argc >= 4 && !strcmp(argv[1], "client")) {
        int n = argc >= 5 ? atoi(argv[4]) : 2000;
        if (n < 1) n = 1;
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
        if (inet_pton(AF_INET, argv[2], &a.sin_addr) != 1) { fprintf(stderr, "bad address\n"); return 1; }
        int fd = -1;
        for (int tries = 0; tries < 300; tries++) { /* the server may not listen yet: 3 s */
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (!connect(fd, (struct sockaddr *)&a, sizeof a)) break;
            close(fd);
            fd = -1;
            usleep(10000);
        }
        if (fd < 0) { perror("connect"); return 1; }
        tune(fd);
        double *rt = malloc(sizeof(double) * n), total = 0;
        for (int i = -n / 10; i < n; i++) {
            double t = now_us();
            if (send(fd, buf, MSG, 0) != MSG || read_msg(fd, buf) != 1) { fprintf(stderr, "ping-pong failed\n"); return 1; }
            if (i >= 0) total += rt[i] = now_us() - t;
        }
        qsort(rt, n, sizeof(double), cmp);
        printf("alpha_us %.2f mean %.2f\n", rt[n / 2] / 2, total / n / 2);
        close(fd);
        return 0;
    }
    fprintf(stderr, "usage: tcp_pingpong server PORT | client ADDR PORT [N]\n");
    return 2;
}

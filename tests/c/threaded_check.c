/* threaded_check.c: csrc/threaded.c and csrc/sender.c on their own, driven
 * over socketpairs by peer threads that send their streams in random pieces
 * while they read the reply, so ThreadSanitizer and AddressSanitizer see
 * every hand-off between the socket threads. Prints one "ok" line per case;
 * exits non-zero on the first mismatch. */
#define _POSIX_C_SOURCE 200809L

#include "sender.h"
#include "threaded.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define HEAD_LEN 16
#define TAIL_LEN 12
#define NEVER ((size_t)-1)

typedef struct peer {
    int fd;
    const uint8_t *stream;
    size_t stream_len;
    size_t cut_at; /* stop sending and close the write side here */
    uint8_t *reply;
    size_t reply_cap, got;
    unsigned seed;
} peer;

static unsigned next_rand(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) & 0xffffff;
}

static void *writer(void *arg)
{
    peer *p = (peer *)arg;
    size_t pos = 0, end = p->cut_at < p->stream_len ? p->cut_at : p->stream_len;
    while (pos < end) {
        size_t piece = 1 + next_rand(&p->seed) % 70000;
        ssize_t rc;
        if (piece > end - pos)
            piece = end - pos;
        rc = send(p->fd, p->stream + pos, piece, MSG_NOSIGNAL);
        if (rc < 0) {
            if (errno == EINTR)
                continue;
            break; /* the coordinator side gave up */
        }
        pos += (size_t)rc;
    }
    if (p->cut_at != NEVER)
        shutdown(p->fd, SHUT_WR);
    return NULL;
}

static void *reader(void *arg)
{
    peer *p = (peer *)arg;
    while (p->got < p->reply_cap) {
        ssize_t rc = recv(p->fd, p->reply + p->got, p->reply_cap - p->got, 0);
        if (rc < 0 && errno == EINTR)
            continue;
        if (rc <= 0)
            break;
        p->got += (size_t)rc;
    }
    return NULL;
}

static int fail_case(const char *what, size_t n, size_t count)
{
    fprintf(stderr, "FAIL n=%zu count=%zu: %s\n", n, count, what);
    exit(1);
}

/* Bit-equal, except that a NaN matches any NaN: which NaN an add yields
 * is the hardware's choice, not part of the arithmetic contract. */
static int same_floats(const float *a, const float *b, size_t count)
{
    size_t k;
    for (k = 0; k < count; k++) {
        if (isnan(a[k]) && isnan(b[k]))
            continue;
        if (memcmp(&a[k], &b[k], sizeof(float)) != 0)
            return 0;
    }
    return 1;
}

/* One step of n sockets; bad_socket/bad_elem put a NaN, cut_socket closes
 * mid-stream (NEVER for neither); with finish the reply goes on past the NaN
 * (finish_on_nonfinite). */
static void run_case(size_t n, size_t count, size_t ring, size_t bad_socket, size_t bad_elem,
                     size_t cut_socket, int finish)
{
    const size_t grad_bytes = count * 4, stream_len = grad_bytes + TAIL_LEN;
    float *grads = (float *)malloc(n * count * sizeof(float) + 1);
    uint8_t *streams = (uint8_t *)malloc(n * stream_len + 1);
    float *out = (float *)malloc(grad_bytes + 4);
    float *want = (float *)malloc(grad_bytes + 4);
    uint8_t *tails = (uint8_t *)malloc(n * TAIL_LEN);
    int *fds = (int *)malloc(n * sizeof(int));
    ddpw_link *links = (ddpw_link *)malloc(n * sizeof(ddpw_link));
    ddpw_link **link_of = (ddpw_link **)malloc(n * sizeof(ddpw_link *));
    size_t *sent = (size_t *)calloc(n, sizeof(size_t));
    peer *peers = (peer *)calloc(n, sizeof(peer));
    pthread_t *tids = (pthread_t *)malloc(2 * n * sizeof(pthread_t));
    uint8_t head[HEAD_LEN];
    ddpw_net_reduce_state st;
    ddpw_threaded *h = NULL;
    size_t i, k, failed = NEVER;
    unsigned seed = (unsigned)(n * 7919 + count);
    int rc, err = 0;

    if (!grads || !streams || !out || !want || !tails || !fds || !links || !link_of || !sent ||
        !peers || !tids)
        fail_case("out of memory", n, count);
    for (k = 0; k < HEAD_LEN; k++)
        head[k] = (uint8_t)(0xA0 + k);
    for (i = 0; i < n; i++) {
        for (k = 0; k < count; k++) {
            /* spread magnitudes so rounding depends on the summation order */
            float v = ((float)next_rand(&seed) / 8388608.0f - 1.0f) *
                      (float)(1 << (next_rand(&seed) % 12));
            grads[i * count + k] = v;
        }
        if (i == bad_socket && bad_elem < count)
            grads[i * count + bad_elem] = NAN;
        memcpy(streams + i * stream_len, grads + i * count, grad_bytes);
        for (k = 0; k < TAIL_LEN; k++)
            streams[i * stream_len + grad_bytes + k] = (uint8_t)(i * 16 + k);
    }
    for (k = 0; k < count; k++) {
        float acc = grads[k];
        for (i = 1; i < n; i++)
            acc += grads[i * count + k];
        want[k] = acc / (float)n;
    }
    if (ddpw_net_reduce_init(&st, n, grad_bytes, TAIL_LEN, ring) != DDPW_NET_OK)
        fail_case("reduce_init", n, count);
    st.finish_on_nonfinite = finish;
    for (i = 0; i < n; i++) {
        int pair[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0)
            fail_case("socketpair", n, count);
        fcntl(pair[0], F_SETFL, fcntl(pair[0], F_GETFL) | O_NONBLOCK);
        fds[i] = pair[0];
        ddpw_link_plain(&links[i], pair[0]);
        link_of[i] = &links[i];
        peers[i].fd = pair[1];
        peers[i].stream = streams + i * stream_len;
        peers[i].stream_len = stream_len;
        peers[i].cut_at = i == cut_socket ? stream_len / 2 : NEVER;
        peers[i].reply_cap = HEAD_LEN + grad_bytes;
        peers[i].reply = (uint8_t *)malloc(peers[i].reply_cap + 1);
        peers[i].seed = (unsigned)(i + 1);
        if (!peers[i].reply)
            fail_case("out of memory", n, count);
        pthread_create(&tids[2 * i], NULL, writer, &peers[i]);
        pthread_create(&tids[2 * i + 1], NULL, reader, &peers[i]);
    }
    rc = ddpw_threaded_start(&h, &st, link_of, out, tails, head, HEAD_LEN, sent, 5000, &err);
    if (rc != DDPW_NET_OK)
        fail_case("threaded_start", n, count);
    do {
        rc = ddpw_threaded_wait(h, &failed, &err);
    } while (rc == DDPW_NET_EINTR);
    ddpw_threaded_stop(h);
    /* the reply ends here: the readers see the end of the stream */
    for (i = 0; i < n; i++)
        shutdown(fds[i], SHUT_RDWR);
    for (i = 0; i < 2 * n; i++)
        pthread_join(tids[i], NULL);

    if (cut_socket != NEVER) {
        if (rc != DDPW_NET_EOF || failed != cut_socket)
            fail_case("a closed socket must fail the step and be named", n, count);
    } else if (bad_socket != NEVER && !finish) {
        if (rc != DDPW_NET_NONFINITE)
            fail_case("a NaN must give DDPW_NET_NONFINITE", n, count);
        for (i = 0; i < n; i++) {
            int64_t expect = i == bad_socket ? (int64_t)bad_elem : -1;
            if (st.bad_index[i] != expect)
                fail_case("wrong bad_index", n, count);
            /* nothing averaged at or after the bad element went out */
            if (peers[i].got > HEAD_LEN + bad_elem * 4)
                fail_case("an average holding the NaN was sent", n, count);
        }
    } else {
        if (rc != DDPW_NET_OK)
            fail_case("the step failed", n, count);
        for (i = 0; i < n; i++) {
            int64_t expect = i == bad_socket ? (int64_t)bad_elem : -1;
            if (st.bad_index[i] != expect || (expect >= 0 && !isnan(st.bad_value[i])))
                fail_case("wrong bad_index", n, count);
        }
        if (st.nonfinite != (bad_socket != NEVER))
            fail_case("wrong nonfinite", n, count);
        if (!same_floats(out, want, count))
            fail_case("the mean differs from the sequential one", n, count);
        for (i = 0; i < n; i++) {
            if (memcmp(tails + i * TAIL_LEN, streams + i * stream_len + grad_bytes, TAIL_LEN))
                fail_case("a tail differs", n, count);
            if (sent[i] != HEAD_LEN + grad_bytes || peers[i].got != HEAD_LEN + grad_bytes)
                fail_case("a reply is short", n, count);
            if (memcmp(peers[i].reply, head, HEAD_LEN) ||
                memcmp(peers[i].reply + HEAD_LEN, out, grad_bytes))
                fail_case("a reply differs from the mean", n, count);
        }
    }
    printf("ok n=%zu count=%zu ring=%zu%s%s%s\n", n, count, ring,
           bad_socket != NEVER ? " nan" : "", cut_socket != NEVER ? " cut" : "",
           finish ? " finish" : "");
    for (i = 0; i < n; i++) {
        close(fds[i]);
        close(peers[i].fd);
        free(peers[i].reply);
    }
    ddpw_net_reduce_free(&st);
    free(grads);
    free(streams);
    free(out);
    free(want);
    free(tails);
    free(fds);
    free(links);
    free(link_of);
    free(sent);
    free(peers);
    free(tids);
}

/* A frame sent by ddpw_sender while this thread receives on the same
 * socket; with reading=0 the peer never reads and the send is called off. */
static void run_sender_case(size_t len, int reading)
{
    uint8_t *frame = (uint8_t *)malloc(len + 1);
    uint8_t head[HEAD_LEN];
    struct iovec iov[2];
    ddpw_sender *h = NULL;
    ddpw_link link;
    peer p;
    pthread_t tid;
    size_t k;
    int pair[2], rc, err = 0;
    if (frame == NULL)
        fail_case("out of memory", 1, len);
    for (k = 0; k < len; k++)
        frame[k] = (uint8_t)(k * 31 + 7);
    for (k = 0; k < HEAD_LEN; k++)
        head[k] = (uint8_t)k;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0)
        fail_case("socketpair", 1, len);
    fcntl(pair[0], F_SETFL, fcntl(pair[0], F_GETFL) | O_NONBLOCK);
    memset(&p, 0, sizeof p);
    p.fd = pair[1];
    p.reply_cap = HEAD_LEN + len;
    p.reply = (uint8_t *)malloc(p.reply_cap + 1);
    if (p.reply == NULL)
        fail_case("out of memory", 1, len);
    if (reading)
        pthread_create(&tid, NULL, reader, &p);
    iov[0].iov_base = head;
    iov[0].iov_len = HEAD_LEN;
    iov[1].iov_base = frame;
    iov[1].iov_len = len;
    ddpw_link_plain(&link, pair[0]);
    if (ddpw_sender_start(&h, &link, iov, 2, 0, 5000, &err) != DDPW_NET_OK)
        fail_case("sender_start", 1, len);
    if (reading) {
        do {
            rc = ddpw_sender_wait(h, &err);
        } while (rc == DDPW_NET_EINTR);
        if (rc != DDPW_NET_OK || ddpw_sender_progress(h) != HEAD_LEN + len)
            fail_case("the sender did not send everything", 1, len);
        ddpw_sender_stop(h);
        pthread_join(tid, NULL);
        if (p.got != HEAD_LEN + len || memcmp(p.reply, head, HEAD_LEN) ||
            memcmp(p.reply + HEAD_LEN, frame, len))
            fail_case("the peer got other bytes", 1, len);
    } else {
        /* the peer never reads: the thread blocks on a full socket until stopped */
        struct timespec pause = {0, 50 * 1000 * 1000};
        nanosleep(&pause, NULL);
        if (ddpw_sender_progress(h) >= HEAD_LEN + len)
            fail_case("a send nobody reads cannot finish", 1, len);
        ddpw_sender_stop(h);
    }
    printf("ok sender len=%zu%s\n", len, reading ? "" : " stopped");
    close(pair[0]);
    close(pair[1]);
    free(p.reply);
    free(frame);
}

int main(void)
{
    static const size_t ns[] = {1, 2, 3, 5};
    static const size_t counts[] = {0, 1, 1000, 100003};
    size_t a, b;
    for (a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (b = 0; b < sizeof counts / sizeof counts[0]; b++) {
            run_case(ns[a], counts[b], 16 * 1024, NEVER, 0, NEVER, 0);
            run_case(ns[a], counts[b], 1 << 20, NEVER, 0, NEVER, 0);
        }
    /* a NaN early, in the middle and in the last element, from a middle socket */
    run_case(3, 100003, 16 * 1024, 1, 5, NEVER, 0);
    run_case(3, 100003, 16 * 1024, 1, 50001, NEVER, 0);
    run_case(3, 100003, 16 * 1024, 2, 100002, NEVER, 0);
    run_case(2, 100003, 16 * 1024, 0, 7, NEVER, 0);
    /* the same NaNs with the reply finished past them */
    run_case(3, 100003, 16 * 1024, 1, 5, NEVER, 1);
    run_case(3, 100003, 16 * 1024, 2, 100002, NEVER, 1);
    run_case(2, 100003, 16 * 1024, 0, 7, NEVER, 1);
    run_case(1, 1000, 16 * 1024, 0, 999, NEVER, 1);
    /* a socket closing mid-stream */
    run_case(3, 100003, 16 * 1024, NEVER, 0, 2, 0);
    run_case(2, 100003, 16 * 1024, NEVER, 0, 0, 0);
    run_sender_case(0, 1);
    run_sender_case(1000, 1);
    run_sender_case(3 << 20, 1);
    run_sender_case(3 << 20, 0);
    return 0;
}

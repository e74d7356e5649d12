/* threaded.c: see threaded.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "threaded.h"
#include "reduce.h"
#include "wake.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>

/* Element range reduced at once: the accumulator stays in L2 across the n
 * passes, and a thread is woken once per range, not once per recv. */
#define DDPW_THREADED_CHUNK ((size_t)256 * 1024)

typedef struct socket_thread {
    struct ddpw_threaded *h;
    size_t i;    /* the socket */
    int sending; /* the socket's sending thread, else its receiving one */
    int wake[2]; /* written to when the frontier moves or the step aborts */
    pthread_t id;
    int started, joined;
    int64_t *bad_index; /* this thread's findings in the chunks it reduces */
    float *bad_value;
} socket_thread;

struct ddpw_threaded {
    ddpw_net_reduce_state *st;
    ddpw_link *const *links;
    float *out;
    uint8_t *tails;
    const uint8_t *head;
    size_t head_len;
    size_t *sent;
    int timeout_ms;
    size_t chunk, ring, nchunks;
    size_t nthreads; /* n receiving threads, then n sending ones if replying */

    pthread_mutex_t lock; /* guards everything below and st->recv/reduced/bad_* */
    size_t claimed;       /* chunks handed to a reducer, in order */
    size_t frontier;      /* chunks reduced, contiguous from the first */
    uint8_t *done;        /* per chunk: reduced, maybe ahead of the frontier */
    size_t live;          /* threads still running */
    int abort;
    int result; /* first failure, DDPW_NET_OK if none */
    size_t failed;
    int err;

    int caller_wake[2];
    socket_thread *threads;
};

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

static void wake_all(struct ddpw_threaded *h, const socket_thread *except)
{
    size_t k;
    for (k = 0; k < h->nthreads; k++)
        if (&h->threads[k] != except)
            ddpw_wake_poke(h->threads[k].wake[1]);
}

/* Record the first failure and stop everyone. */
static void fail(socket_thread *t, int rc, int err)
{
    struct ddpw_threaded *h = t->h;
    pthread_mutex_lock(&h->lock);
    if (h->result == DDPW_NET_OK) {
        h->result = rc;
        h->failed = t->i;
        h->err = err;
    }
    h->abort = 1;
    pthread_mutex_unlock(&h->lock);
    wake_all(h, t);
}

static size_t window(const struct ddpw_threaded *h, size_t i, size_t pos, size_t reduced,
                     uint8_t **dst)
{
    return ddpw_net_reduce_window(h->st, i, pos, reduced, h->ring, h->out, h->tails, dst);
}

/* Reduce chunk c of every socket into out (no lock held: nobody else
 * touches this chunk of out or of the rings until it is marked done). */
static void reduce_chunk(socket_thread *t, size_t c, int halted)
{
    struct ddpw_threaded *h = t->h;
    size_t from = c * h->chunk, to = min_sz(from + h->chunk, h->st->grad_bytes);
    ddpw_net_reduce_slice(h->st, h->out + from / 4, from % h->ring, from / 4, (to - from) / 4,
                          halted, t->bad_index, t->bad_value);
}

/* Socket i now has pos bytes of its stream: reduce every chunk that all
 * sockets have delivered and nobody has claimed, then move the frontier.
 * *reduced and *halted are refreshed for the caller. */
static void received(socket_thread *t, size_t pos, size_t *reduced, int *halted_out)
{
    struct ddpw_threaded *h = t->h;
    ddpw_net_reduce_state *st = h->st;
    size_t j, covered, first, last, c, least = st->grad_bytes;
    int halted;
    pthread_mutex_lock(&h->lock);
    st->recv[t->i] = pos;
    for (j = 0; j < st->n; j++)
        least = min_sz(least, st->recv[j]);
    covered = least == st->grad_bytes ? h->nchunks : least / h->chunk;
    first = h->claimed;
    last = covered > first ? covered : first;
    h->claimed = last;
    halted = ddpw_net_halted(st);
    pthread_mutex_unlock(&h->lock);
    if (first < last) {
        for (j = 0; j < st->n; j++)
            t->bad_index[j] = -1;
        for (c = first; c < last; c++)
            reduce_chunk(t, c, halted);
        pthread_mutex_lock(&h->lock);
        /* the verdict lands before the frontier moves, so no thread ever
         * sends an average that contains a bad value (unless the reply is
         * to be finished anyway) */
        for (j = 0; j < st->n; j++) {
            if (t->bad_index[j] < 0)
                continue;
            st->nonfinite = 1;
            if (st->bad_index[j] < 0 || t->bad_index[j] < st->bad_index[j]) {
                st->bad_index[j] = t->bad_index[j];
                st->bad_value[j] = t->bad_value[j];
            }
        }
        for (c = first; c < last; c++)
            h->done[c] = 1;
        while (h->frontier < h->nchunks && h->done[h->frontier])
            h->frontier++;
        st->reduced = min_sz(h->frontier * h->chunk, st->grad_bytes);
        pthread_mutex_unlock(&h->lock);
        wake_all(h, t);
    }
    pthread_mutex_lock(&h->lock);
    *reduced = st->reduced;
    *halted_out = ddpw_net_halted(st);
    pthread_mutex_unlock(&h->lock);
}

/* Does any socket still owe bytes of its stream? */
static int anyone_owes(struct ddpw_threaded *h)
{
    const ddpw_net_reduce_state *st = h->st;
    size_t j;
    int owe = 0;
    pthread_mutex_lock(&h->lock);
    for (j = 0; j < st->n && !owe; j++)
        owe = st->recv[j] < st->grad_bytes + st->tail_len;
    pthread_mutex_unlock(&h->lock);
    return owe;
}

static int wait_for(socket_thread *t, int fd, short events, int *err)
{
    return ddpw_wake_poll(fd, events, t->wake[0], t->h->timeout_ms, err);
}

/* Snapshot of what the other threads decided. */
static int shared_state(struct ddpw_threaded *h, size_t *reduced, int *halted)
{
    int aborted;
    pthread_mutex_lock(&h->lock);
    *reduced = h->st->reduced;
    *halted = ddpw_net_halted(h->st);
    aborted = h->abort;
    pthread_mutex_unlock(&h->lock);
    return aborted;
}

/* Receive socket i's stream, reducing every chunk this thread completes. */
static void receive_loop(socket_thread *t)
{
    struct ddpw_threaded *h = t->h;
    ddpw_net_reduce_state *st = h->st;
    const size_t i = t->i, stream_len = st->grad_bytes + st->tail_len;
    ddpw_link *link = h->links[i];
    size_t pos, reduced;
    int halted, err = 0;
    pthread_mutex_lock(&h->lock);
    pos = st->recv[i];
    pthread_mutex_unlock(&h->lock);
    while (pos < stream_len) {
        uint8_t *dst = NULL;
        size_t room;
        int rc;
        if (shared_state(h, &reduced, &halted))
            return;
        while ((room = window(h, i, pos, reduced, &dst)) > 0) {
            struct iovec into;
            size_t got = 0;
            into.iov_base = dst;
            into.iov_len = room;
            rc = ddpw_link_recv_some(link, &into, 1, room, &got, &err);
            if (got > 0) {
                pos += got;
                received(t, pos, &reduced, &halted);
            }
            if (rc == 1 || rc == DDPW_NET_EINTR)
                continue;
            if (rc == 0)
                break;
            fail(t, rc, err);
            return;
        }
        if (pos == stream_len)
            return;
        /* with the window closed only a wake-up (the frontier moving) helps */
        rc = wait_for(t, link->fd, room > 0 ? POLLIN : 0, &err);
        if (rc < 0) {
            fail(t, rc, err);
            return;
        }
        if (rc == 0 && room > 0) {
            fail(t, DDPW_NET_TIMEOUT, 0);
            return;
        }
    }
}

/* Send socket i the head and every averaged byte, as the frontier moves. */
static void send_loop(socket_thread *t)
{
    struct ddpw_threaded *h = t->h;
    const size_t i = t->i, reply_len = h->head_len + h->st->grad_bytes;
    ddpw_link *link = h->links[i];
    size_t reduced, my_sent = h->sent[i];
    int halted, err = 0;
    struct iovec iov[2];
    iov[0].iov_base = (void *)h->head;
    iov[0].iov_len = h->head_len;
    iov[1].iov_base = h->out;
    for (;;) {
        size_t limit;
        int rc;
        if (shared_state(h, &reduced, &halted))
            break;
        /* at a bad value nothing more goes out (the caller closes
         * everything), unless the reply is to be finished anyway */
        if (halted || my_sent == reply_len)
            break;
        limit = h->head_len + reduced;
        iov[1].iov_len = reduced;
        while (my_sent < limit) {
            rc = ddpw_link_send_some(link, iov, 2, limit, &my_sent, &err);
            if (rc == DDPW_NET_EINTR)
                continue;
            if (rc < 0) {
                h->sent[i] = my_sent;
                fail(t, rc, err);
                return;
            }
            if (rc == 0)
                break;
        }
        if (my_sent == reply_len)
            break;
        rc = wait_for(t, link->fd, my_sent < limit ? POLLOUT : 0, &err);
        if (rc < 0) {
            h->sent[i] = my_sent;
            fail(t, rc, err);
            return;
        }
        /* a socket that owes bytes is blamed before one slow to take them:
         * its receiving thread times out on it */
        if (rc == 0 && my_sent < limit && !anyone_owes(h)) {
            h->sent[i] = my_sent;
            fail(t, DDPW_NET_TIMEOUT, 0);
            return;
        }
    }
    h->sent[i] = my_sent;
}

static void *thread_main(void *arg)
{
    socket_thread *t = (socket_thread *)arg;
    struct ddpw_threaded *h = t->h;
    if (t->sending)
        send_loop(t);
    else
        receive_loop(t);
    pthread_mutex_lock(&h->lock);
    h->live--;
    pthread_mutex_unlock(&h->lock);
    ddpw_wake_poke(h->caller_wake[1]);
    return NULL;
}

static void join_all(struct ddpw_threaded *h)
{
    size_t k;
    for (k = 0; k < h->nthreads; k++) {
        socket_thread *t = &h->threads[k];
        if (t->started && !t->joined) {
            pthread_join(t->id, NULL);
            t->joined = 1;
        }
    }
}

void ddpw_threaded_stop(ddpw_threaded *h)
{
    size_t k;
    if (h == NULL)
        return;
    if (h->threads != NULL) {
        pthread_mutex_lock(&h->lock);
        h->abort = 1;
        pthread_mutex_unlock(&h->lock);
        for (k = 0; k < h->nthreads; k++)
            if (h->threads[k].wake[1] >= 0)
                ddpw_wake_poke(h->threads[k].wake[1]);
        join_all(h);
        for (k = 0; k < h->nthreads; k++) {
            socket_thread *t = &h->threads[k];
            ddpw_wake_close(t->wake);
            free(t->bad_index);
            free(t->bad_value);
        }
        free(h->threads);
    }
    ddpw_wake_close(h->caller_wake);
    pthread_mutex_destroy(&h->lock);
    free(h->done);
    free(h);
}

int ddpw_threaded_start(ddpw_threaded **handle, ddpw_net_reduce_state *st, ddpw_link *const *links,
                        float *out, uint8_t *tails, const uint8_t *head, size_t head_len,
                        size_t *sent, int timeout_ms, int *err)
{
    struct ddpw_threaded *h;
    size_t k, n = st->n;
    int rc = DDPW_NET_OK;
    *handle = NULL;
    if (n == 0 || n > SIZE_MAX / 2 / sizeof(socket_thread) || n > SIZE_MAX / sizeof(int64_t))
        return DDPW_NET_NOMEM;
    h = (struct ddpw_threaded *)calloc(1, sizeof *h);
    if (h == NULL)
        return DDPW_NET_NOMEM;
    h->caller_wake[0] = h->caller_wake[1] = -1;
    if (pthread_mutex_init(&h->lock, NULL) != 0) {
        free(h);
        return DDPW_NET_NOMEM;
    }
    h->st = st;
    h->links = links;
    h->out = out;
    h->tails = tails;
    h->head = head;
    h->head_len = head_len;
    h->sent = sent;
    h->timeout_ms = timeout_ms;
    /* two chunks at least fit the ring, so a socket can receive one while
     * the previous one waits for the others; the ring is a whole number of
     * chunks, so no chunk wraps around its end */
    h->chunk = min_sz(DDPW_THREADED_CHUNK, (st->ring_bytes / 2) & ~(size_t)3);
    if (h->chunk == 0)
        h->chunk = 4;
    h->ring = st->ring_bytes - st->ring_bytes % h->chunk;
    h->nchunks = st->grad_bytes / h->chunk + (st->grad_bytes % h->chunk != 0);
    h->frontier = h->claimed = 0;
    h->result = DDPW_NET_OK;
    /* receiving and sending each get a thread per socket: the kernel's copy
     * into a socket and the one out of it then run on different cores */
    h->nthreads = sent != NULL ? 2 * n : n;
    h->done = (uint8_t *)calloc(h->nchunks + 1, 1);
    h->threads = (socket_thread *)calloc(h->nthreads, sizeof *h->threads);
    if (h->done == NULL || h->threads == NULL) {
        free(h->threads);
        h->threads = NULL;
        ddpw_threaded_stop(h);
        return DDPW_NET_NOMEM;
    }
    for (k = 0; k < h->nthreads; k++)
        h->threads[k].wake[0] = h->threads[k].wake[1] = -1;
    if (ddpw_wake_open(h->caller_wake) != 0) {
        *err = errno;
        ddpw_threaded_stop(h);
        return DDPW_NET_ERRNO;
    }
    for (k = 0; k < h->nthreads; k++) {
        socket_thread *t = &h->threads[k];
        t->h = h;
        t->i = k % n;
        t->sending = k >= n;
        if (ddpw_wake_open(t->wake) != 0) {
            *err = errno;
            ddpw_threaded_stop(h);
            return DDPW_NET_ERRNO;
        }
        if (t->sending)
            continue; /* only receiving threads reduce */
        t->bad_index = (int64_t *)malloc(n * sizeof *t->bad_index);
        t->bad_value = (float *)calloc(n, sizeof *t->bad_value);
        if (t->bad_index == NULL || t->bad_value == NULL) {
            ddpw_threaded_stop(h);
            return DDPW_NET_NOMEM;
        }
    }
    for (k = 0; k < h->nthreads; k++) {
        socket_thread *t = &h->threads[k];
        pthread_mutex_lock(&h->lock);
        h->live++;
        pthread_mutex_unlock(&h->lock);
        rc = ddpw_wake_start_thread(&t->id, thread_main, t);
        if (rc != 0) {
            pthread_mutex_lock(&h->lock);
            h->live--;
            pthread_mutex_unlock(&h->lock);
            break;
        }
        t->started = 1;
    }
    if (rc != 0) {
        *err = rc;
        ddpw_threaded_stop(h);
        return DDPW_NET_ERRNO;
    }
    *handle = h;
    return DDPW_NET_OK;
}

int ddpw_threaded_wait(ddpw_threaded *h, size_t *failed, int *err)
{
    for (;;) {
        size_t live;
        pthread_mutex_lock(&h->lock);
        live = h->live;
        pthread_mutex_unlock(&h->lock);
        if (live == 0)
            break;
        if (ddpw_wake_wait(h->caller_wake[0]) == DDPW_NET_EINTR)
            return DDPW_NET_EINTR;
    }
    join_all(h);
    if (h->result != DDPW_NET_OK) {
        *failed = h->failed;
        *err = h->err;
        return h->result;
    }
    return ddpw_net_halted(h->st) ? DDPW_NET_NONFINITE : DDPW_NET_OK;
}

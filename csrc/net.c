/* net.c: see net.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "net.h"
#include "reduce.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ddpwire receives float32 elements in place and needs a little-endian host"
#endif


/* Largest slice reduced at once: small enough that the accumulator stays in
 * cache across the n passes over it. */
#define DDPW_REDUCE_SLICE ((size_t)64 * 1024)

/* Wait until fd is ready for events; 1 ready, else a DDPW_NET_* code. */
static int wait_fd(int fd, short events, int timeout_ms, int *err)
{
    struct pollfd p;
    int rc;
    p.fd = fd;
    p.events = events;
    p.revents = 0;
    rc = poll(&p, 1, timeout_ms);
    if (rc > 0)
        return 1;
    if (rc == 0)
        return DDPW_NET_TIMEOUT;
    if (errno == EINTR)
        return DDPW_NET_EINTR;
    *err = errno;
    return DDPW_NET_ERRNO;
}


int64_t ddpw_net_now_ms(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0;
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* How long the next poll may wait: the inactivity timeout, cut to what is
 * left before the deadline (none when deadline_ms < 0). -1: already past. */
static int wait_budget(int timeout_ms, int64_t deadline_ms)
{
    int64_t left;
    if (deadline_ms < 0)
        return timeout_ms;
    left = deadline_ms - ddpw_net_now_ms();
    if (left <= 0)
        return -1;
    return left < (int64_t)timeout_ms ? (int)left : timeout_ms;
}


static size_t iov_total(const struct iovec *iov, int iovcnt)
{
    size_t t = 0;
    int i;
    for (i = 0; i < iovcnt; i++)
        t += iov[i].iov_len;
    return t;
}

#define DDPW_MAX_IOV DDPW_LINK_MAX_IOV

/* Send until the socket would block or `total` bytes are out: 0, or a
 * DDPW_NET_* code. For the poll loops, which send whatever a socket takes
 * before they wait on every socket at once. */
static int send_ready(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                      size_t *done, int *err)
{
    while (*done < total) {
        int rc = ddpw_link_send_some(l, iov, iovcnt, total, done, err);
        if (rc <= 0)
            return rc;
    }
    return 0;
}

int ddpw_net_send_iov(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t *done,
                     int timeout_ms, int64_t deadline_ms, int *err)
{
    size_t total;
    if (iovcnt < 0 || iovcnt > DDPW_MAX_IOV)
        return DDPW_NET_NOMEM;
    total = iov_total(iov, iovcnt);
    while (*done < total) {
        int rc = ddpw_link_send_some(l, iov, iovcnt, total, done, err);
        if (rc < 0)
            return rc;
        if (rc == 0) {
            int ms = wait_budget(timeout_ms, deadline_ms);
            if (ms < 0)
                return DDPW_NET_TIMEOUT;
            rc = wait_fd(l->fd, POLLOUT, ms, err);
            if (rc != 1)
                return rc;
        }
    }
    return DDPW_NET_OK;
}

int ddpw_net_send_many(ddpw_link *const *links, size_t n, const struct iovec *iov, int iovcnt,
                      size_t *done, int timeout_ms, size_t *failed, int *err)
{
    struct pollfd *pfd;
    size_t *map;
    size_t total, i;
    int result = DDPW_NET_OK;
    if (iovcnt < 0 || iovcnt > DDPW_MAX_IOV)
        return DDPW_NET_NOMEM;
    if (n == 0)
        return DDPW_NET_OK;
    if (n > SIZE_MAX / sizeof *pfd || n > SIZE_MAX / sizeof *map)
        return DDPW_NET_NOMEM;
    pfd = (struct pollfd *)malloc(n * sizeof *pfd);
    map = (size_t *)malloc(n * sizeof *map);
    if (pfd == NULL || map == NULL) {
        free(pfd);
        free(map);
        return DDPW_NET_NOMEM;
    }
    total = iov_total(iov, iovcnt);
    for (;;) {
        nfds_t k = 0;
        int rc;
        for (i = 0; i < n; i++) {
            if (done[i] >= total)
                continue;
            rc = send_ready(links[i], iov, iovcnt, total, &done[i], err);
            if (rc < 0) {
                *failed = i;
                result = rc;
                goto out;
            }
            if (done[i] < total) {
                pfd[k].fd = links[i]->fd;
                pfd[k].events = POLLOUT;
                pfd[k].revents = 0;
                map[k] = i;
                k++;
            }
        }
        if (k == 0)
            break;
        rc = poll(pfd, k, timeout_ms);
        if (rc == 0) {
            *failed = map[0];
            result = DDPW_NET_TIMEOUT;
            break;
        }
        if (rc < 0) {
            if (errno == EINTR) {
                result = DDPW_NET_EINTR;
            } else {
                *err = errno;
                *failed = map[0];
                result = DDPW_NET_ERRNO;
            }
            break;
        }
    }
out:
    free(pfd);
    free(map);
    return result;
}

/* Check the watched elements that have fully arrived (received bytes of
 * the stream so far). */
static void watch_advance(ddpw_finite_watch *w, size_t received)
{
    size_t upto;
    int64_t found;
    if (w == NULL || w->bad >= 0)
        return;
    upto = received < w->len ? received : w->len;
    upto -= upto % 4;
    if (upto <= w->checked)
        return;
    found = ddpw_first_non_finite((const float *)(const void *)(w->base + w->checked),
                                  (upto - w->checked) / 4);
    if (found >= 0)
        w->bad = (int64_t)(w->checked / 4) + found;
    w->checked = upto;
}

int ddpw_net_recv_exact(ddpw_link *l, void *buf, size_t len, size_t *done,
                       int timeout_ms, int64_t deadline_ms, ddpw_finite_watch *watch, int *err)
{
    struct iovec one;
    one.iov_base = buf;
    one.iov_len = len;
    while (*done < len) {
        int rc = ddpw_link_recv_some(l, &one, 1, len, done, err);
        watch_advance(watch, *done);
        if (rc < 0)
            return rc;
        if (rc == 0) {
            int ms = wait_budget(timeout_ms, deadline_ms);
            if (ms < 0)
                return DDPW_NET_TIMEOUT;
            rc = wait_fd(l->fd, POLLIN, ms, err);
            if (rc != 1)
                return rc;
        }
    }
    return DDPW_NET_OK;
}

int ddpw_net_exchange(ddpw_link *l, const struct iovec *out_iov, int out_cnt, size_t *sent,
                     const struct iovec *in_iov, int in_cnt, size_t *received,
                     int timeout_ms, int64_t deadline_ms, ddpw_finite_watch *watch, int *err)
{
    size_t out_total, in_total;
    int sending = 1;
    if (out_cnt < 0 || out_cnt > DDPW_MAX_IOV || in_cnt < 0 || in_cnt > DDPW_MAX_IOV)
        return DDPW_NET_NOMEM;
    out_total = iov_total(out_iov, out_cnt);
    in_total = iov_total(in_iov, in_cnt);
    for (;;) {
        struct pollfd p;
        int rc;
        /* drain first: the reply must never wait behind our own bytes */
        do {
            rc = ddpw_link_recv_some(l, in_iov, in_cnt, in_total, received, err);
            watch_advance(watch, *received);
            if (rc < 0)
                return rc;
        } while (rc == 1 && *received < in_total);
        if (*received >= in_total)
            return DDPW_NET_OK;
        if (sending) {
            rc = send_ready(l, out_iov, out_cnt, out_total, sent, err);
            /* the peer closed: what it wrote first (a Shutdown) is still to be read */
            if (rc == DDPW_NET_EOF)
                sending = 0;
            else if (rc < 0)
                return rc;
        }
        p.fd = l->fd;
        p.events = POLLIN;
        if (sending && *sent < out_total)
            p.events |= POLLOUT;
        p.revents = 0;
        rc = wait_budget(timeout_ms, deadline_ms);
        if (rc < 0)
            return DDPW_NET_TIMEOUT;
        rc = poll(&p, 1, rc);
        if (rc == 0)
            return DDPW_NET_TIMEOUT;
        if (rc < 0) {
            if (errno == EINTR)
                return DDPW_NET_EINTR;
            *err = errno;
            return DDPW_NET_ERRNO;
        }
    }
}

/* ---- streaming reduce ---- */

int ddpw_net_reduce_init(ddpw_net_reduce_state *st, size_t n, size_t grad_bytes,
                        size_t tail_len, size_t ring_bytes)
{
    size_t i;
    memset(st, 0, sizeof *st);
    if (n == 0 || grad_bytes % 4 != 0 || ring_bytes < 4)
        return DDPW_NET_NOMEM;
    ring_bytes -= ring_bytes % 4; /* element-aligned wrap points */
    if (ring_bytes > grad_bytes && grad_bytes > 0)
        ring_bytes = grad_bytes;
    if (ring_bytes == 0)
        ring_bytes = 4;
    st->n = n;
    st->grad_bytes = grad_bytes;
    st->tail_len = tail_len;
    st->ring_bytes = ring_bytes;
    st->recv = (size_t *)calloc(n, sizeof *st->recv);
    st->rings = (uint8_t **)calloc(n, sizeof *st->rings);
    st->bad_index = (int64_t *)malloc(n * sizeof *st->bad_index);
    st->bad_value = (float *)calloc(n, sizeof *st->bad_value);
    if (st->recv == NULL || st->rings == NULL || st->bad_index == NULL || st->bad_value == NULL)
        goto fail;
    for (i = 0; i < n; i++) {
        st->bad_index[i] = -1;
        if (i > 0) {
            st->rings[i] = (uint8_t *)malloc(ring_bytes);
            if (st->rings[i] == NULL)
                goto fail;
        }
    }
    return DDPW_NET_OK;
fail:
    ddpw_net_reduce_free(st);
    return DDPW_NET_NOMEM;
}

void ddpw_net_reduce_free(ddpw_net_reduce_state *st)
{
    size_t i;
    if (st->rings != NULL)
        for (i = 0; i < st->n; i++)
            free(st->rings[i]);
    free(st->rings);
    free(st->recv);
    free(st->bad_index);
    free(st->bad_value);
    memset(st, 0, sizeof *st);
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

size_t ddpw_net_reduce_window(const ddpw_net_reduce_state *st, size_t i, size_t pos,
                              size_t reduced, size_t ring, float *out, uint8_t *tails,
                              uint8_t **dst)
{
    if (pos < st->grad_bytes) {
        size_t limit;
        if (i == 0) {
            *dst = (uint8_t *)out + pos;
            return st->grad_bytes - pos;
        }
        /* the ring holds stream bytes [reduced, reduced + ring) */
        limit = min_sz(st->grad_bytes, reduced + ring);
        if (pos >= limit)
            return 0;
        *dst = st->rings[i] + pos % ring;
        return min_sz(limit - pos, ring - pos % ring);
    }
    pos -= st->grad_bytes;
    if (pos >= st->tail_len)
        return 0;
    *dst = tails + i * st->tail_len + pos;
    return st->tail_len - pos;
}

static size_t recv_window(const ddpw_net_reduce_state *st, size_t i, float *out,
                          uint8_t *tails, uint8_t **dst)
{
    return ddpw_net_reduce_window(st, i, st->recv[i], st->reduced, st->ring_bytes, out, tails,
                                  dst);
}

void ddpw_net_note_bad(int64_t *bad_index, float *bad_value, size_t i, size_t elem,
                       const float *src, int64_t found)
{
    if (found >= 0 && bad_index[i] < 0) {
        bad_index[i] = (int64_t)elem + found;
        bad_value[i] = src[found];
    }
}

/* buf[k] *= factor: one rounding per element, as the peer that applies its
 * own weight rounds it (numpy's float32 multiply), so the bits agree. */
static void multiply(float *buf, float factor, size_t n)
{
    size_t k;
    for (k = 0; k < n; k++)
        buf[k] *= factor;
}

static int scaled(const ddpw_net_reduce_state *st, size_t i)
{
    return st->scales != NULL && st->scales[i] != 1.0f;
}

int ddpw_net_reduce_slice(const ddpw_net_reduce_state *st, float *acc, size_t ring_off,
                          size_t elem, size_t count, int halted, int64_t *bad_index,
                          float *bad_value)
{
    size_t i;
    int bad = 0;
    if (!halted) {
        /* socket 0's elements were received into out: check them before
         * anything is added to them (once it is known bad, only a finishing
         * reduce gets here again, and it needs no second look) */
        if (bad_index[0] < 0)
            ddpw_net_note_bad(bad_index, bad_value, 0, elem, acc,
                              ddpw_first_non_finite(acc, count));
        if (scaled(st, 0))
            multiply(acc, st->scales[0], count);
        for (i = 1; i < st->n; i++) {
            float *src = (float *)(st->rings[i] + ring_off);
            if (scaled(st, i)) {
                /* checked before the weight, which could overflow a finite value */
                ddpw_net_note_bad(bad_index, bad_value, i, elem, src,
                                  ddpw_first_non_finite(src, count));
                multiply(src, st->scales[i], count);
            }
            ddpw_net_note_bad(bad_index, bad_value, i, elem, src, ddpw_accumulate(acc, src, count));
        }
        for (i = 0; i < st->n; i++)
            bad |= bad_index[i] >= 0;
        if (!bad || st->finish_on_nonfinite)
            ddpw_scale(acc, (float)st->n, count);
        return bad;
    }
    /* halted: keep draining, and find each socket's first bad element */
    for (i = 0; i < st->n; i++) {
        const float *src = i == 0 ? acc : (const float *)(st->rings[i] + ring_off);
        if (bad_index[i] < 0)
            ddpw_net_note_bad(bad_index, bad_value, i, elem, src, ddpw_first_non_finite(src, count));
    }
    return 1;
}

int ddpw_net_halted(const ddpw_net_reduce_state *st)
{
    return st->nonfinite && !st->finish_on_nonfinite;
}

/* Reduce stream bytes [from, to) of every socket into out. */
static void reduce_range(ddpw_net_reduce_state *st, float *out, size_t from, size_t to)
{
    while (from < to) {
        size_t off = from % st->ring_bytes;
        size_t len = min_sz(min_sz(to - from, DDPW_REDUCE_SLICE), st->ring_bytes - off);
        if (ddpw_net_reduce_slice(st, out + from / 4, off, from / 4, len / 4, ddpw_net_halted(st),
                                  st->bad_index, st->bad_value))
            st->nonfinite = 1;
        from += len;
    }
}

/* Receive what every socket has ready, without blocking, then reduce every
 * element range that all sockets have delivered. */
static int take_ready(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                      uint8_t *tails, size_t *failed, int *err)
{
    size_t i, frontier = st->grad_bytes;
    for (i = 0; i < st->n; i++) {
        for (;;) {
            uint8_t *dst = NULL;
            size_t room = recv_window(st, i, out, tails, &dst), got = 0;
            struct iovec into;
            int rc;
            if (room == 0)
                break;
            into.iov_base = dst;
            into.iov_len = room;
            rc = ddpw_link_recv_some(links[i], &into, 1, room, &got, err);
            st->recv[i] += got;
            if (rc == 1)
                continue;
            if (rc == 0)
                break;
            if (rc != DDPW_NET_EINTR)
                *failed = i;
            return rc;
        }
        frontier = min_sz(frontier, st->recv[i] - st->recv[i] % 4);
    }
    if (frontier > st->reduced) {
        reduce_range(st, out, st->reduced, frontier);
        st->reduced = frontier;
    }
    return DDPW_NET_OK;
}

/* The socket to name when a poll loop gives up: the first one that still
 * owes received bytes (POLLIN wanted) before one that is only slow to take
 * ours. map turns a pollfd index into a socket index (NULL: the same); idle
 * entries (fd < 0) are skipped. */
static size_t blame(const struct pollfd *pfd, const size_t *map, nfds_t k)
{
    nfds_t j, first = k;
    for (j = 0; j < k; j++) {
        if (pfd[j].fd < 0 || pfd[j].events == 0)
            continue;
        if (first == k)
            first = j;
        if (pfd[j].events & POLLIN) {
            first = j;
            break;
        }
    }
    if (first == k)
        first = 0;
    return map != NULL ? map[first] : (size_t)first;
}

/* A failed poll(): the code to return, naming socket `culprit`. */
static int poll_failed(int rc, size_t culprit, size_t *failed, int *err)
{
    if (rc == 0) {
        *failed = culprit;
        return DDPW_NET_TIMEOUT;
    }
    if (errno == EINTR)
        return DDPW_NET_EINTR;
    *err = errno;
    *failed = culprit;
    return DDPW_NET_ERRNO;
}

static int alloc_poll(size_t n, struct pollfd **pfd, size_t **map)
{
    *pfd = NULL;
    *map = NULL;
    if (n > SIZE_MAX / sizeof **pfd || n > SIZE_MAX / sizeof **map)
        return DDPW_NET_NOMEM;
    *pfd = (struct pollfd *)malloc(n * sizeof **pfd);
    *map = (size_t *)malloc(n * sizeof **map);
    if (*pfd == NULL || *map == NULL) {
        free(*pfd);
        free(*map);
        return DDPW_NET_NOMEM;
    }
    return DDPW_NET_OK;
}

int ddpw_net_reduce_stream(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                          uint8_t *tails, int timeout_ms, size_t *failed, int *err)
{
    /* the same loop, with nothing to send back */
    return ddpw_net_allreduce_stream(st, links, out, tails, NULL, 0, NULL, timeout_ms, failed, err);
}

int ddpw_net_allreduce_stream(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                             uint8_t *tails, const uint8_t *head, size_t head_len,
                             size_t *sent, int timeout_ms, size_t *failed, int *err)
{
    const size_t n = st->n, stream_len = st->grad_bytes + st->tail_len;
    struct pollfd *pfd;
    size_t *map;
    int result = alloc_poll(n, &pfd, &map);
    if (result != DDPW_NET_OK)
        return result;
    for (;;) {
        struct iovec iov[2];
        size_t i, limit;
        nfds_t k = 0;
        int rc, complete = 1;
        result = take_ready(st, links, out, tails, failed, err);
        if (result != DDPW_NET_OK)
            goto out;
        /* what may go out: the head and every averaged byte, until a bad
         * value unless the reply is to be finished anyway */
        limit = (ddpw_net_halted(st) || sent == NULL) ? 0 : head_len + st->reduced;
        iov[0].iov_base = (void *)head;
        iov[0].iov_len = head_len;
        iov[1].iov_base = out;
        iov[1].iov_len = st->reduced;
        for (i = 0; i < n && limit > 0; i++) {
            rc = send_ready(links[i], iov, 2, limit, &sent[i], err);
            if (rc < 0) {
                *failed = i;
                result = rc;
                goto out;
            }
        }
        for (i = 0; i < n; i++) {
            uint8_t *dst = NULL;
            short events = 0;
            if (st->recv[i] < stream_len)
                complete = 0;
            if (recv_window(st, i, out, tails, &dst) > 0)
                events |= POLLIN;
            if (limit > 0 && sent[i] < limit)
                events |= POLLOUT;
            if (events == 0)
                continue;
            pfd[k].fd = links[i]->fd;
            pfd[k].events = events;
            pfd[k].revents = 0;
            map[k] = i;
            k++;
        }
        if (complete && st->reduced == st->grad_bytes)
            break;
        if (k == 0)
            continue; /* windows reopened by the reduction above */
        rc = poll(pfd, k, timeout_ms);
        if (rc <= 0) {
            result = poll_failed(rc, blame(pfd, map, k), failed, err);
            goto out;
        }
    }
    if (ddpw_net_halted(st))
        result = DDPW_NET_NONFINITE;
out:
    free(pfd);
    free(map);
    return result;
}

/* Elements narrowed ahead of a peer's send cursor: about what a socket's
 * send buffer takes at once (2 MiB of 16-bit words; far fewer cut every
 * sendmsg short of what the socket would take), so a socket seldom waits
 * for the next narrowing. The fewest elements widened or reduced per
 * kernel call but the last (a shorter call costs more than it saves). */
#define NARROW_AHEAD ((size_t)1 << 20)
#define KERNEL_CHUNK ((size_t)1 << 15)
static size_t narrow_ahead = NARROW_AHEAD, kernel_chunk = KERNEL_CHUNK;

void ddpw_net_set_kernel_chunk(size_t elements)
{
    narrow_ahead = elements ? elements : NARROW_AHEAD;
    kernel_chunk = elements ? elements : KERNEL_CHUNK;
}

static size_t kern_width(const ddpw_net_kernels *kern)
{
    return kern->codec == DDPW_HALF_NONE ? 4 : 2;
}

/* Move what peer i's socket allows now, both ways, without blocking,
 * narrowing its elements just ahead of the bytes that go out and widening
 * those that came in; then say in *events what it still waits for (0:
 * done). DDPW_NET_OK or a code. */
static int exchange_ready(ddpw_net_peer_io *p, size_t i, ddpw_net_kernels *kern,
                          short *events, int *err)
{
    size_t in_total = iov_total(p->in_iov, p->in_cnt);
    size_t out_total = iov_total(p->out_iov, p->out_cnt);
    const float *narrow = kern && kern->narrow_from ? kern->narrow_from[i] : NULL;
    float *widen = kern && kern->widen_into ? kern->widen_into[i] : NULL;
    int rc;
    /* drain first: what the peer sends must never wait behind our own bytes */
    while (p->received < in_total) {
        rc = ddpw_link_recv_some(p->link, p->in_iov, p->in_cnt, in_total, &p->received, err);
        if (rc < 0)
            return rc;
        if (rc == 0)
            break;
    }
    if (widen != NULL) {
        size_t have = p->received / 2, done = kern->widened[i];
        if (have > done && (have - done >= kernel_chunk || p->received == in_total)) {
            ddpw_from_half(widen + done, (const uint16_t *)p->in_iov[0].iov_base + done,
                           have - done, kern->codec);
            kern->widened[i] = have;
        }
    }
    /* a peer that closed fails here too (EPIPE): its exchange cannot complete */
    for (;;) {
        size_t limit = out_total;
        struct iovec ready = p->out_cnt > 0 ? p->out_iov[0] : (struct iovec){NULL, 0};
        if (narrow != NULL) {
            size_t count = out_total / 2, done = kern->narrowed[i];
            size_t want = p->sent / 2 + narrow_ahead;
            if (want > count)
                want = count;
            if (want > done) {
                ddpw_to_half((uint16_t *)p->out_iov[0].iov_base + done, narrow + done,
                             want - done, kern->codec);
                kern->narrowed[i] = done = want;
            }
            /* only what is narrowed may go: sendmsg takes the whole iov */
            limit = ready.iov_len = done * 2;
        }
        rc = narrow != NULL ? send_ready(p->link, &ready, 1, limit, &p->sent, err)
                            : send_ready(p->link, p->out_iov, p->out_cnt, limit, &p->sent, err);
        if (rc < 0)
            return rc;
        /* the socket is full, or every narrowed byte went: narrow more */
        if (p->sent < limit || limit == out_total)
            break;
    }
    *events = 0;
    if (p->received < in_total)
        *events |= POLLIN;
    if (p->sent < out_total)
        *events |= POLLOUT;
    return DDPW_NET_OK;
}

/* The slice's reduce over every element range all its inputs have: one
 * kernel call per range of at least kernel_chunk elements (or the last). */
static void reduce_ready(const ddpw_net_peer_io *peers, ddpw_net_kernels *kern)
{
    size_t width = kern_width(kern), have = kern->count, j, bad_input = 0, n;
    const void *ins[DDPW_NET_MAX_PEERS + 1];
    int64_t bad;
    for (j = 0; j < kern->k; j++) {
        size_t from = kern->from[j];
        if (from != DDPW_NET_OWN && peers[from].received / width < have)
            have = peers[from].received / width;
    }
    n = have - kern->reduced;
    if (have <= kern->reduced || (n < kernel_chunk && have < kern->count))
        return;
    for (j = 0; j < kern->k; j++) {
        ins[j] = (const uint8_t *)kern->inputs[j] + kern->reduced * width;
        if (kern->from[j] == DDPW_NET_OWN && width == 2 && kern->own_from != NULL)
            ddpw_to_half((uint16_t *)ins[j], kern->own_from + kern->reduced, n, kern->codec);
    }
    if (width == 2)
        bad = (kern->divide ? ddpw_mean_half : ddpw_total_half)(
            (uint16_t *)kern->out + kern->reduced, (const uint16_t *const *)ins, kern->k, n,
            kern->codec, &bad_input);
    else if (kern->divide)
        bad = ddpw_mean((float *)kern->out + kern->reduced, (const float *const *)ins, kern->k,
                        n, &bad_input);
    else
        bad = ddpw_total((float *)kern->out + kern->reduced, (const float *const *)ins, kern->k,
                         n, &bad_input);
    if (bad >= 0 && (kern->bad_index < 0 || bad_input < kern->bad_input)) {
        /* a later range's find counts only for a lower input */
        kern->bad_input = bad_input;
        kern->bad_index = (int64_t)kern->reduced + bad;
    }
    kern->reduced = have;
}

/* What a call's kernels need of its peers and codec, checked before
 * anything moves: DDPW_NET_OK, or DDPW_NET_NOMEM with *failed the peer. */
static int check_kernels(const ddpw_net_peer_io *peers, size_t n, const ddpw_net_kernels *kern,
                         size_t *failed)
{
    size_t i, j;
    int half = kern->codec == DDPW_HALF_BF16 || kern->codec == DDPW_HALF_FP16;
    if (!half && kern->codec != DDPW_HALF_NONE)
        return DDPW_NET_NOMEM;
    if (!half && (kern->narrow_from != NULL || kern->widen_into != NULL))
        return DDPW_NET_NOMEM;
    if (kern->k > DDPW_NET_MAX_PEERS + 1)
        return DDPW_NET_NOMEM;
    for (i = 0; i < n; i++) {
        int narrow = kern->narrow_from != NULL && kern->narrow_from[i] != NULL;
        int widen = kern->widen_into != NULL && kern->widen_into[i] != NULL;
        if ((narrow && peers[i].out_cnt != 1) || (widen && peers[i].in_cnt != 1)) {
            *failed = i;
            return DDPW_NET_NOMEM;
        }
    }
    for (j = 0; j < kern->k; j++) {
        size_t from = kern->from[j];
        if (from != DDPW_NET_OWN && (from >= n || peers[from].in_cnt != 1 ||
                                     peers[from].in_iov[0].iov_len / kern_width(kern) <
                                         kern->count)) {
            *failed = from < n ? from : 0;
            return DDPW_NET_NOMEM;
        }
    }
    return DDPW_NET_OK;
}

int ddpw_net_exchange_many(ddpw_net_peer_io *peers, size_t n, int timeout_ms,
                          int64_t deadline_ms, size_t *failed, int *err)
{
    return ddpw_net_exchange_kernels(peers, n, NULL, timeout_ms, deadline_ms, failed, err);
}

int ddpw_net_exchange_kernels(ddpw_net_peer_io *peers, size_t n, ddpw_net_kernels *kern,
                             int timeout_ms, int64_t deadline_ms, size_t *failed, int *err)
{
    /* indexed by peer, idle slots at fd -1 (poll skips them): no index map */
    struct pollfd *pfd;
    size_t i;
    int result = DDPW_NET_OK;
    if (n > DDPW_NET_MAX_PEERS)
        return DDPW_NET_NOMEM;
    for (i = 0; i < n; i++) {
        const ddpw_net_peer_io *p = &peers[i];
        if (p->link != NULL && (p->out_cnt < 0 || p->out_cnt > DDPW_MAX_IOV || p->in_cnt < 0 ||
                           p->in_cnt > DDPW_MAX_IOV)) {
            *failed = i;
            return DDPW_NET_NOMEM;
        }
    }
    if (kern != NULL && check_kernels(peers, n, kern, failed) != DDPW_NET_OK)
        return DDPW_NET_NOMEM;
    if (n == 0 && (kern == NULL || kern->k == 0))
        return DDPW_NET_OK;
    pfd = (struct pollfd *)malloc((n ? n : 1) * sizeof *pfd); /* n capped above: no overflow */
    if (pfd == NULL)
        return DDPW_NET_NOMEM;
    for (;;) {
        int rc, waiting = 0;
        for (i = 0; i < n; i++) {
            short events = 0;
            if (peers[i].link != NULL) {
                result = exchange_ready(&peers[i], i, kern, &events, err);
                if (result != DDPW_NET_OK) {
                    if (result != DDPW_NET_EINTR)
                        *failed = i;
                    goto out;
                }
            }
            pfd[i].fd = events ? peers[i].link->fd : -1;
            pfd[i].events = events;
            pfd[i].revents = 0;
            waiting |= events != 0;
        }
        if (kern != NULL && kern->k > 0) {
            reduce_ready(peers, kern);
            /* the last range is reduced once every input has it whole */
            waiting |= kern->reduced < kern->count;
        }
        if (!waiting)
            break;
        rc = wait_budget(timeout_ms, deadline_ms);
        if (rc < 0) {
            result = poll_failed(0, blame(pfd, NULL, (nfds_t)n), failed, err);
            goto out;
        }
        rc = poll(pfd, (nfds_t)n, rc);
        if (rc <= 0) {
            result = poll_failed(rc, blame(pfd, NULL, (nfds_t)n), failed, err);
            goto out;
        }
    }
out:
    free(pfd);
    return result;
}

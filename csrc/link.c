/* link.c: see link.h; plain TCP, and the calls every link shares. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "link.h"
#include "net.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0 /* macOS: CPython ignores SIGPIPE, so EPIPE comes back instead */
#endif

int ddpw_link_iov_advance(const struct iovec *iov, int iovcnt, size_t skip, struct iovec *out)
{
    int k = 0, i;
    for (i = 0; i < iovcnt && k < DDPW_LINK_MAX_IOV; i++) {
        size_t len = iov[i].iov_len;
        if (skip >= len) {
            skip -= len;
            continue;
        }
        out[k].iov_base = (uint8_t *)iov[i].iov_base + skip;
        out[k].iov_len = len - skip;
        skip = 0;
        k++;
    }
    return k;
}

/* What a failed non-blocking socket call means: 0 (would block, or
 * DDPW_NET_OK for a peek), or a DDPW_NET_* code. */
static int socket_failure(int *err)
{
    if (errno == EINTR)
        return DDPW_NET_EINTR;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 0;
    if (errno == EPIPE || errno == ECONNRESET)
        return DDPW_NET_EOF;
    *err = errno;
    return DDPW_NET_ERRNO;
}

/* msg over what is left of iov from `done`: its entries, or DDPW_NET_NOMEM. */
static int rest_of(const struct iovec *iov, int iovcnt, size_t done, struct iovec *rest,
                   struct msghdr *msg)
{
    if (iovcnt < 0 || iovcnt > DDPW_LINK_MAX_IOV)
        return DDPW_NET_NOMEM;
    memset(msg, 0, sizeof *msg);
    msg->msg_iov = rest;
    msg->msg_iovlen = ddpw_link_iov_advance(iov, iovcnt, done, rest);
    return DDPW_NET_OK;
}

int ddpw_link_sendmsg(int fd, const struct iovec *iov, int iovcnt, size_t total, size_t *done,
                      int *err)
{
    struct iovec rest[DDPW_LINK_MAX_IOV];
    struct msghdr msg;
    ssize_t sent;
    if (rest_of(iov, iovcnt, *done, rest, &msg) != DDPW_NET_OK)
        return DDPW_NET_NOMEM;
    if (*done >= total)
        return 1;
    sent = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0)
        return socket_failure(err);
    *done += (size_t)sent;
    return 1;
}

int ddpw_link_recvmsg(int fd, const struct iovec *iov, int iovcnt, size_t total, size_t *done,
                      int *err)
{
    struct iovec rest[DDPW_LINK_MAX_IOV];
    struct msghdr msg;
    ssize_t got;
    if (rest_of(iov, iovcnt, *done, rest, &msg) != DDPW_NET_OK)
        return DDPW_NET_NOMEM;
    if (*done >= total)
        return 1;
    got = recvmsg(fd, &msg, MSG_DONTWAIT);
    if (got == 0)
        return DDPW_NET_EOF;
    if (got < 0)
        return socket_failure(err);
    *done += (size_t)got;
    return 1;
}

static int plain_send_some(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                           size_t *done, int *err)
{
    return ddpw_link_sendmsg(l->fd, iov, iovcnt, total, done, err);
}

static int plain_recv_some(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                           size_t *done, int *err)
{
    return ddpw_link_recvmsg(l->fd, iov, iovcnt, total, done, err);
}

static int plain_peek(ddpw_link *l, void *buf, size_t len, size_t *got, int *err)
{
    ssize_t n = recv(l->fd, buf, len, MSG_PEEK | MSG_DONTWAIT);
    *got = 0;
    if (n == 0)
        return DDPW_NET_EOF;
    if (n < 0)
        return socket_failure(err); /* would block: nothing there, DDPW_NET_OK */
    *got = (size_t)n;
    return DDPW_NET_OK;
}

static size_t plain_held(const ddpw_link *l)
{
    (void)l;
    return 0;
}

static void plain_release(ddpw_link *l)
{
    (void)l;
}

static const ddpw_link_ops plain_ops = {
    plain_send_some, plain_recv_some, plain_peek, plain_held, plain_release,
};

void ddpw_link_plain(ddpw_link *l, int fd)
{
    l->fd = fd;
    l->ops = &plain_ops;
    l->state = NULL;
}

void ddpw_link_release(ddpw_link *l)
{
    if (l->ops != NULL)
        l->ops->release(l);
    ddpw_link_plain(l, -1);
}

int ddpw_link_sealed(const ddpw_link *l)
{
    return l->ops != &plain_ops;
}

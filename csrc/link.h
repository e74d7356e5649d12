/* link.h: the one seam every byte of a session crosses after the join.
 *
 * A link is a connected, non-blocking socket and the way bytes move on it:
 * plain TCP (link.c) or sealed records (sealed.c: AES-256-GCM, see
 * docs/extensions.md "Encryption"). Every loop of csrc/ (net.c, threaded.c,
 * sender.c) sends and receives through these calls and never touches the
 * socket's bytes itself; it still polls link->fd, and a link never keeps
 * received bytes that a poll on fd would not announce once the caller's
 * buffers are full (see ddpw_link_recv_some). A new way of carrying bytes is
 * one file with a ddpw_link_ops table and a function that installs it.
 *
 * The two directions are independent: one thread may send while another
 * receives on the same link (csrc/threaded.c), never two in one direction.
 */
#ifndef DDPW_LINK_H
#define DDPW_LINK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

/* Most iovec entries one call takes. */
#define DDPW_LINK_MAX_IOV 8

typedef struct ddpw_link ddpw_link;

typedef struct ddpw_link_ops {
    /* One non-blocking step of sending bytes [*done, total) of the
     * concatenation of iov: 1 on progress (or nothing left), 0 if it would
     * block, else a DDPW_NET_* code. *done counts bytes the peer will get
     * without another call: a sealed link counts a record only once all of
     * it is in the socket. Resume with the same bytes at the same offsets. */
    int (*send_some)(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                     size_t *done, int *err);
    /* One non-blocking step of receiving into bytes [*done, total) of the
     * concatenation of iov: 1 on progress (or all received), 0 if it would
     * block, else a DDPW_NET_* code. Returns 0 only when nothing received
     * is held back, so a caller waits on fd only when fd must bring more. */
    int (*recv_some)(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                     size_t *done, int *err);
    /* Copy up to len received bytes without consuming them or waiting. */
    int (*peek)(ddpw_link *l, void *buf, size_t len, size_t *got, int *err);
    /* Bytes received and held back by the link (none for plain TCP). */
    size_t (*held)(const ddpw_link *l);
    void (*release)(ddpw_link *l);
} ddpw_link_ops;

struct ddpw_link {
    int fd;
    const ddpw_link_ops *ops;
    void *state; /* the implementation's own; NULL for plain TCP */
};

/* A plain TCP link on fd (no allocation; release is a no-op). */
void ddpw_link_plain(ddpw_link *l, int fd);

/* Most plaintext bytes in one sealed record (sealed.c). */
#define DDPW_SEALED_RECORD ((size_t)64 * 1024)

/* Sealed records on fd under a key per direction (32 bytes each), through
 * libcrypto (csrc/aead.h, loaded first). DDPW_NET_OK, DDPW_NET_NOMEM, or
 * DDPW_NET_INTEGRITY when libcrypto is not loaded or refuses the key. The
 * link owns its buffers until ddpw_link_release. */
int ddpw_link_seal(ddpw_link *l, int fd, const uint8_t *send_key, const uint8_t *recv_key);

/* Free what the link holds and make it a plain link on fd -1. */
void ddpw_link_release(ddpw_link *l);

/* Is the link sealed? */
int ddpw_link_sealed(const ddpw_link *l);

static inline int ddpw_link_send_some(ddpw_link *l, const struct iovec *iov, int iovcnt,
                                      size_t total, size_t *done, int *err)
{
    return l->ops->send_some(l, iov, iovcnt, total, done, err);
}

static inline int ddpw_link_recv_some(ddpw_link *l, const struct iovec *iov, int iovcnt,
                                      size_t total, size_t *done, int *err)
{
    return l->ops->recv_some(l, iov, iovcnt, total, done, err);
}

static inline int ddpw_link_peek(ddpw_link *l, void *buf, size_t len, size_t *got, int *err)
{
    return l->ops->peek(l, buf, len, got, err);
}

static inline size_t ddpw_link_held(const ddpw_link *l)
{
    return l->ops->held(l);
}

/* One non-blocking sendmsg (recvmsg) of bytes [*done, total) of the
 * concatenation of iov on fd: 1 on progress (or nothing left), 0 if it
 * would block, else a DDPW_NET_* code (the peer's close or reset:
 * DDPW_NET_EOF). The plain link's calls, and the sealed link's on its
 * record buffers: one place that reads errno. */
int ddpw_link_sendmsg(int fd, const struct iovec *iov, int iovcnt, size_t total, size_t *done,
                      int *err);
int ddpw_link_recvmsg(int fd, const struct iovec *iov, int iovcnt, size_t total, size_t *done,
                      int *err);

/* Skip the first `skip` bytes of iov into out (at most DDPW_LINK_MAX_IOV
 * entries); returns the entries written. */
int ddpw_link_iov_advance(const struct iovec *iov, int iovcnt, size_t skip, struct iovec *out);

#endif

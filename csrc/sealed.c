/* sealed.c: a link of AES-256-GCM records (link.h, aead.h).
 *
 * On the wire a record is a 4-byte little-endian length L (1 to
 * DDPW_SEALED_RECORD), L bytes of ciphertext and a 16-byte tag; the length
 * is the additional data, so it cannot be changed either. The nonce is the
 * record's number in its direction, never sent: a record replayed, dropped,
 * reordered or injected fails to open. The first failure is kept: every
 * later call in that direction returns it (DDPW_NET_INTEGRITY).
 *
 * A record holds at most 64 KiB of whatever the sender's call had, so the
 * receiver works record by record while the rest streams in, and a record
 * that fits what the caller still wants is opened straight into the
 * caller's buffer: plaintext is copied only when a caller wants less than
 * a record. Nothing is given to the caller before its record is verified.
 */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "aead.h"
#include "link.h"
#include "net.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define HEAD 4
#define TAG DDPW_AEAD_TAG_BYTES
#define RECORD_BYTES (HEAD + DDPW_SEALED_RECORD + TAG)

typedef struct sealed {
    ddpw_aead *tx, *rx;
    uint64_t tx_count, rx_count;
    int tx_failed, rx_failed; /* the first failure of each direction, else 0 */
    /* the record going out: out[out_pos, out_len) still to write; it holds
     * out_plain bytes of the caller's from offset out_from, whose first
     * byte was at out_src (a caller resuming with other bytes is refused) */
    size_t out_len, out_pos, out_plain, out_from;
    const uint8_t *out_src;
    /* the record coming in: in[0, in_len) received so far */
    size_t in_len;
    /* an opened record the caller did not want all of */
    size_t plain_pos, plain_len;
    uint8_t out[RECORD_BYTES];
    uint8_t in[RECORD_BYTES];
    uint8_t plain[DDPW_SEALED_RECORD];
} sealed;

static uint32_t read_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The address of byte `at` of the concatenation of iov (NULL: past it). */
static const uint8_t *iov_at(const struct iovec *iov, int iovcnt, size_t at)
{
    int i;
    for (i = 0; i < iovcnt; i++) {
        if (at < iov[i].iov_len)
            return (const uint8_t *)iov[i].iov_base + at;
        at -= iov[i].iov_len;
    }
    return NULL;
}

static int sealed_send_some(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                            size_t *done, int *err)
{
    sealed *s = (sealed *)l->state;
    struct iovec record;
    int rc;
    if (iovcnt < 0 || iovcnt > DDPW_LINK_MAX_IOV)
        return DDPW_NET_NOMEM;
    if (s->tx_failed)
        return s->tx_failed;
    if (*done >= total)
        return 1;
    if (s->out_len > 0 && (s->out_from != *done || s->out_src != iov_at(iov, iovcnt, *done))) {
        if (s->out_pos > 0) {
            /* half a record is out: the peer can only be sent the rest */
            *err = EPROTO;
            s->tx_failed = DDPW_NET_ERRNO;
            return DDPW_NET_ERRNO;
        }
        /* sealed but not sent: seal the caller's bytes under its number */
        s->out_len = 0;
        s->tx_count--;
    }
    if (s->out_len == 0) {
        size_t len = total - *done;
        if (len > DDPW_SEALED_RECORD)
            len = DDPW_SEALED_RECORD;
        if (s->tx_count == UINT64_MAX) { /* never in practice: 2^64 records */
            s->tx_failed = DDPW_NET_INTEGRITY;
            return DDPW_NET_INTEGRITY;
        }
        s->out[0] = (uint8_t)len;
        s->out[1] = (uint8_t)(len >> 8);
        s->out[2] = (uint8_t)(len >> 16);
        s->out[3] = (uint8_t)(len >> 24);
        if (ddpw_aead_seal(s->tx, s->tx_count, s->out, HEAD, iov, iovcnt, *done, len,
                           s->out + HEAD, s->out + HEAD + len) != 0) {
            s->tx_failed = DDPW_NET_INTEGRITY;
            return DDPW_NET_INTEGRITY;
        }
        s->tx_count++;
        s->out_len = HEAD + len + TAG;
        s->out_pos = 0;
        s->out_plain = len;
        s->out_from = *done;
        s->out_src = iov_at(iov, iovcnt, *done);
    }
    record.iov_base = s->out;
    record.iov_len = s->out_len;
    rc = ddpw_link_sendmsg(l->fd, &record, 1, s->out_len, &s->out_pos, err);
    if (rc <= 0)
        return rc;
    if (s->out_pos == s->out_len) {
        *done += s->out_plain;
        s->out_len = 0;
    }
    return 1;
}

/* Receive until the current record is whole: 1 when it is, 0 if the socket
 * would block first, else a DDPW_NET_* code. */
static int fill_record(ddpw_link *l, sealed *s, int *err)
{
    for (;;) {
        size_t need = HEAD;
        struct iovec record;
        int rc;
        if (s->in_len >= HEAD) {
            uint32_t len = read_le32(s->in);
            if (len == 0 || len > DDPW_SEALED_RECORD) {
                s->rx_failed = DDPW_NET_INTEGRITY;
                return DDPW_NET_INTEGRITY;
            }
            need = HEAD + len + TAG;
            if (s->in_len == need)
                return 1;
        }
        /* exactly the record: bytes after it stay in the socket, where a
         * poll on fd sees them */
        record.iov_base = s->in;
        record.iov_len = need;
        rc = ddpw_link_recvmsg(l->fd, &record, 1, need, &s->in_len, err);
        if (rc <= 0)
            return rc;
    }
}

/* Open the whole record in `in` into the concatenation of out from `skip`. */
static int open_record(sealed *s, const struct iovec *out, int outcnt, size_t skip)
{
    size_t len = s->in_len - HEAD - TAG;
    if (ddpw_aead_open(s->rx, s->rx_count, s->in, HEAD, s->in + HEAD, len, s->in + HEAD + len,
                       out, outcnt, skip) != 0) {
        s->rx_failed = DDPW_NET_INTEGRITY;
        return DDPW_NET_INTEGRITY;
    }
    s->rx_count++;
    s->in_len = 0;
    return DDPW_NET_OK;
}

/* Copy held plaintext into iov from *done, up to total. */
static void give_held(sealed *s, const struct iovec *iov, int iovcnt, size_t total, size_t *done)
{
    struct iovec rest[DDPW_LINK_MAX_IOV];
    int k = ddpw_link_iov_advance(iov, iovcnt, *done, rest), i;
    size_t want = total - *done;
    for (i = 0; i < k && want > 0 && s->plain_pos < s->plain_len; i++) {
        size_t take = rest[i].iov_len;
        if (take > want)
            take = want;
        if (take > s->plain_len - s->plain_pos)
            take = s->plain_len - s->plain_pos;
        memcpy(rest[i].iov_base, s->plain + s->plain_pos, take);
        s->plain_pos += take;
        *done += take;
        want -= take;
    }
    if (s->plain_pos == s->plain_len)
        s->plain_pos = s->plain_len = 0;
}

/* Open the whole record in `in` into the held plaintext. */
static int hold_record(sealed *s)
{
    struct iovec p;
    size_t len = s->in_len - HEAD - TAG;
    int rc;
    p.iov_base = s->plain;
    p.iov_len = len;
    rc = open_record(s, &p, 1, 0);
    if (rc == DDPW_NET_OK) {
        s->plain_pos = 0;
        s->plain_len = len;
    }
    return rc;
}

static int sealed_recv_some(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t total,
                            size_t *done, int *err)
{
    sealed *s = (sealed *)l->state;
    size_t len;
    int rc;
    if (iovcnt < 0 || iovcnt > DDPW_LINK_MAX_IOV)
        return DDPW_NET_NOMEM;
    if (*done >= total)
        return 1;
    if (s->plain_pos < s->plain_len) {
        give_held(s, iov, iovcnt, total, done);
        return 1;
    }
    if (s->rx_failed)
        return s->rx_failed;
    rc = fill_record(l, s, err);
    if (rc <= 0)
        return rc;
    len = s->in_len - HEAD - TAG;
    if (len <= total - *done) {
        rc = open_record(s, iov, iovcnt, *done);
        if (rc != DDPW_NET_OK)
            return rc;
        *done += len;
        return 1;
    }
    rc = hold_record(s);
    if (rc != DDPW_NET_OK)
        return rc;
    give_held(s, iov, iovcnt, total, done);
    return 1;
}

static int sealed_peek(ddpw_link *l, void *buf, size_t len, size_t *got, int *err)
{
    sealed *s = (sealed *)l->state;
    size_t avail;
    *got = 0;
    if (s->plain_pos == s->plain_len) {
        int rc;
        if (s->rx_failed)
            return s->rx_failed;
        rc = fill_record(l, s, err);
        if (rc <= 0)
            return rc;
        rc = hold_record(s);
        if (rc != DDPW_NET_OK)
            return rc;
    }
    avail = s->plain_len - s->plain_pos;
    *got = len < avail ? len : avail;
    memcpy(buf, s->plain + s->plain_pos, *got);
    return DDPW_NET_OK;
}

static size_t sealed_held(const ddpw_link *l)
{
    const sealed *s = (const sealed *)l->state;
    return s->plain_len - s->plain_pos;
}

static void sealed_release(ddpw_link *l)
{
    sealed *s = (sealed *)l->state;
    if (s == NULL)
        return;
    ddpw_aead_free(s->tx);
    ddpw_aead_free(s->rx);
    free(s);
    l->state = NULL;
}

static const ddpw_link_ops sealed_ops = {
    sealed_send_some, sealed_recv_some, sealed_peek, sealed_held, sealed_release,
};

int ddpw_link_seal(ddpw_link *l, int fd, const uint8_t *send_key, const uint8_t *recv_key)
{
    sealed *s = (sealed *)calloc(1, sizeof *s);
    if (s == NULL)
        return DDPW_NET_NOMEM;
    s->tx = ddpw_aead_new(send_key, 1);
    s->rx = ddpw_aead_new(recv_key, 0);
    if (s->tx == NULL || s->rx == NULL) {
        ddpw_aead_free(s->tx);
        ddpw_aead_free(s->rx);
        free(s);
        return DDPW_NET_INTEGRITY;
    }
    ddpw_link_release(l);
    l->fd = fd;
    l->ops = &sealed_ops;
    l->state = s;
    return DDPW_NET_OK;
}

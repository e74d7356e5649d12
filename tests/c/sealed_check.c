/* sealed_check.c: a sealed link (csrc/sealed.c) on its own, over socketpairs,
 * through the libcrypto named by argv[1]. The paths a whole session rarely
 * takes on purpose: records that a small socket takes a piece at a time,
 * read back in every size of call (one byte, a record and one byte more, a
 * peek between); a receiver that takes no byte of the next record past
 * what it wants (it stays in the socket, where poll sees it); a record that
 * went nowhere sealed afresh when the caller resumes with other bytes; and
 * a caller that changes its bytes after part of a record went out refused
 * with EPROTO. Prints one "ok" line per case; exits non-zero on the first
 * failure. */
#define _POSIX_C_SOURCE 200809L

#include "aead.h"
#include "link.h"
#include "net.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define BIG (3 * DDPW_SEALED_RECORD + 4321)

static void fail(const char *what, int rc)
{
    printf("FAIL %s (rc %d)\n", what, rc);
    exit(1);
}

/* A socketpair, non-blocking, sealed both ways (a sends under k1). */
static void sealed_pair(ddpw_link *a, ddpw_link *b, int fds[2], int sndbuf)
{
    uint8_t k1[DDPW_AEAD_KEY_BYTES], k2[DDPW_AEAD_KEY_BYTES];
    int i, rc;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0)
        fail("socketpair", errno);
    for (i = 0; i < 2; i++)
        if (fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) | O_NONBLOCK) != 0)
            fail("fcntl", errno);
    if (sndbuf > 0 && setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf) != 0)
        fail("SO_SNDBUF", errno);
    memset(k1, 0x11, sizeof k1);
    memset(k2, 0x22, sizeof k2);
    ddpw_link_plain(a, -1);
    ddpw_link_plain(b, -1);
    if ((rc = ddpw_link_seal(a, fds[0], k1, k2)) != DDPW_NET_OK)
        fail("seal a", rc);
    if ((rc = ddpw_link_seal(b, fds[1], k2, k1)) != DDPW_NET_OK)
        fail("seal b", rc);
}

static void close_pair(ddpw_link *a, ddpw_link *b, int fds[2])
{
    ddpw_link_release(a);
    ddpw_link_release(b);
    close(fds[0]);
    close(fds[1]);
}

static void fill(uint8_t *buf, size_t len, unsigned seed)
{
    size_t k;
    for (k = 0; k < len; k++)
        buf[k] = (uint8_t)(k * 131u + seed * 7u + (k >> 9));
}

/* One step each way until the sender has sent [*sent, total) of src and
 * the receiver got [*got, want) into dst, the receiver taking at most
 * `chunk` bytes a call (peeking first when asked). */
static void pump(ddpw_link *tx, const uint8_t *src, size_t total, size_t *sent, ddpw_link *rx,
                 uint8_t *dst, size_t want, size_t *got, size_t chunk, int peek)
{
    int err = 0, rc, idle = 0;
    while (*sent < total || *got < want) {
        int moved = 0;
        if (*sent < total) {
            struct iovec v = {(void *)src, total};
            size_t before = *sent;
            rc = ddpw_link_send_some(tx, &v, 1, total, sent, &err);
            if (rc < 0)
                fail("send_some", rc);
            moved |= *sent > before;
        }
        if (*got < want) {
            size_t part = want - *got < chunk ? want - *got : chunk, done = 0;
            struct iovec v = {dst + *got, part};
            if (peek) {
                uint8_t head[8];
                size_t seen = 0;
                rc = ddpw_link_peek(rx, head, sizeof head, &seen, &err);
                if (rc != DDPW_NET_OK)
                    fail("peek", rc);
                if (seen > 0 && memcmp(head, src + *got, seen < part ? seen : part) != 0)
                    fail("peek bytes", 0);
            }
            rc = ddpw_link_recv_some(rx, &v, 1, part, &done, &err);
            if (rc < 0)
                fail("recv_some", rc);
            *got += done;
            moved |= done > 0;
        }
        idle = moved ? 0 : idle + 1;
        if (idle > 1000000)
            fail("no progress", 0);
    }
}

/* BIG bytes through a small socket buffer, read in calls of `chunk`. */
static void run_sizes(size_t chunk, int peek)
{
    ddpw_link a, b;
    int fds[2];
    uint8_t *src = malloc(BIG), *dst = calloc(1, BIG);
    size_t sent = 0, got = 0;
    if (src == NULL || dst == NULL)
        fail("malloc", 0);
    fill(src, BIG, (unsigned)chunk);
    sealed_pair(&a, &b, fds, 8192);
    pump(&a, src, BIG, &sent, &b, dst, BIG, &got, chunk, peek);
    if (memcmp(src, dst, BIG) != 0)
        fail("bytes differ", (int)chunk);
    if (ddpw_link_held(&b) != 0)
        fail("held after all", (int)ddpw_link_held(&b));
    close_pair(&a, &b, fds);
    free(src);
    free(dst);
    printf("ok sizes %zu%s\n", chunk, peek ? " peek" : "");
}

/* Two sends; a receiver that wants exactly the first leaves the second's
 * record wholly in the socket (poll sees it), then gets it. */
static void run_no_read_past_want(void)
{
    ddpw_link a, b;
    int fds[2];
    uint8_t one[DDPW_SEALED_RECORD], two[100], got1[DDPW_SEALED_RECORD], got2[100];
    size_t sent = 0, got = 0;
    uint8_t wire[256];
    struct pollfd p;
    fill(one, sizeof one, 1);
    fill(two, sizeof two, 2);
    sealed_pair(&a, &b, fds, 0);
    pump(&a, one, sizeof one, &sent, &b, got1, 0, &got, 1, 0);
    sent = 0;
    pump(&a, two, sizeof two, &sent, &b, got1, 0, &got, 1, 0);
    got = 0;
    pump(&a, one, 0, &sent, &b, got1, sizeof got1, &got, sizeof got1, 0);
    p.fd = fds[1];
    p.events = POLLIN;
    p.revents = 0;
    if (poll(&p, 1, 0) != 1 || !(p.revents & POLLIN))
        fail("the next record left the socket", 0);
    /* all of it: its length, its 100 bytes and its tag */
    if (recv(fds[1], wire, sizeof wire, MSG_PEEK) != 4 + 100 + DDPW_AEAD_TAG_BYTES)
        fail("part of the next record left the socket", 0);
    if (ddpw_link_held(&b) != 0)
        fail("held", (int)ddpw_link_held(&b));
    got = 0;
    pump(&a, two, 0, &sent, &b, got2, sizeof got2, &got, sizeof got2, 0);
    if (memcmp(one, got1, sizeof one) != 0 || memcmp(two, got2, sizeof two) != 0)
        fail("bytes differ", 0);
    close_pair(&a, &b, fds);
    printf("ok want\n");
}

/* Fill fd's socket with raw bytes until it takes no more; returns them. */
static size_t stuff(int fd)
{
    uint8_t junk[4096];
    size_t total = 0;
    memset(junk, 0x5a, sizeof junk);
    for (;;) {
        ssize_t n = write(fd, junk, sizeof junk);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return total;
            fail("stuff", errno);
        }
        total += (size_t)n;
    }
}

static void drain(int fd, size_t len)
{
    uint8_t junk[4096];
    while (len > 0) {
        ssize_t n = read(fd, junk, len < sizeof junk ? len : sizeof junk);
        if (n <= 0)
            fail("drain", errno);
        len -= (size_t)n;
    }
}

/* A record sealed while the socket was full went nowhere: other bytes at
 * the same offset are sealed afresh, under the same record number. */
static void run_reseal(void)
{
    ddpw_link a, b;
    int fds[2], err = 0, rc;
    uint8_t *first = malloc(BIG), *second = malloc(BIG), *dst = calloc(1, BIG);
    size_t sent = 0, got = 0, junk;
    struct iovec v;
    if (first == NULL || second == NULL || dst == NULL)
        fail("malloc", 0);
    fill(first, BIG, 3);
    fill(second, BIG, 4);
    sealed_pair(&a, &b, fds, 8192);
    junk = stuff(fds[0]);
    v.iov_base = first;
    v.iov_len = BIG;
    rc = ddpw_link_send_some(&a, &v, 1, BIG, &sent, &err);
    if (rc != 0 || sent != 0)
        fail("a full socket took a record", rc);
    drain(fds[1], junk);
    pump(&a, second, BIG, &sent, &b, dst, BIG, &got, BIG, 0);
    if (memcmp(second, dst, BIG) != 0)
        fail("bytes differ", 0);
    close_pair(&a, &b, fds);
    free(first);
    free(second);
    free(dst);
    printf("ok reseal\n");
}

/* Part of a record went out: the peer can only be given the rest, so other
 * bytes are refused (EPROTO), and so is every send after. */
static void run_changed_mid_record(void)
{
    ddpw_link a, b;
    int fds[2], err = 0, rc;
    uint8_t *first = malloc(BIG), *second = malloc(BIG);
    size_t sent = 0;
    struct iovec v;
    if (first == NULL || second == NULL)
        fail("malloc", 0);
    fill(first, BIG, 5);
    fill(second, BIG, 6);
    sealed_pair(&a, &b, fds, 8192);
    v.iov_base = first;
    v.iov_len = BIG;
    /* the socket takes less than a record: sent stays 0, a record is cut */
    rc = ddpw_link_send_some(&a, &v, 1, BIG, &sent, &err);
    if (rc != 1 || sent != 0)
        fail("a small socket took a whole record", rc);
    rc = ddpw_link_send_some(&a, &v, 1, BIG, &sent, &err);
    if (rc != 0)
        fail("a full socket took more", rc);
    v.iov_base = second;
    rc = ddpw_link_send_some(&a, &v, 1, BIG, &sent, &err);
    if (rc != DDPW_NET_ERRNO || err != EPROTO)
        fail("other bytes after part of a record", rc);
    err = 0;
    v.iov_base = first;
    rc = ddpw_link_send_some(&a, &v, 1, BIG, &sent, &err);
    if (rc != DDPW_NET_ERRNO)
        fail("a send after the refusal", rc);
    close_pair(&a, &b, fds);
    free(first);
    free(second);
    printf("ok changed\n");
}

int main(int argc, char **argv)
{
    static const size_t chunks[] = {1, 7, DDPW_SEALED_RECORD, DDPW_SEALED_RECORD + 1, 200000, BIG};
    char why[256];
    size_t k;
    if (argc < 2 || ddpw_aead_load(argv[1], why, sizeof why) != 0) {
        printf("FAIL %s\n", argc < 2 ? "usage: sealed_check LIBCRYPTO" : why);
        return 1;
    }
    for (k = 0; k < sizeof chunks / sizeof chunks[0]; k++)
        run_sizes(chunks[k], 0);
    run_sizes(1000, 1);
    run_sizes(DDPW_SEALED_RECORD + 1, 1);
    run_no_read_past_want();
    run_reseal();
    run_changed_mid_record();
    return 0;
}

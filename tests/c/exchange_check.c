/* exchange_check.c: ddpw_net_exchange_many on its own, over socketpairs.
 * Full meshes of threads that each send more than the socket buffers hold to
 * every other one before anything is read (a loop that waited for a send
 * before a receive would deadlock), with scatter-gather on both sides and
 * empty iovec entries; then the failure paths: a peer closing while it owes
 * bytes, a silent peer named before one only slow to read, a deadline that
 * ends a trickle, and the bounds; and ddpw_net_exchange_kernels' phases
 * (a 16-bit reduce-scatter narrowing as it sends and reducing as it
 * receives, an allgather widening as it receives) against whole-vector
 * passes, bit for bit, in the default and in tiny kernel steps. Given a
 * libcrypto to load (argv[1]), a mesh and the kernels again over sealed
 * links (csrc/sealed.c). Prints one "ok" line per case; exits non-zero on
 * the first failure. */
#define _POSIX_C_SOURCE 200809L

#include "aead.h"
#include "net.h"
#include "reduce.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_N 5

/* every pair's links sealed (main, with a libcrypto to load) */
static int sealed_mode = 0;

static void die(const char *what, int rc)
{
    printf("FAIL %s (rc %d)\n", what, rc);
    exit(1);
}

/* Member self's link to peer on fd: plain, or with sealed_mode sealed
 * under a key per direction (the peer's side has them swapped). */
static void open_link(ddpw_link *l, int fd, size_t self, size_t peer)
{
    uint8_t tx[DDPW_AEAD_KEY_BYTES], rx[DDPW_AEAD_KEY_BYTES];
    int rc;
    ddpw_link_plain(l, fd);
    if (!sealed_mode)
        return;
    memset(tx, (int)(self * 16 + peer + 1), sizeof tx);
    memset(rx, (int)(peer * 16 + self + 1), sizeof rx);
    rc = ddpw_link_seal(l, fd, tx, rx);
    if (rc != DDPW_NET_OK)
        die("seal", rc);
}

static void make_pair(int fds[2])
{
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0)
        die("socketpair", errno);
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK);
}

static size_t mesh_size(size_t src, size_t dst)
{
    /* zero for one pair: a peer that sends nothing to one other */
    return (src == 1 && dst == 0) ? 0 : ((size_t)1 << 20) + src * 1000 + dst * 37;
}

static uint8_t pattern(size_t src, size_t dst, size_t k)
{
    return (uint8_t)((src * 131 + dst * 71 + k * 13 + (k >> 9)) & 0xff);
}

typedef struct mesh_peer {
    size_t self, n;
    int fds[MAX_N];
    ddpw_link links[MAX_N];
    uint8_t *out[MAX_N], *in[MAX_N];
    int rc;
    size_t failed;
} mesh_peer;

/* Cut [buf, buf + len) into `parts` iovec entries, the first one empty. */
static int cut(struct iovec *iov, uint8_t *buf, size_t len, int parts)
{
    int k;
    iov[0].iov_base = buf;
    iov[0].iov_len = 0;
    for (k = 1; k < parts; k++) {
        size_t from = len * (size_t)(k - 1) / (size_t)(parts - 1);
        size_t to = len * (size_t)k / (size_t)(parts - 1);
        iov[k].iov_base = buf + from;
        iov[k].iov_len = to - from;
    }
    return parts;
}

static void *mesh_thread(void *arg)
{
    mesh_peer *p = (mesh_peer *)arg;
    ddpw_net_peer_io io[MAX_N];
    struct iovec out_iov[MAX_N][4], in_iov[MAX_N][3];
    size_t j;
    int err = 0;
    memset(io, 0, sizeof io);
    for (j = 0; j < p->n; j++) {
        io[j].link = p->fds[j] >= 0 ? &p->links[j] : NULL;
        io[j].out_iov = out_iov[j];
        io[j].out_cnt = j == p->self ? 0 : cut(out_iov[j], p->out[j], mesh_size(p->self, j), 4);
        io[j].in_iov = in_iov[j];
        io[j].in_cnt = j == p->self ? 0 : cut(in_iov[j], p->in[j], mesh_size(j, p->self), 3);
    }
    do
        p->rc = ddpw_net_exchange_many(io, p->n, 30000, -1, &p->failed, &err);
    while (p->rc == DDPW_NET_EINTR);
    return NULL;
}

static void run_mesh(size_t n)
{
    mesh_peer peers[MAX_N];
    pthread_t threads[MAX_N];
    size_t i, j, k;
    memset(peers, 0, sizeof peers);
    for (i = 0; i < n; i++) {
        peers[i].self = i;
        peers[i].n = n;
        peers[i].fds[i] = -1;
    }
    for (i = 0; i < n; i++)
        for (j = i + 1; j < n; j++) {
            int pair[2];
            make_pair(pair);
            peers[i].fds[j] = pair[0];
            peers[j].fds[i] = pair[1];
            open_link(&peers[i].links[j], pair[0], i, j);
            open_link(&peers[j].links[i], pair[1], j, i);
        }
    for (i = 0; i < n; i++)
        for (j = 0; j < n; j++) {
            size_t len = i == j ? 0 : mesh_size(i, j);
            peers[i].out[j] = (uint8_t *)malloc(len + 1);
            peers[j].in[i] = (uint8_t *)calloc(len + 1, 1);
            if (peers[i].out[j] == NULL || peers[j].in[i] == NULL)
                die("malloc", 0);
            for (k = 0; k < len; k++)
                peers[i].out[j][k] = pattern(i, j, k);
        }
    for (i = 0; i < n; i++)
        if (pthread_create(&threads[i], NULL, mesh_thread, &peers[i]) != 0)
            die("pthread_create", 0);
    for (i = 0; i < n; i++)
        pthread_join(threads[i], NULL);
    for (i = 0; i < n; i++) {
        if (peers[i].rc != DDPW_NET_OK)
            die("mesh exchange", peers[i].rc);
        for (j = 0; j < n; j++) {
            if (i == j)
                continue;
            if (memcmp(peers[i].in[j], peers[j].out[i], mesh_size(j, i)) != 0)
                die("mesh bytes", 0);
        }
    }
    for (i = 0; i < n; i++)
        for (j = 0; j < n; j++) {
            if (peers[i].fds[j] >= 0) {
                ddpw_link_release(&peers[i].links[j]);
                close(peers[i].fds[j]);
            }
            free(peers[i].out[j]);
            free(peers[i].in[j]);
        }
    printf("ok mesh %zu%s\n", n, sealed_mode ? " sealed" : "");
}

/* io over a plain link on fd (held in *l; fd < 0: an empty slot) */
static void one(ddpw_net_peer_io *io, ddpw_link *l, int fd, struct iovec *out, uint8_t *obuf,
                size_t olen, struct iovec *in, uint8_t *ibuf, size_t ilen)
{
    memset(io, 0, sizeof *io);
    ddpw_link_plain(l, fd);
    io->link = fd >= 0 ? l : NULL;
    out->iov_base = obuf;
    out->iov_len = olen;
    in->iov_base = ibuf;
    in->iov_len = ilen;
    io->out_iov = out;
    io->out_cnt = 1;
    io->in_iov = in;
    io->in_cnt = 1;
}

static void run_eof(void)
{
    static uint8_t obuf[1000], ibuf[2][1000];
    ddpw_net_peer_io io[3];
    ddpw_link links[3];
    struct iovec out[3], in[3];
    int a[2], b[2], err = 0, rc;
    size_t failed = 99;
    make_pair(a);
    make_pair(b);
    one(&io[0], &links[0], -1, &out[0], obuf, 0, &in[0], NULL, 0);
    one(&io[1], &links[1], a[0], &out[1], obuf, 0, &in[1], ibuf[0], 1000);
    one(&io[2], &links[2], b[0], &out[2], obuf, 1000, &in[2], ibuf[1], 1000);
    if (write(a[1], obuf, 1000) != 1000)
        die("write", errno);
    if (write(b[1], obuf, 100) != 100) /* a tenth of what it owes, then gone */
        die("write", errno);
    close(b[1]);
    rc = ddpw_net_exchange_many(io, 3, 10000, -1, &failed, &err);
    if (rc != DDPW_NET_EOF || failed != 2 || io[2].received != 100 || io[1].received != 1000)
        die("eof", rc);
    close(a[0]);
    close(a[1]);
    close(b[0]);
    printf("ok eof\n");
}

static void run_timeout(void)
{
    static uint8_t big[4 << 20], ibuf[16];
    ddpw_net_peer_io io[2];
    ddpw_link links[2];
    struct iovec out[2], in[2];
    int slow[2], silent[2], err = 0, rc;
    size_t failed = 99;
    make_pair(slow);
    make_pair(silent);
    /* slot 0 is only slow to read our bytes; slot 1 owes us bytes: name it */
    one(&io[0], &links[0], slow[0], &out[0], big, sizeof big, &in[0], NULL, 0);
    one(&io[1], &links[1], silent[0], &out[1], big, 0, &in[1], ibuf, sizeof ibuf);
    rc = ddpw_net_exchange_many(io, 2, 100, -1, &failed, &err);
    if (rc != DDPW_NET_TIMEOUT || failed != 1 || io[0].sent == 0 || io[0].sent >= sizeof big)
        die("timeout", rc);
    close(slow[0]);
    close(slow[1]);
    close(silent[0]);
    close(silent[1]);
    printf("ok timeout\n");
}

static void *trickle(void *arg)
{
    int fd = *(int *)arg;
    struct timespec tick = {0, 10 * 1000 * 1000};
    for (;;) {
        nanosleep(&tick, NULL);
        if (send(fd, "x", 1, MSG_NOSIGNAL) < 0 && errno != EAGAIN)
            return NULL; /* the other end is closed: done */
    }
}

static void run_deadline(void)
{
    static uint8_t ibuf[1 << 20];
    ddpw_net_peer_io io[1];
    ddpw_link links[1];
    struct iovec out[1], in[1];
    int pair[2], err = 0, rc;
    size_t failed = 99;
    pthread_t t;
    make_pair(pair);
    one(&io[0], &links[0], pair[0], &out[0], NULL, 0, &in[0], ibuf, sizeof ibuf);
    if (pthread_create(&t, NULL, trickle, &pair[1]) != 0)
        die("pthread_create", 0);
    rc = ddpw_net_exchange_many(io, 1, 30000, ddpw_net_now_ms() + 200, &failed, &err);
    close(pair[0]);
    pthread_join(t, NULL);
    close(pair[1]);
    if (rc != DDPW_NET_TIMEOUT || failed != 0 || io[0].received >= sizeof ibuf)
        die("deadline", rc);
    printf("ok deadline\n");
}

static void run_bounds(void)
{
    ddpw_net_peer_io *many = (ddpw_net_peer_io *)calloc(DDPW_NET_MAX_PEERS + 1, sizeof *many);
    ddpw_net_peer_io io[2];
    ddpw_link stdin_link;
    struct iovec iov[9];
    int err = 0, rc;
    size_t failed = 99;
    if (many == NULL)
        die("calloc", 0);
    rc = ddpw_net_exchange_many(many, DDPW_NET_MAX_PEERS + 1, 100, -1, &failed, &err);
    free(many);
    if (rc != DDPW_NET_NOMEM)
        die("too many peers", rc);
    memset(io, 0, sizeof io);
    memset(iov, 0, sizeof iov);
    io[0].link = NULL;
    io[0].in_cnt = 9; /* an empty slot is not looked at */
    ddpw_link_plain(&stdin_link, 0);
    io[1].link = &stdin_link;
    io[1].in_iov = iov;
    io[1].in_cnt = 9;
    rc = ddpw_net_exchange_many(io, 2, 100, -1, &failed, &err);
    if (rc != DDPW_NET_NOMEM || failed != 1)
        die("too many iovec entries", rc);
    rc = ddpw_net_exchange_many(io, 0, 100, -1, &failed, &err);
    if (rc != DDPW_NET_OK)
        die("no peers", rc);
    printf("ok bounds\n");
}

/* ---- the kernels, a 16-bit reduce-scatter then allgather ---- */

#define K_N 3
#define K_COUNT ((size_t)200003)

typedef struct kern_member {
    size_t self;
    int fds[K_N];
    ddpw_link links[K_N];
    const float *grad;
    float *out;
    int rc;
} kern_member;

static size_t k_lo(size_t w) { return w * K_COUNT / K_N; }

static void *kern_thread(void *arg)
{
    kern_member *m = (kern_member *)arg;
    size_t lo = k_lo(m->self), hi = k_lo(m->self + 1), mine = hi - lo, j;
    uint16_t *wire = (uint16_t *)malloc(K_COUNT * 2), *own = (uint16_t *)malloc(mine * 2 + 2);
    uint16_t *inbox = (uint16_t *)malloc(K_N * (mine * 2 + 2)), *full = (uint16_t *)malloc(K_COUNT * 2);
    ddpw_net_peer_io io[K_N];
    struct iovec out_iov[K_N], in_iov[K_N];
    const float *narrow[K_N];
    float *widen[K_N];
    size_t narrowed[K_N], widened[K_N], from[K_N];
    const void *inputs[K_N];
    ddpw_net_kernels kern;
    size_t failed;
    int err = 0;
    if (!wire || !own || !inbox || !full)
        die("malloc", 0);
    memset(io, 0, sizeof io);
    memset(&kern, 0, sizeof kern);
    memset(narrowed, 0, sizeof narrowed);
    memset(widened, 0, sizeof widened);
    for (j = 0; j < K_N; j++) {
        size_t a = k_lo(j), b = k_lo(j + 1);
        io[j].link = m->fds[j] >= 0 ? &m->links[j] : NULL;
        narrow[j] = NULL;
        if (j == m->self) {
            inputs[j] = wire + lo;
            from[j] = DDPW_NET_OWN;
            continue;
        }
        out_iov[j].iov_base = wire + a;
        out_iov[j].iov_len = (b - a) * 2;
        io[j].out_iov = &out_iov[j];
        io[j].out_cnt = 1;
        narrow[j] = m->grad + a;
        in_iov[j].iov_base = inbox + j * (mine + 1);
        in_iov[j].iov_len = mine * 2;
        io[j].in_iov = &in_iov[j];
        io[j].in_cnt = 1;
        inputs[j] = in_iov[j].iov_base;
        from[j] = j;
    }
    kern.codec = DDPW_HALF_BF16;
    kern.narrow_from = narrow;
    kern.narrowed = narrowed;
    kern.widened = widened;
    kern.k = K_N;
    kern.count = mine;
    kern.inputs = inputs;
    kern.from = from;
    kern.own_from = m->grad + lo;
    kern.out = own;
    kern.divide = 1;
    kern.bad_index = -1;
    do
        m->rc = ddpw_net_exchange_kernels(io, K_N, &kern, 30000, -1, &failed, &err);
    while (m->rc == DDPW_NET_EINTR);
    if (m->rc != DDPW_NET_OK || kern.bad_index != -1 || kern.reduced != mine)
        goto done;
    /* the allgather: this member's average out, every other slice widened in */
    memset(io, 0, sizeof io);
    memset(&kern, 0, sizeof kern);
    for (j = 0; j < K_N; j++) {
        size_t a = k_lo(j), b = k_lo(j + 1);
        io[j].link = m->fds[j] >= 0 ? &m->links[j] : NULL;
        widen[j] = NULL;
        if (j == m->self)
            continue;
        out_iov[j].iov_base = own;
        out_iov[j].iov_len = mine * 2;
        io[j].out_iov = &out_iov[j];
        io[j].out_cnt = 1;
        in_iov[j].iov_base = full + a;
        in_iov[j].iov_len = (b - a) * 2;
        io[j].in_iov = &in_iov[j];
        io[j].in_cnt = 1;
        widen[j] = m->out + a;
    }
    kern.codec = DDPW_HALF_BF16;
    kern.widen_into = widen;
    kern.widened = widened;
    kern.narrowed = narrowed;
    kern.bad_index = -1;
    do
        m->rc = ddpw_net_exchange_kernels(io, K_N, &kern, 30000, -1, &failed, &err);
    while (m->rc == DDPW_NET_EINTR);
    ddpw_from_half(m->out + lo, own, mine, DDPW_HALF_BF16);
done:
    free(wire);
    free(own);
    free(inbox);
    free(full);
    return NULL;
}

static void run_kernels(size_t chunk)
{
    kern_member members[K_N];
    pthread_t threads[K_N];
    float *grads[K_N], *want = (float *)malloc(K_COUNT * 4);
    uint16_t *half[K_N], *avg = (uint16_t *)malloc(K_COUNT * 2);
    const uint16_t *ins[K_N];
    size_t i, j, k;
    if (!want || !avg)
        die("malloc", 0);
    memset(members, 0, sizeof members);
    for (i = 0; i < K_N; i++) {
        grads[i] = (float *)malloc(K_COUNT * 4);
        half[i] = (uint16_t *)malloc(K_COUNT * 2);
        members[i].out = (float *)malloc(K_COUNT * 4);
        if (!grads[i] || !half[i] || !members[i].out)
            die("malloc", 0);
        for (k = 0; k < K_COUNT; k++)
            grads[i][k] = (float)((int)((k * 7919 + i * 104729) % 2001) - 1000) / 37.0f;
        ddpw_to_half(half[i], grads[i], K_COUNT, DDPW_HALF_BF16);
        ins[i] = half[i];
        members[i].self = i;
        members[i].grad = grads[i];
        members[i].fds[i] = -1;
    }
    ddpw_mean_half(avg, ins, K_N, K_COUNT, DDPW_HALF_BF16, NULL);
    ddpw_from_half(want, avg, K_COUNT, DDPW_HALF_BF16);
    for (i = 0; i < K_N; i++)
        for (j = i + 1; j < K_N; j++) {
            int pair[2];
            make_pair(pair);
            members[i].fds[j] = pair[0];
            members[j].fds[i] = pair[1];
            open_link(&members[i].links[j], pair[0], i, j);
            open_link(&members[j].links[i], pair[1], j, i);
        }
    ddpw_net_set_kernel_chunk(chunk);
    for (i = 0; i < K_N; i++)
        if (pthread_create(&threads[i], NULL, kern_thread, &members[i]) != 0)
            die("pthread_create", 0);
    for (i = 0; i < K_N; i++)
        pthread_join(threads[i], NULL);
    ddpw_net_set_kernel_chunk(0);
    for (i = 0; i < K_N; i++) {
        if (members[i].rc != DDPW_NET_OK)
            die("kernel exchange", members[i].rc);
        if (memcmp(members[i].out, want, K_COUNT * 4) != 0)
            die("kernel bits", (int)i);
    }
    for (i = 0; i < K_N; i++) {
        for (j = 0; j < K_N; j++)
            if (members[i].fds[j] >= 0) {
                ddpw_link_release(&members[i].links[j]);
                close(members[i].fds[j]);
            }
        free(grads[i]);
        free(half[i]);
        free(members[i].out);
    }
    free(want);
    free(avg);
    printf("ok kernels %zu%s\n", chunk, sealed_mode ? " sealed" : "");
}

int main(int argc, char **argv)
{
    char why[256];
    run_mesh(2);
    run_mesh(3);
    run_mesh(5);
    run_eof();
    run_timeout();
    run_deadline();
    run_bounds();
    run_kernels(0);
    run_kernels(5);
    if (argc > 1) {
        if (ddpw_aead_load(argv[1], why, sizeof why) != 0) {
            printf("FAIL %s\n", why);
            return 1;
        }
        sealed_mode = 1;
        run_mesh(3);
        run_kernels(5);
    }
    return 0;
}

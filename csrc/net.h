/* net.h: blocking-with-timeout socket I/O for ddpwire, callable without the GIL.
 *
 * Every call takes an inactivity timeout in milliseconds: it fails with
 * DDPW_NET_TIMEOUT only when no byte moved for that long, so a slow but live
 * peer streaming a large gradient is never cut off, while a silent one is.
 * Sockets are expected in non-blocking mode; waiting is done with poll().
 *
 * EINTR is not retried here: the call returns DDPW_NET_EINTR with its progress
 * saved in the caller's cursor, so the Python glue can run signal handlers
 * (Ctrl-C) with the GIL held and then call again to resume.
 */
#ifndef DDPW_NET_H
#define DDPW_NET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "link.h"

enum {
    DDPW_NET_OK = 0,
    DDPW_NET_TIMEOUT = -1,  /* no progress within the timeout */
    DDPW_NET_EOF = -2,      /* the peer closed the connection */
    DDPW_NET_EINTR = -3,    /* interrupted by a signal; call again to resume */
    DDPW_NET_ERRNO = -4,    /* a system error; see the errno out-parameter */
    DDPW_NET_NOMEM = -5,
    DDPW_NET_NONFINITE = -6, /* ddpw_net_reduce_stream: data received, non-finite found */
    DDPW_NET_INTEGRITY = -7  /* a sealed record failed to open (link.h): nothing of it was given */
};

/* Checks float32 elements for NaN and +/-inf as they are received, in the
 * same pass (the bytes are still in cache): the elements are the first `len`
 * bytes of what the receive fills, starting at `base`. `bad` is the index
 * of the first non-finite element, or -1; `checked` the bytes looked at.
 * Start with checked = 0 and bad = -1; keep it across resumed calls. */
typedef struct ddpw_finite_watch {
    const uint8_t *base;
    size_t len;
    size_t checked;
    int64_t bad;
} ddpw_finite_watch;

/* Send and receive on one link at once, in one poll loop.
 *
 * Sends the concatenation of out_iov from byte *sent while receiving into the
 * concatenation of in_iov from byte *received; returns DDPW_NET_OK as soon
 * as every byte of in_iov has arrived, whether or not the send is finished
 * (call again with the next receive buffers, or finish the send with
 * ddpw_net_send_iov and the same cursor). Receiving never waits for sending,
 * so two peers that both send large frames before reading cannot deadlock
 * here. A send that fails because the peer closed stops sending but not
 * receiving: what the peer wrote before closing (a Shutdown) is still read;
 * the send error comes back from ddpw_net_send_iov. The timeout counts time
 * with no byte moved either way; deadline_ms (see ddpw_net_recv_exact) ends
 * the receive whatever moved. */
int ddpw_net_exchange(ddpw_link *l, const struct iovec *out_iov, int out_cnt, size_t *sent,
                     const struct iovec *in_iov, int in_cnt, size_t *received,
                     int timeout_ms, int64_t deadline_ms, ddpw_finite_watch *watch, int *err);

/* Receive exactly len bytes into buf, resuming from *done.
 * On return *done holds the bytes received so far (also on error).
 * deadline_ms, when >= 0, is a time on ddpw_net_now_ms's clock after which
 * the call gives up with DDPW_NET_TIMEOUT even if bytes keep trickling in:
 * waiting for a message is bounded by its deadline, not only by silence.
 * With a watch (else NULL), the elements are checked as they land. */
int ddpw_net_recv_exact(ddpw_link *l, void *buf, size_t len, size_t *done,
                       int timeout_ms, int64_t deadline_ms, ddpw_finite_watch *watch, int *err);

/* Milliseconds on a monotonic clock, for deadlines. */
int64_t ddpw_net_now_ms(void);

/* Send the concatenation of iov[0..iovcnt) with scatter-gather writes,
 * resuming from byte offset *done of that concatenation. deadline_ms (see
 * ddpw_net_recv_exact) bounds the whole send: a reader that takes a byte
 * now and then resets the timeout but not the deadline. */
int ddpw_net_send_iov(ddpw_link *l, const struct iovec *iov, int iovcnt, size_t *done,
                     int timeout_ms, int64_t deadline_ms, int *err);

/* Send the same iovec list to n links at once, each polled for writability
 * so a slow reader does not hold the others back. done[i] is the per-link
 * cursor; on failure *failed is the index of the link that failed. */
int ddpw_net_send_many(ddpw_link *const *links, size_t n, const struct iovec *iov, int iovcnt,
                      size_t *done, int timeout_ms, size_t *failed, int *err);

/* Most peers one ddpw_net_exchange_many call takes: bounds its poll array. */
#define DDPW_NET_MAX_PEERS 1024

/* One peer of ddpw_net_exchange_many: what goes out to it, what comes back,
 * and the cursors over both, kept here so an interrupted call resumes. */
typedef struct ddpw_net_peer_io {
    ddpw_link *link;         /* NULL: an empty slot (the caller itself), skipped */
    const struct iovec *out_iov; /* sent as one concatenation, at most 8 entries */
    int out_cnt;
    size_t sent;
    const struct iovec *in_iov;  /* filled as one concatenation, at most 8 entries */
    int in_cnt;
    size_t received;
} ddpw_net_peer_io;

/* ddpw_net_exchange with n peers at once, in one poll loop: the data plane of
 * a mesh reduce, where every worker sends a shard to every other one while
 * receiving theirs. Receiving never waits for sending, so peers that all send
 * large buffers before reading cannot deadlock.
 *
 * Returns DDPW_NET_OK only when every peer's send and receive are complete.
 * The timeout counts time with no byte moved on any socket; deadline_ms (see
 * ddpw_net_recv_exact) ends the call whatever moved. On a failure *failed is
 * the peer's index: a peer that closed while still owing bytes (DDPW_NET_EOF),
 * or on a timeout one still owing received bytes before one only slow to take
 * ours. More than DDPW_NET_MAX_PEERS peers or 8 iovec entries: DDPW_NET_NOMEM. */
int ddpw_net_exchange_many(ddpw_net_peer_io *peers, size_t n, int timeout_ms,
                          int64_t deadline_ms, size_t *failed, int *err);

/* An input of ddpw_net_exchange_kernels' reduce that is this member's own,
 * not a peer's: complete from the start. */
#define DDPW_NET_OWN ((size_t)-1)

/* Kernels ddpw_net_exchange_kernels runs on a phase's elements while they
 * move, so that no pass over a vector waits for the last byte or holds up
 * the first (a reduce-scatter's narrowing and its slice's reduce, an
 * allgather's widening). Every array has one entry per peer of the call,
 * NULL where a peer has none; a peer with a kernel has one in_iov (out_iov)
 * entry, its elements. The cursors (narrowed, widened, reduced) start at 0
 * and let an interrupted call resume; elements of an unfinished call are
 * not all written. */
typedef struct ddpw_net_kernels {
    int codec;                  /* DDPW_HALF_NONE (float32) or a 16-bit codec */
    /* peer i's out_iov[0] holds its uint16 elements narrowed from
     * narrow_from[i], a little ahead of its send cursor */
    const float *const *narrow_from;
    size_t *narrowed;
    /* peer i's in_iov[0] receives uint16 elements, widened into
     * widen_into[i] as they complete */
    float *const *widen_into;
    size_t *widened;
    /* the slice's reduce (k == 0: none): out[0, count) from k inputs in
     * member order, as ddpw_mean (divide) or ddpw_total (float32), or
     * ddpw_mean_half or ddpw_total_half (16-bit), range by range as every
     * input has it. Input j is peer from[j]'s in_iov[0], or with from[j] ==
     * DDPW_NET_OWN this member's own: in 16 bits narrowed from own_from into
     * inputs[j] just before its range is reduced. */
    size_t k, count;
    const void *const *inputs;
    const size_t *from;
    const float *own_from;
    void *out;
    int divide;
    size_t reduced;
    /* the first non-finite input element (the lowest input holding one,
     * then the lowest index): bad_index -1 for none */
    int64_t bad_index;
    size_t bad_input;
} ddpw_net_kernels;

/* ddpw_net_exchange_many running ``kern``'s kernels (NULL: none) as the
 * bytes move; done when every byte moved and every kernel ran to the end.
 * A codec that is not DDPW_HALF_* with narrowing, widening or a 16-bit
 * reduce, or a kernel peer with more than one iov entry: DDPW_NET_NOMEM
 * before anything moves. */
int ddpw_net_exchange_kernels(ddpw_net_peer_io *peers, size_t n, ddpw_net_kernels *kern,
                             int timeout_ms, int64_t deadline_ms, size_t *failed, int *err);

/* The kernels' step, in elements (0: the defaults, 1 Mi narrowed ahead
 * and 32 Ki per widening or reduce at least): a few elements make every
 * phase run its kernels in many short ranges, for tests. Not to be changed
 * while a call runs. */
void ddpw_net_set_kernel_chunk(size_t elements);

/* Streaming average of one gradient vector arriving on n sockets.
 *
 * Each socket i carries grad_bytes bytes of little-endian float32 elements
 * followed by tail_len bytes (the fields after the gradients), which land in
 * tails + i * tail_len. Socket 0's elements are received straight into out;
 * the others go through a per-socket ring of ring_bytes, and every element
 * range that all sockets have delivered is reduced at once: out += src in
 * socket order, then out /= n. The result is therefore bit-identical to
 * summing whole vectors in socket order and dividing by n, whatever the
 * arrival pattern, with memory of one vector plus n small rings.
 *
 * A non-finite value does not stop the receive (the streams are drained, so
 * the sessions stay in step); bad_index[i] receives the first non-finite
 * element index of socket i, or -1, for every socket, and bad_value[i] the
 * value found there. By default reduction stops at it and the function
 * returns DDPW_NET_NONFINITE. With finish_on_nonfinite set (after
 * ddpw_net_reduce_init, before the first call) every element is still
 * reduced, the non-finite ones giving whatever float32 arithmetic gives, and
 * the function returns as if all were finite: the caller reads nonfinite and
 * bad_index. That lets a reply complete while the step's fate is decided
 * later, by a message of its own.
 *
 * On a failure *failed is the socket index; progress is kept in state so an
 * EINTR return can be resumed by calling again with the same state. */
typedef struct ddpw_net_reduce_state {
    size_t n;
    size_t grad_bytes, tail_len, ring_bytes;
    size_t *recv;        /* per socket: bytes of the stream received */
    size_t reduced;      /* bytes of every stream reduced into out */
    uint8_t **rings;     /* per socket (index 0 unused) */
    int64_t *bad_index;  /* per socket */
    float *bad_value;    /* per socket: the value at bad_index */
    int nonfinite;       /* some socket has a bad_index */
    int finish_on_nonfinite; /* 0 after init: halt at the first non-finite value */
    /* NULL after init; else per socket a factor its elements are multiplied
     * by, once checked, before they are summed: the sample weight of a peer
     * that cannot apply its own (ddpwire/session/balance.py). Owned by the caller. */
    const float *scales;
} ddpw_net_reduce_state;

int ddpw_net_reduce_init(ddpw_net_reduce_state *st, size_t n, size_t grad_bytes,
                        size_t tail_len, size_t ring_bytes);
void ddpw_net_reduce_free(ddpw_net_reduce_state *st);
int ddpw_net_reduce_stream(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                          uint8_t *tails, int timeout_ms, size_t *failed, int *err);

/* The pieces of the streaming reduce that csrc/threaded.c shares. */

/* Should nothing more be reduced or sent? True once a non-finite value is
 * found, unless the reply is to be finished anyway (finish_on_nonfinite). */
int ddpw_net_halted(const ddpw_net_reduce_state *st);

/* Where socket i's next bytes go once it has delivered pos bytes of its
 * stream, when every stream is reduced up to byte `reduced` and the rings
 * hold `ring` bytes (a multiple of 4, at most st->ring_bytes): returns how
 * many fit, 0 when the socket must wait for the others or its stream is
 * complete, and sets *dst. Socket 0's elements go straight into out, the
 * others' into their rings, the bytes after the vector into tails. */
size_t ddpw_net_reduce_window(const ddpw_net_reduce_state *st, size_t i, size_t pos,
                              size_t reduced, size_t ring, float *out, uint8_t *tails,
                              uint8_t **dst);

/* The one reduce core of both stream engines (this file's poll loop and
 * csrc/threaded.c): average `count` elements starting at element `elem`,
 * whose socket-0 values are already in acc and whose other sockets' values
 * are at ring_off in their rings: a float32 sum in socket order (each
 * socket's values first multiplied by st->scales[i] where that is not 1),
 * then a division by n, unless a non-finite value is found (recorded in bad_index /
 * bad_value, per socket) and st->finish_on_nonfinite is 0: then the range is
 * left unscaled. With `halted`, only look for each socket's first bad
 * element (callers never halt with finish_on_nonfinite). Returns 1 when any
 * socket has a bad element recorded. */
int ddpw_net_reduce_slice(const ddpw_net_reduce_state *st, float *acc, size_t ring_off,
                          size_t elem, size_t count, int halted, int64_t *bad_index,
                          float *bad_value);

/* Keep bad_index[i] / bad_value[i] at the first non-finite element seen:
 * found is an index into src (which starts at element elem), or -1. */
void ddpw_net_note_bad(int64_t *bad_index, float *bad_value, size_t i, size_t elem,
                       const float *src, int64_t found);

/* ddpw_net_reduce_stream fused with the broadcast of its result.
 *
 * While the vectors arrive, every socket i is also sent head[0..head_len)
 * followed by the bytes of out that are already averaged: sent[i] is its
 * cursor over that concatenation (start it at 0). Reads never wait for
 * writes, so a worker that sends its whole frame before it reads is served
 * as well as one that does both at once. At the first non-finite value no
 * further byte is sent to anyone (averaged bytes already sent cannot be
 * recalled: the caller must close the connections), the streams are still
 * drained, and DDPW_NET_NONFINITE is returned as by ddpw_net_reduce_stream.
 * With st->finish_on_nonfinite the averages, non-finite ones included, keep
 * going out and the call ends as in the finite case, so every reply can be
 * completed and the connections stay in step.
 *
 * Returns DDPW_NET_OK once everything is received and averaged; the sends may
 * still be unfinished then (the bytes after the vector depend on every
 * socket's tail): finish them with ddpw_net_send_many over the iovec
 * [head, out, bytes after the vector] and the same cursors. On a failure
 * *failed is the socket index (a socket owing received bytes is named before
 * one that is only slow to read). With sent == NULL nothing is sent: that is
 * ddpw_net_reduce_stream. */
int ddpw_net_allreduce_stream(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                             uint8_t *tails, const uint8_t *head, size_t head_len,
                             size_t *sent, int timeout_ms, size_t *failed, int *err);

#endif

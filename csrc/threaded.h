/* threaded.h: ddpw_net_allreduce_stream on threads: per socket, one that
 * receives and one that sends.
 *
 * The single poll loop of net.c does every kernel copy of a step (n vectors
 * in, n vectors out) on one core, which caps a coordinator at one core's
 * copy rate however many cores the machine has. Here the copies in and out
 * of each socket run on threads of their own, spread over the cores. The
 * arithmetic is unchanged: an element range is reduced once every socket
 * has delivered it, by whichever receiving thread completes it, summing in
 * socket order and then dividing by n, so the result is bit-identical to
 * the single-threaded loop and to the whole-vector reference.
 *
 * The worker threads block every signal, so a signal (Ctrl-C) interrupts
 * only the caller's ddpw_threaded_wait, which returns DDPW_NET_EINTR and can
 * be called again; ddpw_threaded_stop ends the step early and joins. */
#ifndef DDPW_THREADED_H
#define DDPW_THREADED_H

#include "net.h"

typedef struct ddpw_threaded ddpw_threaded;

/* Start receiving and averaging into out, and sending head + averaged bytes
 * (when sent is not NULL), on every socket of st, with the semantics and
 * arguments of ddpw_net_allreduce_stream. st, links, out, tails, head and sent
 * must stay valid until ddpw_threaded_stop. On success *handle is set. */
int ddpw_threaded_start(ddpw_threaded **handle, ddpw_net_reduce_state *st, ddpw_link *const *links,
                        float *out, uint8_t *tails, const uint8_t *head, size_t head_len,
                        size_t *sent, int timeout_ms, int *err);

/* Wait for every thread to finish; returns what ddpw_net_allreduce_stream
 * would (OK, NONFINITE, or a failure naming *failed), or DDPW_NET_EINTR
 * with the threads still running. */
int ddpw_threaded_wait(ddpw_threaded *h, size_t *failed, int *err);

/* Stop the threads if they still run, join them, release everything. */
void ddpw_threaded_stop(ddpw_threaded *h);

#endif

/* sender.h: one frame sent from a thread of its own.
 *
 * A worker's allreduce sends its gradients while it receives the average.
 * In one poll loop both kernel copies (into the socket, out of it) run on
 * one core, one after the other; with the send on its own thread they run
 * on two at once. The thread blocks every signal, keeps the inactivity
 * timeout of net.h, and stops promptly when asked to, so the caller may
 * close the socket right after ddpw_sender_stop. */
#ifndef DDPW_SENDER_H
#define DDPW_SENDER_H

#include "net.h"

typedef struct ddpw_sender ddpw_sender;

/* Start sending bytes [done, end) of the concatenation of iov[0..iovcnt)
 * (at most 8 entries) on link. iov, the memory it points to and the link must stay
 * valid until ddpw_sender_stop. */
int ddpw_sender_start(ddpw_sender **handle, ddpw_link *link, const struct iovec *iov, int iovcnt,
                      size_t done, int timeout_ms, int *err);

/* Bytes of the concatenation sent so far. */
size_t ddpw_sender_progress(ddpw_sender *h);

/* Wait for the send to end: DDPW_NET_OK once every byte is out, the
 * failure otherwise, or DDPW_NET_EINTR (a signal reached the caller) with
 * the thread still sending: call again. */
int ddpw_sender_wait(ddpw_sender *h, int *err);

/* Stop the thread if it still sends, join it, release everything. */
void ddpw_sender_stop(ddpw_sender *h);

#endif

/* wake.h: a non-blocking pipe that wakes a thread out of poll().
 *
 * The socket threads wait in poll() on their socket and on such a pipe, so
 * another thread can tell them that something changed (more averaged bytes
 * to send, a step called off) without a signal. A pipe rather than an
 * eventfd: it works on macOS as well. */
#ifndef DDPW_WAKE_H
#define DDPW_WAKE_H

/* Open the pipe (both ends non-blocking, close-on-exec): 0, or -1 with errno
 * set and fds[0] == fds[1] == -1. */
int ddpw_wake_open(int fds[2]);

/* Wake whoever polls fds[0]: write a byte to fds[1] (a full pipe already
 * wakes it, so a write that would block is dropped). */
void ddpw_wake_poke(int write_fd);

/* Empty fds[0] after a wake-up, so the next poll() waits again. */
void ddpw_wake_drain(int read_fd);

/* Close both ends that are open. */
void ddpw_wake_close(int fds[2]);

#endif

/* wake.h: what the socket threads (threaded.c, sender.c) share: a
 * non-blocking pipe that wakes a thread out of poll(), the waits built on
 * it, and a thread start that leaves signals to the caller.
 *
 * The socket threads wait in poll() on their socket and on such a pipe, so
 * another thread can tell them that something changed (more averaged bytes
 * to send, a step called off) without a signal. A pipe rather than an
 * eventfd: it works on macOS as well. */
#ifndef DDPW_WAKE_H
#define DDPW_WAKE_H

#include <pthread.h>

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

/* A socket thread's wait: until fd is ready for `events` (none: fd is not
 * watched) or read_fd is poked, which is then drained. 1 ready or woken,
 * 0 on timeout, else DDPW_NET_ERRNO with *err set. */
int ddpw_wake_poll(int fd, short events, int read_fd, int timeout_ms, int *err);

/* The caller's wait for its threads, who poke read_fd as they end: returns
 * after a poke or a second (recheck, then call again), or DDPW_NET_EINTR
 * when a signal arrived (run the handlers, then call again). The threads
 * enforce the timeouts; this only waits for them. */
int ddpw_wake_wait(int read_fd);

/* pthread_create with every signal blocked in the new thread, so signals
 * (Ctrl-C) reach the caller, whose wait they interrupt. */
int ddpw_wake_start_thread(pthread_t *id, void *(*fn)(void *), void *arg);

#endif

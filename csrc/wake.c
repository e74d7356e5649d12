/* wake.c: see wake.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#endif

#include "wake.h"
#include "net.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

int ddpw_wake_open(int fds[2])
{
    int k;
    if (pipe(fds) != 0) {
        fds[0] = fds[1] = -1;
        return -1;
    }
    for (k = 0; k < 2; k++) {
        int fl = fcntl(fds[k], F_GETFL);
        if (fl < 0 || fcntl(fds[k], F_SETFL, fl | O_NONBLOCK) < 0 ||
            fcntl(fds[k], F_SETFD, FD_CLOEXEC) < 0) {
            ddpw_wake_close(fds);
            return -1;
        }
    }
    return 0;
}

void ddpw_wake_poke(int write_fd)
{
    char b = 1;
    ssize_t rc = write(write_fd, &b, 1);
    (void)rc;
}

void ddpw_wake_drain(int read_fd)
{
    char buf[64];
    while (read(read_fd, buf, sizeof buf) > 0) {
    }
}

void ddpw_wake_close(int fds[2])
{
    int k;
    for (k = 0; k < 2; k++) {
        if (fds[k] >= 0)
            close(fds[k]);
        fds[k] = -1;
    }
}

int ddpw_wake_poll(int fd, short events, int read_fd, int timeout_ms, int *err)
{
    struct pollfd p[2];
    int rc;
    p[0].fd = events ? fd : -1;
    p[0].events = events;
    p[0].revents = 0;
    p[1].fd = read_fd;
    p[1].events = POLLIN;
    p[1].revents = 0;
    rc = poll(p, 2, timeout_ms);
    if (rc < 0) {
        if (errno == EINTR)
            return 1; /* look again */
        *err = errno;
        return DDPW_NET_ERRNO;
    }
    if (p[1].revents)
        ddpw_wake_drain(read_fd);
    return rc > 0;
}

int ddpw_wake_wait(int read_fd)
{
    struct pollfd p;
    p.fd = read_fd;
    p.events = POLLIN;
    p.revents = 0;
    if (poll(&p, 1, 1000) < 0 && errno == EINTR)
        return DDPW_NET_EINTR;
    ddpw_wake_drain(read_fd);
    return DDPW_NET_OK;
}

int ddpw_wake_start_thread(pthread_t *id, void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    int rc;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    rc = pthread_create(id, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

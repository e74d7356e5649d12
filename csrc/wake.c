/* wake.c: see wake.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#endif

#include "wake.h"

#include <fcntl.h>
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

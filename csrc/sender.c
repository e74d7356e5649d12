/* sender.c: see sender.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "sender.h"
#include "wake.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>

#define DDPW_SENDER_MAX_IOV 8

struct ddpw_sender {
    ddpw_link *link;
    struct iovec iov[DDPW_SENDER_MAX_IOV];
    int iovcnt;
    size_t total;
    int timeout_ms;
    int wake[2];  /* caller -> thread: stop */
    int ended[2]; /* thread -> caller: finished */
    pthread_t id;
    int started;

    pthread_mutex_t lock; /* guards the fields below */
    size_t done;
    int finished, stop, result, err;
};

static int stopping(struct ddpw_sender *h)
{
    int stop;
    pthread_mutex_lock(&h->lock);
    stop = h->stop;
    pthread_mutex_unlock(&h->lock);
    return stop;
}

static void *sender_main(void *arg)
{
    struct ddpw_sender *h = (struct ddpw_sender *)arg;
    size_t done;
    int rc = DDPW_NET_OK, err = 0;
    pthread_mutex_lock(&h->lock);
    done = h->done;
    pthread_mutex_unlock(&h->lock);
    while (done < h->total && !stopping(h)) {
        rc = ddpw_link_send_some(h->link, h->iov, h->iovcnt, h->total, &done, &err);
        pthread_mutex_lock(&h->lock);
        h->done = done;
        pthread_mutex_unlock(&h->lock);
        if (rc == DDPW_NET_EINTR || rc == 1) {
            rc = DDPW_NET_OK;
            continue;
        }
        if (rc < 0)
            break;
        /* would block: wait for room, or for the caller to call it off */
        rc = ddpw_wake_poll(h->link->fd, POLLOUT, h->wake[0], h->timeout_ms, &err);
        if (rc == 0)
            rc = DDPW_NET_TIMEOUT;
        if (rc < 0)
            break;
        rc = DDPW_NET_OK;
    }
    pthread_mutex_lock(&h->lock);
    h->result = rc;
    h->err = err;
    h->finished = 1;
    pthread_mutex_unlock(&h->lock);
    ddpw_wake_poke(h->ended[1]);
    return NULL;
}

int ddpw_sender_start(ddpw_sender **handle, ddpw_link *link, const struct iovec *iov, int iovcnt,
                      size_t done, int timeout_ms, int *err)
{
    struct ddpw_sender *h;
    int k, rc;
    *handle = NULL;
    if (iovcnt < 0 || iovcnt > DDPW_SENDER_MAX_IOV)
        return DDPW_NET_NOMEM;
    h = (struct ddpw_sender *)calloc(1, sizeof *h);
    if (h == NULL)
        return DDPW_NET_NOMEM;
    h->wake[0] = h->wake[1] = h->ended[0] = h->ended[1] = -1;
    if (pthread_mutex_init(&h->lock, NULL) != 0) {
        free(h);
        return DDPW_NET_NOMEM;
    }
    h->link = link;
    h->iovcnt = iovcnt;
    for (k = 0; k < iovcnt; k++) {
        h->iov[k] = iov[k];
        h->total += iov[k].iov_len;
    }
    h->done = done;
    h->timeout_ms = timeout_ms;
    if (ddpw_wake_open(h->wake) != 0 || ddpw_wake_open(h->ended) != 0) {
        *err = errno;
        ddpw_sender_stop(h);
        return DDPW_NET_ERRNO;
    }
    rc = ddpw_wake_start_thread(&h->id, sender_main, h);
    if (rc != 0) {
        *err = rc;
        ddpw_sender_stop(h);
        return DDPW_NET_ERRNO;
    }
    h->started = 1;
    *handle = h;
    return DDPW_NET_OK;
}

size_t ddpw_sender_progress(ddpw_sender *h)
{
    size_t done;
    pthread_mutex_lock(&h->lock);
    done = h->done;
    pthread_mutex_unlock(&h->lock);
    return done;
}

int ddpw_sender_wait(ddpw_sender *h, int *err)
{
    for (;;) {
        int finished, result;
        pthread_mutex_lock(&h->lock);
        finished = h->finished;
        result = h->result;
        *err = h->err;
        pthread_mutex_unlock(&h->lock);
        if (finished)
            return result;
        if (ddpw_wake_wait(h->ended[0]) == DDPW_NET_EINTR)
            return DDPW_NET_EINTR;
    }
}

void ddpw_sender_stop(ddpw_sender *h)
{
    if (h == NULL)
        return;
    if (h->started) {
        pthread_mutex_lock(&h->lock);
        h->stop = 1;
        pthread_mutex_unlock(&h->lock);
        ddpw_wake_poke(h->wake[1]);
        pthread_join(h->id, NULL);
    }
    ddpw_wake_close(h->wake);
    ddpw_wake_close(h->ended);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

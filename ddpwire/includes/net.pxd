# Declarations mirroring csrc/link.h, csrc/aead.h, csrc/net.h, csrc/threaded.h and
# csrc/sender.h.
from libc.stdint cimport uint8_t, int64_t

cdef extern from "<sys/uio.h>":
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "link.h" nogil:
    ctypedef struct ddpw_link:
        int fd

    size_t DDPW_SEALED_RECORD

    void ddpw_link_plain(ddpw_link *l, int fd)
    int ddpw_link_seal(ddpw_link *l, int fd, const uint8_t *send_key, const uint8_t *recv_key)
    void ddpw_link_release(ddpw_link *l)
    int ddpw_link_sealed(const ddpw_link *l)
    int ddpw_link_peek(ddpw_link *l, void *buf, size_t len, size_t *got, int *err)
    size_t ddpw_link_held(const ddpw_link *l)


cdef extern from "aead.h" nogil:
    enum:
        DDPW_AEAD_KEY_BYTES

    int ddpw_aead_load(const char *path, char *why, size_t why_len)
    int ddpw_aead_ready()


cdef extern from "net.h" nogil:
    ctypedef struct ddpw_finite_watch:
        const uint8_t *base
        size_t len
        size_t checked
        int64_t bad

    enum:
        DDPW_NET_OK
        DDPW_NET_TIMEOUT
        DDPW_NET_EOF
        DDPW_NET_EINTR
        DDPW_NET_ERRNO
        DDPW_NET_NOMEM
        DDPW_NET_NONFINITE
        DDPW_NET_INTEGRITY

    int ddpw_net_recv_exact(ddpw_link *l, void *buf, size_t len, size_t *done,
                           int timeout_ms, int64_t deadline_ms, ddpw_finite_watch *watch,
                           int *err)
    int64_t ddpw_net_now_ms()
    int ddpw_net_send_iov(ddpw_link *l, const iovec *iov, int iovcnt, size_t *done,
                         int timeout_ms, int64_t deadline_ms, int *err)
    int ddpw_net_exchange(ddpw_link *l, const iovec *out_iov, int out_cnt, size_t *sent,
                         const iovec *in_iov, int in_cnt, size_t *received,
                         int timeout_ms, int64_t deadline_ms, ddpw_finite_watch *watch,
                         int *err)
    int ddpw_net_send_many(ddpw_link *const *links, size_t n, const iovec *iov, int iovcnt,
                          size_t *done, int timeout_ms, size_t *failed, int *err)

    enum:
        DDPW_NET_MAX_PEERS

    ctypedef struct ddpw_net_peer_io:
        ddpw_link *link
        const iovec *out_iov
        int out_cnt
        size_t sent
        const iovec *in_iov
        int in_cnt
        size_t received

    int ddpw_net_exchange_many(ddpw_net_peer_io *peers, size_t n, int timeout_ms,
                              int64_t deadline_ms, size_t *failed, int *err)

    size_t DDPW_NET_OWN

    ctypedef struct ddpw_net_kernels:
        int codec
        const float *const *narrow_from
        size_t *narrowed
        float *const *widen_into
        size_t *widened
        size_t k
        size_t count
        const void *const *inputs
        const size_t *from_ "from"
        const float *own_from
        void *out
        int divide
        size_t reduced
        int64_t bad_index
        size_t bad_input

    int ddpw_net_exchange_kernels(ddpw_net_peer_io *peers, size_t n, ddpw_net_kernels *kern,
                                 int timeout_ms, int64_t deadline_ms, size_t *failed, int *err)
    void ddpw_net_set_kernel_chunk(size_t elements)

    ctypedef struct ddpw_net_reduce_state:
        size_t n
        size_t grad_bytes
        size_t tail_len
        size_t ring_bytes
        size_t *recv
        size_t reduced
        uint8_t **rings
        int64_t *bad_index
        float *bad_value
        int nonfinite
        int finish_on_nonfinite
        const float *scales

    int ddpw_net_reduce_init(ddpw_net_reduce_state *st, size_t n, size_t grad_bytes,
                            size_t tail_len, size_t ring_bytes)
    void ddpw_net_reduce_free(ddpw_net_reduce_state *st)
    int ddpw_net_reduce_stream(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                              uint8_t *tails, int timeout_ms, size_t *failed, int *err)
    int ddpw_net_allreduce_stream(ddpw_net_reduce_state *st, ddpw_link *const *links, float *out,
                                 uint8_t *tails, const uint8_t *head, size_t head_len,
                                 size_t *sent, int timeout_ms, size_t *failed, int *err)


cdef extern from "threaded.h" nogil:
    ctypedef struct ddpw_threaded:
        pass

    int ddpw_threaded_start(ddpw_threaded **handle, ddpw_net_reduce_state *st, ddpw_link *const *links,
                            float *out, uint8_t *tails, const uint8_t *head, size_t head_len,
                            size_t *sent, int timeout_ms, int *err)
    int ddpw_threaded_wait(ddpw_threaded *h, size_t *failed, int *err)
    void ddpw_threaded_stop(ddpw_threaded *h)


cdef extern from "sender.h" nogil:
    ctypedef struct ddpw_sender:
        pass

    int ddpw_sender_start(ddpw_sender **handle, ddpw_link *link, const iovec *iov, int iovcnt,
                          size_t done, int timeout_ms, int *err)
    size_t ddpw_sender_progress(ddpw_sender *h)
    int ddpw_sender_wait(ddpw_sender *h, int *err)
    void ddpw_sender_stop(ddpw_sender *h)

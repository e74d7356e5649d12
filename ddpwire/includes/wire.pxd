# Declarations mirroring csrc/wire.h, in its order.
from libc.stdint cimport uint8_t, uint32_t, uint64_t


cdef extern from "wire.h" nogil:
    const unsigned int DDPW_DEFAULT_MAX_FRAME
    const unsigned int DDPW_PREFIX_LEN
    const int DDPW_ALLOW_TRAILING

    ctypedef enum ddpw_tag:
        DDPW_JOIN_REQUEST
        DDPW_JOIN_ACCEPTED
        DDPW_SHARD_ASSIGNMENT
        DDPW_GRADIENT_PAYLOAD
        DDPW_AVERAGED_GRADIENT
        DDPW_HEARTBEAT
        DDPW_SHUTDOWN
        DDPW_BLOCK_GRADIENT_PAYLOAD
        DDPW_AVERAGED_BLOCK_GRADIENT
        DDPW_NON_BLOCK_GRADIENT_PAYLOAD
        DDPW_AVERAGED_NON_BLOCK_GRADIENT

    ctypedef enum ddpw_status:
        DDPW_OK
        DDPW_NEED_MORE
        DDPW_ERR_EMPTY
        DDPW_ERR_UNKNOWN_TAG
        DDPW_ERR_TRUNCATED
        DDPW_ERR_UTF8
        DDPW_ERR_OVERFLOW
        DDPW_ERR_TRAILING
        DDPW_ERR_TOO_LARGE
        DDPW_ERR_VALUE
        DDPW_ERR_BUFFER

    ctypedef struct ddpw_error:
        ddpw_status status
        uint8_t tag
        const char *message_type
        const char *field
        uint64_t have
        uint64_t need
        uint64_t value

    ctypedef struct ddpw_reader:
        const uint8_t *data
        size_t len
        size_t avail
        size_t pos

    ctypedef struct ddpw_writer:
        uint8_t *data
        size_t cap
        size_t pos
        int overflowed

    ctypedef struct ddpw_str:
        const uint8_t *data
        size_t len

    ctypedef struct ddpw_message:
        uint8_t tag
        ddpw_str node_id
        uint32_t gpu_count
        ddpw_str backend
        uint32_t worker_id
        uint32_t total_workers
        uint64_t step
        uint64_t shard_start
        uint64_t shard_end
        uint64_t timestamp_ms
        uint32_t block_idx
        uint32_t num_blocks
        uint8_t component
        const void *component_sizes
        uint32_t component_count
        const void *gradients
        uint64_t gradient_count
        float loss
        uint64_t correct
        uint64_t total
        float global_loss

    ctypedef struct ddpw_head:
        uint8_t tag
        int has_gradients
        uint64_t step
        uint32_t worker_id
        uint32_t block_idx
        uint32_t num_blocks
        uint8_t component
        const uint8_t *component_sizes
        uint32_t component_count
        uint64_t gradient_count
        size_t gradient_offset
        size_t tail_len
        size_t trailing_len
        size_t need

    ctypedef struct ddpw_tail:
        float loss
        uint64_t correct
        uint64_t total
        float global_loss

    const char *ddpw_message_type(uint8_t tag)
    int ddpw_has_gradients(uint8_t tag)
    size_t ddpw_tail_len(uint8_t tag)
    uint32_t ddpw_read_prefix(const uint8_t *p)
    ddpw_status ddpw_check_frame_len(uint64_t payload_len, uint64_t max_frame, ddpw_error *err)
    ddpw_status ddpw_decode_payload(const uint8_t *p, size_t len, int flags,
                                    ddpw_message *msg, ddpw_error *err)
    ddpw_status ddpw_decode_head(const uint8_t *p, size_t avail, size_t payload_len, int flags,
                                 ddpw_head *head, ddpw_error *err)
    ddpw_status ddpw_decode_tail(uint8_t tag, const uint8_t *p, size_t avail,
                                 ddpw_tail *tail, ddpw_error *err)
    void ddpw_load_u32s(const uint8_t *src, size_t count, uint32_t *dst)
    ddpw_status ddpw_payload_size(const ddpw_message *msg, uint64_t *size, ddpw_error *err)
    size_t ddpw_head_size(const ddpw_message *msg)
    ddpw_status ddpw_encode_frame(const ddpw_message *msg, uint8_t *out, size_t cap,
                                  size_t *written, ddpw_error *err)
    ddpw_status ddpw_encode_head(const ddpw_message *msg, uint8_t *out, size_t cap,
                                 size_t *written, ddpw_error *err)
    ddpw_status ddpw_encode_tail(const ddpw_message *msg, uint8_t *out, size_t cap,
                                 size_t *written, ddpw_error *err)
    double ddpw_f32_to_f64(float f)
    float ddpw_f64_to_f32(double d)

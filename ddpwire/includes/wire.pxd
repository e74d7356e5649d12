# Declarations mirroring csrc/wire.h, in its order.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "wire.h" nogil:
    const unsigned int DDPW_DEFAULT_MAX_FRAME
    const unsigned int DDPW_PREFIX_LEN
    const int DDPW_ALLOW_TRAILING
    const unsigned int DDPW_EXT_MAGIC_LEN
    const unsigned int DDPW_EXT_VERSION
    const unsigned int DDPW_EXT_HEADER_LEN
    const unsigned int DDPW_EXT_ENTRY_HEADER_LEN
    const unsigned int DDPW_EXT_MAX_ENTRIES
    const unsigned int DDPW_EXT_MAX_BLOCK
    const unsigned int DDPW_AUTH_BYTES
    const unsigned int DDPW_SMALL_MAX_PAYLOAD

    # The tags are messages.def's; Cython names only those it uses, and
    # walks the layouts below for the rest.
    ctypedef enum ddpw_tag:
        DDPW_HEARTBEAT
        DDPW_STEP_TIMING

    ctypedef enum ddpw_wire_type:
        DDPW_WT_U8
        DDPW_WT_U16
        DDPW_WT_U32
        DDPW_WT_U64
        DDPW_WT_F32
        DDPW_WT_STRING
        DDPW_WT_BYTES32
        DDPW_WT_U32LIST
        DDPW_WT_F32VEC
        DDPW_WT_BYTES

    ctypedef enum ddpw_rule:
        DDPW_RULE_NONE
        DDPW_RULE_CODEC
        DDPW_RULE_FLAG
        DDPW_RULE_SCALE
        DDPW_RULE_DTYPE
        DDPW_RULE_COUNT_OF_DTYPE
        DDPW_RULE_WITHIN_TOTAL
        DDPW_RULE_LAST

    ctypedef struct ddpw_field:
        const char *name
        const char *count_name
        uint8_t type
        uint8_t rule
        uint16_t offset

    ctypedef struct ddpw_layout:
        uint8_t tag
        uint8_t extensible
        uint8_t field_count
        const char *name
        const char *direction
        const char *doc
        const ddpw_field *fields

    ctypedef enum ddpw_code_family:
        DDPW_CODES_EXTENSION
        DDPW_CODES_REFUSAL
        DDPW_CODES_COLLECTIVE_KIND
        DDPW_CODES_REDUCE_OP
        DDPW_CODES_DTYPE
        DDPW_CODES_CODEC

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
        DDPW_ERR_INVALID
        DDPW_ERR_MISMATCH
        DDPW_ERR_INVALID_F32

    ctypedef struct ddpw_error:
        ddpw_status status
        uint8_t tag
        const char *message_type
        const char *field
        uint64_t have
        uint64_t need
        uint64_t value
        const char *detail

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

    ctypedef struct ddpw_span:
        const void *data
        uint64_t count

    ctypedef struct ddpw_ext_entry:
        uint16_t type
        uint32_t len
        const uint8_t *value

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
        ddpw_span component_sizes
        ddpw_span gradients
        float loss
        uint64_t correct
        uint64_t total
        float global_loss
        int has_ext
        uint16_t ext_count
        const ddpw_ext_entry *ext_entries
        const uint8_t *ext_block
        size_t ext_block_len
        const uint8_t *nonce
        const uint8_t *proof
        const uint8_t *digest
        const uint8_t *key
        uint8_t reason
        ddpw_str detail
        uint64_t seq
        uint8_t kind
        uint8_t op
        uint8_t dtype
        uint32_t root
        uint64_t count
        ddpw_span data
        uint8_t codec
        uint8_t shared_memory
        uint16_t coordinator_share
        ddpw_str peers
        uint32_t bad_worker
        uint64_t bad_index
        float bad_value
        uint64_t compute_us
        float scale

    ctypedef struct ddpw_head:
        ddpw_message msg
        int has_gradients
        int has_bulk
        size_t bulk_offset
        uint64_t bulk_len
        size_t tail_len
        size_t trailing_len
        size_t need

    const char *ddpw_message_type(uint8_t tag)
    unsigned ddpw_layout_bulk(const ddpw_layout *layout)
    const ddpw_layout *ddpw_layout_at(size_t i)
    const char *ddpw_wire_type_name(unsigned type)
    const char *ddpw_rule_name(unsigned rule)
    size_t ddpw_dtype_size(uint8_t dtype)
    const char *ddpw_code_name(ddpw_code_family family, unsigned value)
    uint64_t ddpw_tag_max_payload(uint8_t tag, uint64_t max_frame)
    int ddpw_ext_next(const uint8_t *block, size_t block_len, size_t *pos, ddpw_ext_entry *entry)
    size_t ddpw_tail_len(uint8_t tag)
    uint32_t ddpw_read_prefix(const uint8_t *p)
    ddpw_status ddpw_check_frame_len(uint64_t payload_len, uint64_t max_frame, ddpw_error *err)
    ddpw_status ddpw_decode_payload(const uint8_t *p, size_t len, int flags,
                                    ddpw_message *msg, ddpw_error *err)
    ddpw_status ddpw_decode_head(const uint8_t *p, size_t avail, size_t payload_len, int flags,
                                 ddpw_head *head, ddpw_error *err)
    ddpw_status ddpw_decode_tail(uint8_t tag, const uint8_t *p, size_t avail,
                                 ddpw_message *msg, ddpw_error *err)
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

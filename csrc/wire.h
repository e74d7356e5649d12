/*
 * wire.h: the DDP wire protocol's frame header and the body layout of its
 * eleven messages, in plain C99.
 *
 * Frame   = u32 BIG-endian payload length, then the payload.
 * Payload = u8 tag, then the body; every body field is LITTLE-endian.
 *
 * Nothing here allocates. Decoders return pointers into the caller's buffer
 * (strings, component sizes, gradient elements); encoders write into a
 * caller buffer whose size they compute first. Every read is bounds-checked
 * against both the payload length and the bytes received so far, and every
 * length is checked for overflow before it is used.
 */
#ifndef DDPWIRE_WIRE_H
#define DDPWIRE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The reference implementation refuses payloads longer than this. */
#define DDPW_DEFAULT_MAX_FRAME 100000000u
/* Bytes in the big-endian length prefix. */
#define DDPW_PREFIX_LEN 4u

/* Every message's tag, from messages.def: DDPW_JOIN_REQUEST = 0x01, ... */
typedef enum ddpw_tag {
#define DDPW_F(type, name, member, rule)
#define DDPW_MESSAGE(tag, ENUM, Class, direction, extensible, fields, doc) DDPW_##ENUM = tag,
#include "messages.def"
#undef DDPW_MESSAGE
#undef DDPW_F
} ddpw_tag;

/* A field's type on the wire (messages.def), and its name in errors and
 * in messages.LAYOUTS: X(ENUM, value, name). Numbers and f32 are
 * little-endian. One list, from which the enum and the names are made.
 *   STRING:  u32 byte count, then UTF-8
 *   BYTES32: DDPW_AUTH_BYTES raw bytes
 *   U32LIST: u32 count, then u32 elements
 *   F32VEC:  u64 count, then float32 elements: a bulk
 *   BYTES:   u64 byte count, then the bytes: a bulk */
#define DDPW_WIRE_TYPES(X)                                                     \
    X(U8, 0, "u8")                                                             \
    X(U16, 1, "u16")                                                           \
    X(U32, 2, "u32")                                                           \
    X(U64, 3, "u64")                                                           \
    X(F32, 4, "f32")                                                           \
    X(STRING, 5, "string")                                                     \
    X(BYTES32, 6, "bytes32")                                                   \
    X(U32LIST, 7, "u32list")                                                   \
    X(F32VEC, 8, "f32vec")                                                     \
    X(BYTES, 9, "bytes")

typedef enum ddpw_wire_type {
#define DDPW_WT_ENUM(ENUM, value, name) DDPW_WT_##ENUM = value,
    DDPW_WIRE_TYPES(DDPW_WT_ENUM)
#undef DDPW_WT_ENUM
} ddpw_wire_type;

/* What a field's value may be (messages.def): a decoder refuses, and an
 * encoder will not write, anything else. X(ENUM, value, name), as above.
 *   CODEC:          a known ddpw_codec
 *   FLAG:           0 or 1
 *   SCALE:          f32, finite and >= 0
 *   DTYPE:          a known ddpw_dtype
 *   COUNT_OF_DTYPE: bytes: exactly `count` elements of `dtype`
 *   WITHIN_TOTAL:   bytes: no more than `total`
 *   LAST:           no rule on the wire; the Python class takes the field
 *                   last, with a default of 0 */
#define DDPW_RULES(X)                                                          \
    X(NONE, 0, "none")                                                         \
    X(CODEC, 1, "codec")                                                       \
    X(FLAG, 2, "flag")                                                         \
    X(SCALE, 3, "scale")                                                       \
    X(DTYPE, 4, "dtype")                                                       \
    X(COUNT_OF_DTYPE, 5, "count_of_dtype")                                     \
    X(WITHIN_TOTAL, 6, "within_total")                                         \
    X(LAST, 7, "last")

typedef enum ddpw_rule {
#define DDPW_RULE_ENUM(ENUM, value, name) DDPW_RULE_##ENUM = value,
    DDPW_RULES(DDPW_RULE_ENUM)
#undef DDPW_RULE_ENUM
} ddpw_rule;

/* One field of a message: its name, the name its count or length goes by
 * in errors ("node_id length"; NULL for a fixed-size field), its
 * ddpw_wire_type and ddpw_rule, and where ddpw_message holds it. */
typedef struct ddpw_field {
    const char *name;
    const char *count_name;
    uint8_t type;
    uint8_t rule;
    uint16_t offset;
} ddpw_field;

/* One message of messages.def: `fields` holds field_count entries in wire
 * order; `extensible` is 1 where the extension block may follow them. */
typedef struct ddpw_layout {
    uint8_t tag;
    uint8_t extensible;
    uint8_t field_count;
    const char *name;
    const char *direction;
    const char *doc;
    const ddpw_field *fields;
} ddpw_layout;

/* The extension block that may follow the last field of JoinRequest and
 * JoinAccepted: magic "DDPX", u8 version, u16 LE entry count, then entries
 * of u16 LE type, u32 LE length, value. */
#define DDPW_EXT_MAGIC "DDPX"
#define DDPW_EXT_MAGIC_LEN 4u
#define DDPW_EXT_VERSION 1u
#define DDPW_EXT_HEADER_LEN 7u       /* magic, version, count */
#define DDPW_EXT_ENTRY_HEADER_LEN 6u /* type, length */
#define DDPW_EXT_MAX_ENTRIES 64u
#define DDPW_EXT_MAX_BLOCK 4096u     /* whole block, header included */
/* Both auth messages carry fixed-size nonces and HMAC-SHA256 proofs. */
#define DDPW_AUTH_BYTES 32u
/* Limit for the payload of a small variable-size message (ddpw_tag_max_payload). */
#define DDPW_SMALL_MAX_PAYLOAD 65536u

/* The codes of codes.def, one enum a family. */
#define DDPW_EXT(name, ENUM, value) DDPW_EXT_##ENUM = value,
typedef enum ddpw_ext_type {
#include "codes.def"
} ddpw_ext_type;

#define DDPW_REFUSAL(name, ENUM, value) DDPW_REFUSED_##ENUM = value,
typedef enum ddpw_refusal {
#include "codes.def"
} ddpw_refusal;

#define DDPW_KIND(name, ENUM, value) DDPW_COLLECTIVE_##ENUM = value,
typedef enum ddpw_collective_kind {
#include "codes.def"
} ddpw_collective_kind;

#define DDPW_OP(name, ENUM, value) DDPW_OP_##ENUM = value,
typedef enum ddpw_reduce_op {
#include "codes.def"
} ddpw_reduce_op;

#define DDPW_DTYPE(name, ENUM, value, size) DDPW_DTYPE_##ENUM = value,
typedef enum ddpw_dtype {
#include "codes.def"
} ddpw_dtype;

/* MeshPeers.codec: how gradient slices travel between mesh peers. */
#define DDPW_CODEC(name, ENUM, value) DDPW_CODEC_##ENUM = value,
typedef enum ddpw_codec {
#include "codes.def"
} ddpw_codec;

/* The SEAL entry's value both ways: an X25519 public key. */
#define DDPW_SEAL_PUBLIC_BYTES 32u

/* StepReport.bad_worker / StepCommit.bad_worker when nothing is wrong. */
#define DDPW_NO_WORKER 0xFFFFFFFFu

/* Families of codes, for ddpw_code_name. */
typedef enum ddpw_code_family {
    DDPW_CODES_EXTENSION = 0,
    DDPW_CODES_REFUSAL = 1,
    DDPW_CODES_COLLECTIVE_KIND = 2,
    DDPW_CODES_REDUCE_OP = 3,
    DDPW_CODES_DTYPE = 4,
    DDPW_CODES_CODEC = 5
} ddpw_code_family;

typedef enum ddpw_status {
    DDPW_OK = 0,
    /* Not an error: the bytes received so far end inside the head; read
     * until `need` bytes of the payload are there, then call again. */
    DDPW_NEED_MORE = 1,
    DDPW_ERR_EMPTY = -1,         /* zero-length payload */
    DDPW_ERR_UNKNOWN_TAG = -2,   /* error.tag holds it */
    DDPW_ERR_TRUNCATED = -3,     /* field ends past the payload: have/need bytes */
    DDPW_ERR_UTF8 = -4,          /* field invalid at byte `have` of `need` */
    DDPW_ERR_OVERFLOW = -5,      /* element count `value` has no byte length in range */
    DDPW_ERR_TRAILING = -6,      /* `have` payload bytes, the last field ends at `need` */
    DDPW_ERR_TOO_LARGE = -7,     /* payload length `have` exceeds the limit `need` */
    DDPW_ERR_VALUE = -8,         /* encoding: field `value` does not fit its wire type */
    DDPW_ERR_BUFFER = -9,        /* encoding: caller buffer of `have` bytes, `need` required */
    DDPW_ERR_INVALID = -10,      /* field holds `value`, which `detail` says is not allowed */
    DDPW_ERR_MISMATCH = -11,     /* field is `have` bytes long, its other fields say `need` */
    DDPW_ERR_INVALID_F32 = -12   /* f32 field whose bits are `value`, which `detail` says is
                                    not allowed */
} ddpw_status;

/* Set by every call that fails, so the caller can say which message, which
 * field, and by how much. message_type and field are static strings (or NULL
 * where not known: an empty payload, an unknown tag). */
typedef struct ddpw_error {
    ddpw_status status;
    uint8_t tag;
    const char *message_type;
    const char *field;
    uint64_t have;
    uint64_t need;
    uint64_t value;
    const char *detail;          /* DDPW_ERR_INVALID(_F32): why; DDPW_ERR_VALUE: the unit, or NULL
                                    for bytes */
} ddpw_error;

/* Explicit cursors. `len` is where the payload ends (reading past it is
 * truncation); `avail` is how much of it has arrived (reading past that asks
 * for more). A whole-buffer reader has avail == len. */
typedef struct ddpw_reader {
    const uint8_t *data;
    size_t len;
    size_t avail;
    size_t pos;
} ddpw_reader;

/* A write that would pass `cap` writes nothing and sets `overflowed`, so a
 * sequence of writes is checked once at its end. */
typedef struct ddpw_writer {
    uint8_t *data;
    size_t cap;
    size_t pos;
    int overflowed;
} ddpw_writer;

/* A UTF-8 string field: `len` bytes at `data` (not NUL-terminated). */
typedef struct ddpw_str {
    const uint8_t *data;
    size_t len;
} ddpw_str;

/* A run of elements: `count` of them at `data`. */
typedef struct ddpw_span {
    const void *data;
    uint64_t count;
} ddpw_span;

/* One entry of an extension block. */
typedef struct ddpw_ext_entry {
    uint16_t type;
    uint32_t len;
    const uint8_t *value;
} ddpw_ext_entry;

/* Every field of every message, flat; `tag` says which are meaningful, and
 * messages.def which member holds which message's field.
 *
 * gradients and component_sizes hold binary32 and u32 values. After
 * decoding they point into the payload, in wire order (little-endian,
 * possibly unaligned). For encoding they point to the caller's values in
 * host order (float / uint32_t). On a little-endian host the two are the
 * same bytes. data's count is in bytes. */
typedef struct ddpw_message {
    uint8_t tag;
    ddpw_str node_id;
    uint32_t gpu_count;
    ddpw_str backend;
    uint32_t worker_id;
    uint32_t total_workers;    /* also StepAborted.workers */
    uint64_t step;
    uint64_t shard_start;
    uint64_t shard_end;
    uint64_t timestamp_ms;
    uint32_t block_idx;
    uint32_t num_blocks;
    uint8_t component;
    ddpw_span component_sizes;
    ddpw_span gradients;
    float loss;
    uint64_t correct;
    uint64_t total;            /* ModelState: the whole state's bytes */
    float global_loss;
    /* Extension block (messages.def's extensible ones). has_ext == 0: no
     * block. Decoded: ext_block points at the block's first entry,
     * ext_block_len bytes of entries follow (walk them with ddpw_ext_next);
     * ext_entries is NULL. Encoding: ext_entries holds ext_count entries. */
    int has_ext;
    uint16_t ext_count;
    const ddpw_ext_entry *ext_entries;
    const uint8_t *ext_block;
    size_t ext_block_len;
    const uint8_t *nonce;      /* these five: DDPW_AUTH_BYTES bytes */
    const uint8_t *proof;
    const uint8_t *digest;     /* SHA-256 of the whole state */
    const uint8_t *key;
    uint8_t reason;
    ddpw_str detail;
    uint64_t seq;
    uint8_t kind;
    uint8_t op;
    uint8_t dtype;
    uint32_t root;
    uint64_t count;            /* elements (data.count is bytes) */
    ddpw_span data;
    uint8_t codec;
    uint8_t shared_memory;     /* 1 when the mesh's data plane is shared memory */
    uint16_t coordinator_share; /* the coordinator averages the last count * share >> 16
                                 * elements of a linked step (0: the workers all of it) */
    ddpw_str peers;            /* "host:port" per worker, comma-separated */
    uint32_t bad_worker;       /* DDPW_NO_WORKER when none */
    uint64_t bad_index;        /* element of the whole vector */
    float bad_value;
    uint64_t compute_us;       /* from the step's ShardAssignment to its first gradient byte */
    float scale;
} ddpw_message;

/* What precedes the bulk of a payload (gradient elements, a collective's
 * or a state's data), for a reader that receives the bulk straight into its
 * final buffer. */
typedef struct ddpw_head {
    /* The fields before the bulk, and the bulk's count (gradients.count,
     * data.count); pointers point into the payload. A message without a
     * bulk has only its tag here: decode it whole. */
    ddpw_message msg;
    int has_gradients;         /* the bulk is gradients (and has_bulk is 1) */
    int has_bulk;              /* the bulk is gradients or data */
    size_t bulk_offset;        /* payload offset of the first bulk byte */
    uint64_t bulk_len;         /* bulk bytes */
    size_t tail_len;           /* bytes of the fields after the bulk (ddpw_tail_len) */
    size_t trailing_len;       /* bytes after the last field (only with DDPW_ALLOW_TRAILING) */
    size_t need;               /* with DDPW_NEED_MORE: payload bytes needed to go on */
} ddpw_head;

/* Decoder flag: accept bytes after the last field, as the reference does. */
#define DDPW_ALLOW_TRAILING 1

/* Name of a message type ("GradientPayload"), or NULL for an unknown tag. */
const char *ddpw_message_type(uint8_t tag);

/* Index of the layout's bulk field (F32VEC or BYTES), or field_count where
 * it has none. */
unsigned ddpw_layout_bulk(const ddpw_layout *layout);

/* The i-th layout of messages.def (tag order), or NULL past the last. */
const ddpw_layout *ddpw_layout_at(size_t i);

/* Lower-case name of a wire type ("u32", "string", "f32vec") or rule
 * ("codec", "last"), or NULL for an unknown one. */
const char *ddpw_wire_type_name(unsigned type);
const char *ddpw_rule_name(unsigned rule);

/* Bytes per element of a collective dtype, 0 for an unknown code. */
size_t ddpw_dtype_size(uint8_t dtype);

/* Lower-case name of a code ("auth", "full", "allreduce", "sum", "float32"),
 * or NULL where the family has no such code. */
const char *ddpw_code_name(ddpw_code_family family, unsigned value);

/* The most payload bytes (tag included) a frame with this tag may carry:
 * the exact size of a fixed-size message, DDPW_SMALL_MAX_PAYLOAD for a small
 * variable one, max_frame for a bulk one, 0 for an unknown tag. Lets a reader
 * refuse a frame from its first five bytes, before allocating its payload. */
uint64_t ddpw_tag_max_payload(uint8_t tag, uint64_t max_frame);

/* Walk the entries of a decoded (so already checked) block: *pos starts at
 * 0; returns 1 and fills *entry while entries remain, 0 after the last. */
int ddpw_ext_next(const uint8_t *block, size_t block_len, size_t *pos, ddpw_ext_entry *entry);

/* Bytes of the fields after the bulk for this tag: 20 (GradientPayload), 4
 * (AveragedGradient), else 0. */
size_t ddpw_tail_len(uint8_t tag);

/* The big-endian length prefix at p[0..4). */
uint32_t ddpw_read_prefix(const uint8_t *p);

/* DDPW_OK when a frame announcing `payload_len` bytes may be read under
 * `max_frame`; DDPW_ERR_EMPTY or DDPW_ERR_TOO_LARGE otherwise. */
ddpw_status ddpw_check_frame_len(uint64_t payload_len, uint64_t max_frame, ddpw_error *err);

/* Decode a whole payload (tag + body) of `len` bytes. Pointers in *msg point
 * into p. Trailing bytes are an error unless flags has DDPW_ALLOW_TRAILING. */
ddpw_status ddpw_decode_payload(const uint8_t *p, size_t len, int flags,
                                ddpw_message *msg, ddpw_error *err);

/* Decode the part of a payload of `payload_len` bytes that precedes its
 * bulk, from the first `avail` bytes received at p.
 * DDPW_NEED_MORE: head->need payload bytes are needed before trying again.
 * DDPW_OK with has_bulk == 0: a message without a bulk (only the tag was
 * read): decode it whole with ddpw_decode_payload.
 * DDPW_OK with has_bulk == 1: every field before the bulk is in head->msg,
 * and bulk_offset + bulk_len + tail_len (+ trailing_len) equals
 * payload_len; anything else is an error, found before the bulk arrives. */
ddpw_status ddpw_decode_head(const uint8_t *p, size_t avail, size_t payload_len, int flags,
                             ddpw_head *head, ddpw_error *err);

/* Decode the fields after the bulk of a message with this tag (its tail)
 * from `avail` bytes at p, which points just past the bulk, into msg's
 * members for them (msg's other members are left as they are). */
ddpw_status ddpw_decode_tail(uint8_t tag, const uint8_t *p, size_t avail,
                             ddpw_message *msg, ddpw_error *err);

/* Copy `count` little-endian u32 at src into host-order values at dst. */
void ddpw_load_u32s(const uint8_t *src, size_t count, uint32_t *dst);

/* Payload size of msg (tag included), without the prefix; DDPW_ERR_TOO_LARGE
 * when it cannot be framed (over 2^32 - 1 bytes). */
ddpw_status ddpw_payload_size(const ddpw_message *msg, uint64_t *size, ddpw_error *err);

/* Bytes of the frame before the bulk field (gradient elements, collective
 * data): prefix + head fields. For a message without one this is the whole
 * frame. */
size_t ddpw_head_size(const ddpw_message *msg);

/* Write the whole frame (prefix included) into out[0..cap). */
ddpw_status ddpw_encode_frame(const ddpw_message *msg, uint8_t *out, size_t cap,
                              size_t *written, ddpw_error *err);

/* Write prefix + head fields into out[0..cap); the prefix counts the whole
 * payload, gradients and tail included. */
ddpw_status ddpw_encode_head(const ddpw_message *msg, uint8_t *out, size_t cap,
                             size_t *written, ddpw_error *err);

/* Write the fields after the gradients (ddpw_tail_len(msg->tag) bytes). */
ddpw_status ddpw_encode_tail(const ddpw_message *msg, uint8_t *out, size_t cap,
                             size_t *written, ddpw_error *err);

/* Bit-exact conversions between binary32 and the double a host language
 * holds: NaN sign and payload survive both ways (a plain cast may quiet a
 * signalling NaN); other values widen exactly and narrow by rounding. */
double ddpw_f32_to_f64(float f);
float ddpw_f64_to_f32(double d);

#ifdef __cplusplus
}
#endif

#endif /* DDPWIRE_WIRE_H */

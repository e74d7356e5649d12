/*
 * wire.c: see wire.h. Plain C99, no allocation, no dependency beyond libc.
 */
#include "wire.h"

#include <float.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* Message table                                                       */
/* ------------------------------------------------------------------ */

static const char *const TYPE_NAMES[12] = {
    NULL,
    "JoinRequest",
    "JoinAccepted",
    "ShardAssignment",
    "GradientPayload",
    "AveragedGradient",
    "Heartbeat",
    "Shutdown",
    "BlockGradientPayload",
    "AveragedBlockGradient",
    "NonBlockGradientPayload",
    "AveragedNonBlockGradient",
};

static const char *const EXT_TYPE_NAMES[15] = {
    "AuthChallenge",
    "AuthProof",
    "JoinRefused",
    "CollectiveRequest",
    "CollectiveResult",
    "CollectiveError",
    "MeshPeers",
    "PeerHello",
    "StepReport",
    "StepCommit",
    "StepTiming",
    "ShardScale",
    "StepAborted",
    "StateRequest",
    "ModelState",
};

const char *ddpw_message_type(uint8_t tag)
{
    if (tag < 12)
        return TYPE_NAMES[tag];
    if (tag >= DDPW_AUTH_CHALLENGE && tag <= DDPW_MODEL_STATE)
        return EXT_TYPE_NAMES[tag - DDPW_AUTH_CHALLENGE];
    return NULL;
}

static int is_collective_bulk(uint8_t tag)
{
    return tag == DDPW_COLLECTIVE_REQUEST || tag == DDPW_COLLECTIVE_RESULT;
}

int ddpw_has_bulk(uint8_t tag)
{
    return ddpw_has_gradients(tag) || is_collective_bulk(tag) || tag == DDPW_MODEL_STATE;
}

/* Indexed by code; NULL marks a gap. One table per family keeps each code's
 * name next to nothing but its number, and its length is its bound. */
#define COUNT(table) (sizeof (table) / sizeof *(table))
static const char *const REFUSAL_NAMES[] = {
    NULL, "full", "training", "auth_required", "auth_failed", "mismatch", "protocol",
};
static const char *const KIND_NAMES[] = {
    NULL, "allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "send",
};
static const char *const OP_NAMES[] = {"sum", "avg", "min", "max", "product"};
static const char *const DTYPE_NAMES[] = {
    "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool", "int8",
};
static const uint8_t DTYPE_SIZES[] = {4, 8, 2, 2, 4, 8, 1, 1, 1};
static const char *const CODEC_NAMES[] = {"float32", "bf16", "fp16", "int8"};

size_t ddpw_dtype_size(uint8_t dtype)
{
    return dtype < COUNT(DTYPE_SIZES) ? DTYPE_SIZES[dtype] : 0;
}

const char *ddpw_code_name(ddpw_code_family family, unsigned value)
{
    switch (family) {
    case DDPW_CODES_EXTENSION:
        if (value == DDPW_EXT_AUTH)
            return "auth";
        if (value == DDPW_EXT_SAMPLES)
            return "samples";
        if (value == DDPW_EXT_COLLECTIVES)
            return "collectives";
        if (value == DDPW_EXT_MESH)
            return "mesh";
        if (value == DDPW_EXT_PER_BLOCK)
            return "per_block";
        if (value == DDPW_EXT_GRADIENT_LENGTH)
            return "gradient_length";
        if (value == DDPW_EXT_STEPS)
            return "steps";
        if (value == DDPW_EXT_BALANCE)
            return "balance";
        if (value == DDPW_EXT_ELASTIC)
            return "elastic";
        if (value == DDPW_EXT_SEAL)
            return "seal";
        return NULL;
    case DDPW_CODES_REFUSAL:
        return value < COUNT(REFUSAL_NAMES) ? REFUSAL_NAMES[value] : NULL;
    case DDPW_CODES_COLLECTIVE_KIND:
        return value < COUNT(KIND_NAMES) ? KIND_NAMES[value] : NULL;
    case DDPW_CODES_REDUCE_OP:
        return value < COUNT(OP_NAMES) ? OP_NAMES[value] : NULL;
    case DDPW_CODES_DTYPE:
        return value < COUNT(DTYPE_NAMES) ? DTYPE_NAMES[value] : NULL;
    case DDPW_CODES_CODEC:
        return value < COUNT(CODEC_NAMES) ? CODEC_NAMES[value] : NULL;
    }
    return NULL;
}

uint64_t ddpw_tag_max_payload(uint8_t tag, uint64_t max_frame)
{
    switch (tag) {
    case DDPW_SHARD_ASSIGNMENT:
        return 1 + 8 + 8 + 8;
    case DDPW_SHUTDOWN:
        return 1;
    case DDPW_AUTH_CHALLENGE:
        return 1 + 2 * DDPW_AUTH_BYTES;
    case DDPW_AUTH_PROOF:
        return 1 + DDPW_AUTH_BYTES;
    case DDPW_PEER_HELLO:
        return 1 + 4 + DDPW_AUTH_BYTES;
    case DDPW_STEP_REPORT:
        return 1 + 8 + 4 + 8 + 4 + 8 + 8 + 4 + 8 + 4;
    case DDPW_STEP_COMMIT:
        return 1 + 8 + 4 + 4 + 8 + 4;
    case DDPW_STEP_TIMING:
        return 1 + 8 + 8;
    case DDPW_SHARD_SCALE:
        return 1 + 8 + 4;
    case DDPW_STEP_ABORTED:
        return 1 + 8 + 4 + 4;
    case DDPW_STATE_REQUEST:
        return 1 + 8;
    case DDPW_MESH_PEERS:
    case DDPW_JOIN_REQUEST:
    case DDPW_JOIN_ACCEPTED:
    case DDPW_HEARTBEAT:
    case DDPW_JOIN_REFUSED:
    case DDPW_COLLECTIVE_ERROR:
        return DDPW_SMALL_MAX_PAYLOAD;
    default:
        return ddpw_has_bulk(tag) ? max_frame : 0;
    }
}

int ddpw_has_gradients(uint8_t tag)
{
    switch (tag) {
    case DDPW_GRADIENT_PAYLOAD:
    case DDPW_AVERAGED_GRADIENT:
    case DDPW_BLOCK_GRADIENT_PAYLOAD:
    case DDPW_AVERAGED_BLOCK_GRADIENT:
    case DDPW_NON_BLOCK_GRADIENT_PAYLOAD:
    case DDPW_AVERAGED_NON_BLOCK_GRADIENT:
        return 1;
    default:
        return 0;
    }
}

size_t ddpw_tail_len(uint8_t tag)
{
    if (tag == DDPW_GRADIENT_PAYLOAD)
        return 4 + 8 + 8; /* loss, correct, total */
    if (tag == DDPW_AVERAGED_GRADIENT)
        return 4; /* global_loss */
    return 0;
}

/* ------------------------------------------------------------------ */
/* Byte order                                                          */
/* ------------------------------------------------------------------ */

/* A run-time test the compiler folds to a constant; C99 has no portable
 * compile-time one. */
static int host_is_little_endian(void)
{
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

static uint32_t load_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint16_t load_u16le(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint64_t load_u64le(const uint8_t *p)
{
    return (uint64_t)load_u32le(p) | ((uint64_t)load_u32le(p + 4) << 32);
}

static float load_f32le(const uint8_t *p)
{
    const uint32_t bits = load_u32le(p);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void store_u32le(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void store_u16le(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void store_u64le(uint8_t *p, uint64_t v)
{
    store_u32le(p, (uint32_t)v);
    store_u32le(p + 4, (uint32_t)(v >> 32));
}

uint32_t ddpw_read_prefix(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) |
           (uint32_t)p[3];
}

void ddpw_load_u32s(const uint8_t *src, size_t count, uint32_t *dst)
{
    size_t i;
    if (host_is_little_endian()) {
        memcpy(dst, src, count * 4);
        return;
    }
    for (i = 0; i < count; i++)
        dst[i] = load_u32le(src + 4 * i);
}

/* ------------------------------------------------------------------ */
/* Floats                                                              */
/* ------------------------------------------------------------------ */

double ddpw_f32_to_f64(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0) {
        /* Place the NaN payload in the top mantissa bits by hand: a
         * conversion instruction would set the quiet bit. */
        const uint64_t d = ((uint64_t)(b & 0x80000000u) << 32) | 0x7ff0000000000000ull |
                           ((uint64_t)(b & 0x007fffffu) << 29);
        double out;
        memcpy(&out, &d, 8);
        return out;
    }
    return (double)f;
}

float ddpw_f64_to_f32(double d)
{
    uint64_t b;
    uint32_t f;
    float out;
    const double round_to_inf = (double)FLT_MAX + 0x1p103; /* FLT_MAX + half an ulp */
    memcpy(&b, &d, 8);
    if ((b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) {
        uint32_t mantissa = (uint32_t)((b & 0x000fffffffffffffull) >> 29);
        if ((b & 0x000fffffffffffffull) != 0 && mantissa == 0)
            mantissa = 0x00400000u; /* payload only in dropped bits: still a NaN */
        f = (uint32_t)((b >> 32) & 0x80000000u) | 0x7f800000u | mantissa;
        memcpy(&out, &f, 4);
        return out;
    }
    /* Out-of-range conversion is undefined in C99, so round to the
     * largest finite value or to infinity here. */
    if (d >= round_to_inf || d <= -round_to_inf) {
        f = (uint32_t)((b >> 32) & 0x80000000u) | 0x7f800000u;
        memcpy(&out, &f, 4);
        return out;
    }
    if (d > (double)FLT_MAX)
        return FLT_MAX;
    if (d < -(double)FLT_MAX)
        return -FLT_MAX;
    return (float)d;
}

/* ------------------------------------------------------------------ */
/* Errors                                                              */
/* ------------------------------------------------------------------ */

static ddpw_status fail(ddpw_error *err, ddpw_status status, const char *type,
                        const char *field, uint64_t have, uint64_t need)
{
    err->status = status;
    err->message_type = type;
    err->field = field;
    err->have = have;
    err->need = need;
    err->detail = NULL;
    return status;
}

static ddpw_status fail_invalid(ddpw_error *err, const char *type, const char *field,
                                uint64_t value, const char *why)
{
    fail(err, DDPW_ERR_INVALID, type, field, 0, 0);
    err->value = value;
    err->detail = why;
    return DDPW_ERR_INVALID;
}

/* As fail_invalid, for an f32 field: `value` holds its bits. */
static ddpw_status fail_invalid_f32(ddpw_error *err, const char *type, const char *field,
                                    float value, const char *why)
{
    uint32_t bits;
    memcpy(&bits, &value, 4);
    fail(err, DDPW_ERR_INVALID_F32, type, field, 0, 0);
    err->value = bits;
    err->detail = why;
    return DDPW_ERR_INVALID_F32;
}

/* NULL when `scale` may scale a worker's gradients (finite and >= 0; 0 is
 * a worker with an empty shard), else why not. Compared on the bits, so
 * that no NaN slips through a floating-point comparison. */
static const char *scale_refusal(float scale)
{
    uint32_t bits;
    memcpy(&bits, &scale, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u)
        return "not finite";
    if ((bits & 0x80000000u) && (bits & 0x7fffffffu))
        return "negative";
    return NULL;
}

ddpw_status ddpw_check_frame_len(uint64_t payload_len, uint64_t max_frame, ddpw_error *err)
{
    if (payload_len == 0)
        return fail(err, DDPW_ERR_EMPTY, NULL, NULL, 0, 1);
    if (payload_len > max_frame)
        return fail(err, DDPW_ERR_TOO_LARGE, NULL, NULL, payload_len, max_frame);
    return DDPW_OK;
}

/* ------------------------------------------------------------------ */
/* Reader                                                              */
/* ------------------------------------------------------------------ */

static void reader_init(ddpw_reader *r, const uint8_t *p, size_t avail, size_t len)
{
    r->data = p;
    r->len = len;
    r->avail = avail < len ? avail : len;
    r->pos = 0;
}

/* Claim the next n bytes. Past the payload end is truncation (an error);
 * past the bytes received so far is a request for more. */
static ddpw_status take(ddpw_reader *r, uint64_t n, const uint8_t **out, const char *type,
                        const char *field, ddpw_error *err)
{
    const size_t left = r->len - r->pos;
    if (n > (uint64_t)left)
        return fail(err, DDPW_ERR_TRUNCATED, type, field, left, n);
    if (n > (uint64_t)(r->avail - r->pos)) {
        err->status = DDPW_NEED_MORE;
        err->need = r->pos + (size_t)n;
        return DDPW_NEED_MORE;
    }
    *out = r->data + r->pos;
    r->pos += (size_t)n;
    return DDPW_OK;
}

static ddpw_status read_u8(ddpw_reader *r, uint8_t *v, const char *type, const char *field,
                           ddpw_error *err)
{
    const uint8_t *p;
    const ddpw_status st = take(r, 1, &p, type, field, err);
    if (st == DDPW_OK)
        *v = p[0];
    return st;
}

static ddpw_status read_u16(ddpw_reader *r, uint16_t *v, const char *type, const char *field,
                            ddpw_error *err)
{
    const uint8_t *p;
    const ddpw_status st = take(r, 2, &p, type, field, err);
    if (st == DDPW_OK)
        *v = load_u16le(p);
    return st;
}

static ddpw_status read_u32(ddpw_reader *r, uint32_t *v, const char *type, const char *field,
                            ddpw_error *err)
{
    const uint8_t *p;
    const ddpw_status st = take(r, 4, &p, type, field, err);
    if (st == DDPW_OK)
        *v = load_u32le(p);
    return st;
}

static ddpw_status read_u64(ddpw_reader *r, uint64_t *v, const char *type, const char *field,
                            ddpw_error *err)
{
    const uint8_t *p;
    const ddpw_status st = take(r, 8, &p, type, field, err);
    if (st == DDPW_OK)
        *v = load_u64le(p);
    return st;
}

static ddpw_status read_f32(ddpw_reader *r, float *v, const char *type, const char *field,
                            ddpw_error *err)
{
    const uint8_t *p;
    const ddpw_status st = take(r, 4, &p, type, field, err);
    if (st == DDPW_OK)
        *v = load_f32le(p);
    return st;
}

/* Index of the first byte that breaks strict UTF-8 (no overlongs, no
 * surrogates, nothing above U+10FFFF), or len when all of it is valid. */
static size_t utf8_valid_prefix(const uint8_t *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        const uint8_t c = s[i];
        size_t n, k;
        uint8_t lo = 0x80, hi = 0xBF; /* range of the first continuation byte */
        if (c < 0x80) {
            /* ASCII runs are the common case (node names, backends). */
            while (i + 8 <= len) {
                uint64_t word;
                memcpy(&word, s + i, 8);
                if (word & 0x8080808080808080ull)
                    break;
                i += 8;
            }
            if (i < len && s[i] < 0x80)
                i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
        } else {
            return i;
        }
        if (n > len - i - 1)
            return i;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return i;
        for (k = 2; k <= n; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return i;
        i += n + 1;
    }
    return len;
}

/* `length_field` names the byte count in errors ("node_id length"). */
static ddpw_status read_str(ddpw_reader *r, ddpw_str *v, const char *type, const char *field,
                            const char *length_field, ddpw_error *err)
{
    uint32_t n;
    const uint8_t *p;
    size_t valid;
    ddpw_status st = read_u32(r, &n, type, length_field, err);
    if (st != DDPW_OK)
        return st;
    st = take(r, n, &p, type, field, err);
    if (st != DDPW_OK)
        return st;
    valid = utf8_valid_prefix(p, n);
    if (valid != n)
        return fail(err, DDPW_ERR_UTF8, type, field, valid, n);
    v->data = p;
    v->len = n;
    return DDPW_OK;
}

/* The (bad_worker, bad_index, bad_value) triple ending StepReport and StepCommit. */
static ddpw_status read_bad(ddpw_reader *r, ddpw_message *m, const char *type, ddpw_error *err)
{
    ddpw_status st = read_u32(r, &m->bad_worker, type, "bad_worker", err);
    if (st == DDPW_OK)
        st = read_u64(r, &m->bad_index, type, "bad_index", err);
    if (st == DDPW_OK)
        st = read_f32(r, &m->bad_value, type, "bad_value", err);
    return st;
}

/* Bytes after the last field: an error unless the caller accepts them. */
static ddpw_status check_end(const ddpw_reader *r, size_t end, int flags, const char *type,
                             ddpw_error *err)
{
    if (end < r->len && !(flags & DDPW_ALLOW_TRAILING))
        return fail(err, DDPW_ERR_TRAILING, type, NULL, r->len, end);
    return DDPW_OK;
}

/* ------------------------------------------------------------------ */
/* Decoding                                                            */
/* ------------------------------------------------------------------ */

#define TRY(expr)                          \
    do {                                   \
        const ddpw_status st_ = (expr);    \
        if (st_ != DDPW_OK)                \
            return st_;                    \
    } while (0)

/* The tail's fields one by one, so a short tail names the field it cuts. */
static ddpw_status check_tail_fits(uint8_t tag, size_t left, const char *type, ddpw_error *err)
{
    static const char *const gp_fields[3] = {"loss", "correct", "total"};
    static const size_t gp_sizes[3] = {4, 8, 8};
    size_t i;
    if (tag == DDPW_GRADIENT_PAYLOAD) {
        for (i = 0; i < 3; i++) {
            if (gp_sizes[i] > left)
                return fail(err, DDPW_ERR_TRUNCATED, type, gp_fields[i], left, gp_sizes[i]);
            left -= gp_sizes[i];
        }
    } else if (tag == DDPW_AVERAGED_GRADIENT && left < 4) {
        return fail(err, DDPW_ERR_TRUNCATED, type, "global_loss", left, 4);
    }
    return DDPW_OK;
}

/* Read a gradient message up to its gradient elements and check that the
 * elements and tail fit the payload exactly, without touching the elements. */
static ddpw_status read_gradient_head(ddpw_reader *r, uint8_t tag, const char *type, int flags,
                                      ddpw_head *h, ddpw_error *err)
{
    const uint8_t *sizes = NULL;
    uint64_t count, grad_bytes;
    size_t left, tail_len, end;

    TRY(read_u64(r, &h->step, type, "step", err));
    switch (tag) {
    case DDPW_GRADIENT_PAYLOAD:
        TRY(read_u32(r, &h->worker_id, type, "worker_id", err));
        break;
    case DDPW_AVERAGED_GRADIENT:
        break;
    case DDPW_BLOCK_GRADIENT_PAYLOAD:
        TRY(read_u32(r, &h->worker_id, type, "worker_id", err));
        TRY(read_u32(r, &h->block_idx, type, "block_idx", err));
        TRY(read_u32(r, &h->num_blocks, type, "num_blocks", err));
        TRY(read_u32(r, &h->component_count, type, "component_sizes count", err));
        /* count <= 2^32 - 1, so count * 4 cannot overflow 64 bits */
        TRY(take(r, (uint64_t)h->component_count * 4, &sizes, type, "component_sizes", err));
        break;
    case DDPW_AVERAGED_BLOCK_GRADIENT:
        TRY(read_u32(r, &h->block_idx, type, "block_idx", err));
        TRY(read_u32(r, &h->component_count, type, "component_sizes count", err));
        TRY(take(r, (uint64_t)h->component_count * 4, &sizes, type, "component_sizes", err));
        break;
    case DDPW_NON_BLOCK_GRADIENT_PAYLOAD:
        TRY(read_u32(r, &h->worker_id, type, "worker_id", err));
        TRY(read_u8(r, &h->component, type, "component", err));
        break;
    default: /* DDPW_AVERAGED_NON_BLOCK_GRADIENT */
        TRY(read_u8(r, &h->component, type, "component", err));
        break;
    }
    h->component_sizes = sizes;
    TRY(read_u64(r, &count, type, "gradients count", err));

    if (count > UINT64_MAX / 4) {
        err->value = count;
        return fail(err, DDPW_ERR_OVERFLOW, type, "gradients", r->len - r->pos, UINT64_MAX);
    }
    grad_bytes = count * 4;
    left = r->len - r->pos;
    if (grad_bytes > (uint64_t)left)
        return fail(err, DDPW_ERR_TRUNCATED, type, "gradients", left, grad_bytes);
    left -= (size_t)grad_bytes;
    tail_len = ddpw_tail_len(tag);
    TRY(check_tail_fits(tag, left, type, err));
    end = r->pos + (size_t)grad_bytes + tail_len;
    TRY(check_end(r, end, flags, type, err));

    h->gradient_count = count;
    h->gradient_offset = r->pos;
    h->tail_len = tail_len;
    h->trailing_len = r->len - end;
    h->has_gradients = 1;
    h->has_bulk = 1;
    h->bulk_offset = r->pos;
    h->bulk_len = grad_bytes;
    return DDPW_OK;
}

/* A bulk of `data_len` raw bytes that ends the payload (a collective's
 * data, a ModelState piece): all of it must be there, then only what
 * `flags` allows after it. */
static ddpw_status bytes_bulk(ddpw_reader *r, uint64_t data_len, const char *type, int flags,
                              ddpw_head *h, ddpw_error *err)
{
    const size_t left = r->len - r->pos;
    size_t end;
    if (data_len > (uint64_t)left)
        return fail(err, DDPW_ERR_TRUNCATED, type, "data", left, data_len);
    end = r->pos + (size_t)data_len;
    TRY(check_end(r, end, flags, type, err));
    h->has_bulk = 1;
    h->bulk_offset = r->pos;
    h->bulk_len = data_len;
    h->tail_len = 0;
    h->trailing_len = r->len - end;
    return DDPW_OK;
}

/* CollectiveRequest / CollectiveResult up to their data, checking that the
 * data's byte count matches count and dtype and fills the payload exactly,
 * so a streaming reader knows every problem before the data arrives. */
static ddpw_status read_collective_head(ddpw_reader *r, uint8_t tag, const char *type, int flags,
                                        ddpw_head *h, ddpw_error *err)
{
    uint64_t data_len, size;

    TRY(read_u64(r, &h->seq, type, "seq", err));
    TRY(read_u8(r, &h->kind, type, "kind", err));
    if (tag == DDPW_COLLECTIVE_REQUEST)
        TRY(read_u8(r, &h->op, type, "op", err));
    TRY(read_u8(r, &h->dtype, type, "dtype", err));
    size = ddpw_dtype_size(h->dtype);
    if (size == 0)
        return fail_invalid(err, type, "dtype", h->dtype, "unknown dtype code");
    if (tag == DDPW_COLLECTIVE_REQUEST)
        TRY(read_u32(r, &h->root, type, "root", err));
    TRY(read_u64(r, &h->count, type, "count", err));
    TRY(read_u64(r, &data_len, type, "data length", err));
    if (h->count > UINT64_MAX / size)
        return fail_invalid(err, type, "count", h->count,
                            "elements whose byte length overflows 64 bits");
    if (data_len != h->count * size)
        return fail(err, DDPW_ERR_MISMATCH, type, "data", data_len, h->count * size);
    return bytes_bulk(r, data_len, type, flags, h, err);
}

/* ModelState up to its data: step, the whole state's length, the digest,
 * the data's byte count, which must fill the payload exactly and not pass
 * the whole state's length. */
static ddpw_status read_state_head(ddpw_reader *r, const char *type, int flags, ddpw_head *h,
                                   uint64_t *total, const uint8_t **digest, ddpw_error *err)
{
    uint64_t data_len;

    TRY(read_u64(r, &h->step, type, "step", err));
    TRY(read_u64(r, total, type, "total", err));
    TRY(take(r, DDPW_AUTH_BYTES, digest, type, "digest", err));
    TRY(read_u64(r, &data_len, type, "data length", err));
    if (data_len > *total)
        return fail_invalid(err, type, "data length", data_len, "more than the state's total");
    return bytes_bulk(r, data_len, type, flags, h, err);
}

static const uint8_t EXT_MAGIC[DDPW_EXT_MAGIC_LEN] = {0x44, 0x44, 0x50, 0x58}; /* "DDPX" */

/* After the last field of JoinRequest / JoinAccepted: nothing, an extension
 * block that ends exactly at the payload's end, or (without the magic)
 * trailing bytes as for any other message. */
static ddpw_status read_ext_block(ddpw_reader *r, int flags, const char *type, ddpw_message *m,
                                  ddpw_error *err)
{
    uint16_t seen[DDPW_EXT_MAX_ENTRIES];
    const size_t left = r->len - r->pos;
    size_t body, i, j;
    uint8_t version;
    uint16_t count;

    if (left < DDPW_EXT_MAGIC_LEN || memcmp(r->data + r->pos, EXT_MAGIC, DDPW_EXT_MAGIC_LEN) != 0)
        return check_end(r, r->pos, flags, type, err);
    /* Checked first: every length below is then small, and a peer cannot
     * make us walk a long block. */
    if (left > DDPW_EXT_MAX_BLOCK)
        return fail_invalid(err, type, "extensions", left, "bytes in the block, at most 4096");
    r->pos += DDPW_EXT_MAGIC_LEN;
    TRY(read_u8(r, &version, type, "extensions version", err));
    if (version != DDPW_EXT_VERSION)
        return fail_invalid(err, type, "extensions version", version, "this peer reads version 1");
    TRY(read_u16(r, &count, type, "extensions count", err));
    if (count > DDPW_EXT_MAX_ENTRIES)
        return fail_invalid(err, type, "extensions count", count, "at most 64 entries");
    body = r->pos;
    for (i = 0; i < count; i++) {
        uint16_t entry_type;
        uint32_t n;
        const uint8_t *value;
        TRY(read_u16(r, &entry_type, type, "extensions entry type", err));
        TRY(read_u32(r, &n, type, "extensions entry length", err));
        TRY(take(r, n, &value, type, "extensions entry value", err));
        for (j = 0; j < i; j++)
            if (seen[j] == entry_type)
                return fail_invalid(err, type, "extensions entry type", entry_type,
                                    "repeated in the block");
        seen[i] = entry_type;
    }
    /* The block must end where the payload does, even with
     * DDPW_ALLOW_TRAILING: there is no room for bytes after it. */
    if (r->pos != r->len)
        return fail(err, DDPW_ERR_TRAILING, type, "extensions", r->len, r->pos);
    m->has_ext = 1;
    m->ext_count = count;
    m->ext_block = r->data + body;
    m->ext_block_len = r->pos - body;
    return DDPW_OK;
}

int ddpw_ext_next(const uint8_t *block, size_t block_len, size_t *pos, ddpw_ext_entry *entry)
{
    const size_t p = *pos;
    if (p > block_len || block_len - p < DDPW_EXT_ENTRY_HEADER_LEN)
        return 0;
    entry->type = load_u16le(block + p);
    entry->len = load_u32le(block + p + 2);
    if ((uint64_t)entry->len > (uint64_t)(block_len - p - DDPW_EXT_ENTRY_HEADER_LEN))
        return 0;
    entry->value = block + p + DDPW_EXT_ENTRY_HEADER_LEN;
    *pos = p + DDPW_EXT_ENTRY_HEADER_LEN + entry->len;
    return 1;
}

/* Tag byte: NEED_MORE, an error, or the message's type name. */
static ddpw_status read_tag(ddpw_reader *r, uint8_t *tag, const char **type, ddpw_error *err)
{
    if (r->len == 0)
        return fail(err, DDPW_ERR_EMPTY, NULL, NULL, 0, 1);
    TRY(read_u8(r, tag, NULL, "tag", err));
    *type = ddpw_message_type(*tag);
    if (*type == NULL) {
        err->tag = *tag;
        return fail(err, DDPW_ERR_UNKNOWN_TAG, NULL, "tag", 1, 1);
    }
    return DDPW_OK;
}

ddpw_status ddpw_decode_head(const uint8_t *p, size_t avail, size_t payload_len, int flags,
                             ddpw_head *head, ddpw_error *err)
{
    ddpw_reader r;
    const char *type = NULL;
    ddpw_status st;

    memset(head, 0, sizeof *head);
    reader_init(&r, p, avail, payload_len);
    st = read_tag(&r, &head->tag, &type, err);
    if (st == DDPW_OK && ddpw_has_gradients(head->tag))
        st = read_gradient_head(&r, head->tag, type, flags, head, err);
    else if (st == DDPW_OK && is_collective_bulk(head->tag))
        st = read_collective_head(&r, head->tag, type, flags, head, err);
    else if (st == DDPW_OK && head->tag == DDPW_MODEL_STATE) {
        const uint8_t *digest = NULL;
        uint64_t total = 0;
        st = read_state_head(&r, type, flags, head, &total, &digest, err);
    }
    if (st == DDPW_NEED_MORE)
        head->need = err->need;
    return st;
}

ddpw_status ddpw_decode_tail(uint8_t tag, const uint8_t *p, size_t avail, ddpw_tail *tail,
                             ddpw_error *err)
{
    ddpw_reader r;
    const char *type = ddpw_message_type(tag);
    memset(tail, 0, sizeof *tail);
    reader_init(&r, p, avail, avail);
    if (tag == DDPW_GRADIENT_PAYLOAD) {
        TRY(read_f32(&r, &tail->loss, type, "loss", err));
        TRY(read_u64(&r, &tail->correct, type, "correct", err));
        TRY(read_u64(&r, &tail->total, type, "total", err));
    } else if (tag == DDPW_AVERAGED_GRADIENT) {
        TRY(read_f32(&r, &tail->global_loss, type, "global_loss", err));
    }
    return DDPW_OK;
}

ddpw_status ddpw_decode_payload(const uint8_t *p, size_t len, int flags, ddpw_message *msg,
                                ddpw_error *err)
{
    ddpw_reader r;
    const char *type = NULL;
    uint8_t tag = 0;

    memset(msg, 0, sizeof *msg);
    reader_init(&r, p, len, len);
    TRY(read_tag(&r, &tag, &type, err));
    msg->tag = tag;

    if (ddpw_has_gradients(tag)) {
        ddpw_head h;
        ddpw_tail t;
        memset(&h, 0, sizeof h);
        TRY(read_gradient_head(&r, tag, type, flags, &h, err));
        msg->step = h.step;
        msg->worker_id = h.worker_id;
        msg->block_idx = h.block_idx;
        msg->num_blocks = h.num_blocks;
        msg->component = h.component;
        msg->component_sizes = h.component_sizes;
        msg->component_count = h.component_count;
        msg->gradients = p + h.gradient_offset;
        msg->gradient_count = h.gradient_count;
        /* read_gradient_head proved the tail lies inside the payload */
        TRY(ddpw_decode_tail(tag, p + h.gradient_offset + (size_t)h.gradient_count * 4,
                             h.tail_len, &t, err));
        msg->loss = t.loss;
        msg->correct = t.correct;
        msg->total = t.total;
        msg->global_loss = t.global_loss;
        return DDPW_OK;
    }

    if (is_collective_bulk(tag)) {
        ddpw_head h;
        memset(&h, 0, sizeof h);
        TRY(read_collective_head(&r, tag, type, flags, &h, err));
        msg->seq = h.seq;
        msg->kind = h.kind;
        msg->op = h.op;
        msg->dtype = h.dtype;
        msg->root = h.root;
        msg->count = h.count;
        msg->data = p + h.bulk_offset;
        msg->data_len = h.bulk_len;
        return DDPW_OK;
    }

    if (tag == DDPW_MODEL_STATE) {
        ddpw_head h;
        memset(&h, 0, sizeof h);
        TRY(read_state_head(&r, type, flags, &h, &msg->total, &msg->digest, err));
        msg->step = h.step;
        msg->data = p + h.bulk_offset;
        msg->data_len = h.bulk_len;
        return DDPW_OK;
    }

    switch (tag) {
    case DDPW_JOIN_REQUEST:
        TRY(read_str(&r, &msg->node_id, type, "node_id", "node_id length", err));
        TRY(read_u32(&r, &msg->gpu_count, type, "gpu_count", err));
        TRY(read_str(&r, &msg->backend, type, "backend", "backend length", err));
        return read_ext_block(&r, flags, type, msg, err);
    case DDPW_JOIN_ACCEPTED:
        TRY(read_u32(&r, &msg->worker_id, type, "worker_id", err));
        TRY(read_u32(&r, &msg->total_workers, type, "total_workers", err));
        return read_ext_block(&r, flags, type, msg, err);
    case DDPW_AUTH_CHALLENGE:
        TRY(take(&r, DDPW_AUTH_BYTES, &msg->nonce, type, "nonce", err));
        TRY(take(&r, DDPW_AUTH_BYTES, &msg->proof, type, "proof", err));
        break;
    case DDPW_AUTH_PROOF:
        TRY(take(&r, DDPW_AUTH_BYTES, &msg->proof, type, "proof", err));
        break;
    case DDPW_JOIN_REFUSED:
        TRY(read_u8(&r, &msg->reason, type, "reason", err));
        TRY(read_str(&r, &msg->detail, type, "detail", "detail length", err));
        break;
    case DDPW_COLLECTIVE_ERROR:
        TRY(read_u64(&r, &msg->seq, type, "seq", err));
        TRY(read_u32(&r, &msg->worker_id, type, "worker_id", err));
        TRY(read_str(&r, &msg->detail, type, "detail", "detail length", err));
        break;
    case DDPW_MESH_PEERS:
        TRY(take(&r, DDPW_AUTH_BYTES, &msg->key, type, "key", err));
        TRY(read_u8(&r, &msg->codec, type, "codec", err));
        if (ddpw_code_name(DDPW_CODES_CODEC, msg->codec) == NULL)
            return fail_invalid(err, type, "codec", msg->codec, "unknown codec");
        TRY(read_u8(&r, &msg->shared_memory, type, "shared_memory", err));
        if (msg->shared_memory > 1)
            return fail_invalid(err, type, "shared_memory", msg->shared_memory, "not 0 or 1");
        TRY(read_u16(&r, &msg->coordinator_share, type, "coordinator_share", err));
        TRY(read_str(&r, &msg->peers, type, "peers", "peers length", err));
        break;
    case DDPW_PEER_HELLO:
        TRY(read_u32(&r, &msg->worker_id, type, "worker_id", err));
        TRY(take(&r, DDPW_AUTH_BYTES, &msg->proof, type, "proof", err));
        break;
    case DDPW_STEP_REPORT:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        TRY(read_u32(&r, &msg->worker_id, type, "worker_id", err));
        TRY(read_u64(&r, &msg->count, type, "count", err));
        TRY(read_f32(&r, &msg->loss, type, "loss", err));
        TRY(read_u64(&r, &msg->correct, type, "correct", err));
        TRY(read_u64(&r, &msg->total, type, "total", err));
        TRY(read_bad(&r, msg, type, err));
        break;
    case DDPW_STEP_COMMIT:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        TRY(read_f32(&r, &msg->global_loss, type, "global_loss", err));
        TRY(read_bad(&r, msg, type, err));
        break;
    case DDPW_STEP_TIMING:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        TRY(read_u64(&r, &msg->compute_us, type, "compute_us", err));
        break;
    case DDPW_SHARD_SCALE:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        TRY(read_f32(&r, &msg->scale, type, "scale", err));
        if (scale_refusal(msg->scale) != NULL)
            return fail_invalid_f32(err, type, "scale", msg->scale, scale_refusal(msg->scale));
        break;
    case DDPW_STATE_REQUEST:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        break;
    case DDPW_STEP_ABORTED:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        TRY(read_u32(&r, &msg->worker_id, type, "worker_id", err));
        TRY(read_u32(&r, &msg->total_workers, type, "workers", err));
        break;
    case DDPW_SHARD_ASSIGNMENT:
        TRY(read_u64(&r, &msg->step, type, "step", err));
        TRY(read_u64(&r, &msg->shard_start, type, "shard_start", err));
        TRY(read_u64(&r, &msg->shard_end, type, "shard_end", err));
        break;
    case DDPW_HEARTBEAT:
        TRY(read_str(&r, &msg->node_id, type, "node_id", "node_id length", err));
        TRY(read_u64(&r, &msg->timestamp_ms, type, "timestamp_ms", err));
        break;
    default: /* DDPW_SHUTDOWN: no body */
        break;
    }
    return check_end(&r, r.pos, flags, type, err);
}

/* ------------------------------------------------------------------ */
/* Writer                                                              */
/* ------------------------------------------------------------------ */

static void writer_init(ddpw_writer *w, uint8_t *out, size_t cap)
{
    w->data = out;
    w->cap = cap;
    w->pos = 0;
    w->overflowed = 0;
}

/* Reserve n bytes, or mark the writer overflowed and return NULL. */
static uint8_t *reserve(ddpw_writer *w, uint64_t n)
{
    uint8_t *p;
    if (w->overflowed || n > (uint64_t)(w->cap - w->pos)) {
        w->overflowed = 1;
        return NULL;
    }
    p = w->data + w->pos;
    w->pos += (size_t)n;
    return p;
}

static void put_u8(ddpw_writer *w, uint8_t v)
{
    uint8_t *p = reserve(w, 1);
    if (p)
        p[0] = v;
}

static void put_u16(ddpw_writer *w, uint16_t v)
{
    uint8_t *p = reserve(w, 2);
    if (p)
        store_u16le(p, v);
}

static void put_bytes(ddpw_writer *w, const uint8_t *src, uint64_t n)
{
    uint8_t *p = reserve(w, n);
    if (p && n)
        memcpy(p, src, (size_t)n);
}

static void put_u32(ddpw_writer *w, uint32_t v)
{
    uint8_t *p = reserve(w, 4);
    if (p)
        store_u32le(p, v);
}

static void put_u64(ddpw_writer *w, uint64_t v)
{
    uint8_t *p = reserve(w, 8);
    if (p)
        store_u64le(p, v);
}

static void put_f32(ddpw_writer *w, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, 4);
    put_u32(w, bits);
}

static void put_prefix(ddpw_writer *w, uint32_t v)
{
    uint8_t *p = reserve(w, 4);
    if (p) {
        p[0] = (uint8_t)(v >> 24);
        p[1] = (uint8_t)(v >> 16);
        p[2] = (uint8_t)(v >> 8);
        p[3] = (uint8_t)v;
    }
}

static void put_str(ddpw_writer *w, ddpw_str s)
{
    uint8_t *p;
    put_u32(w, (uint32_t)s.len); /* ddpw_payload_size checked it fits */
    p = reserve(w, s.len);
    if (p && s.len)
        memcpy(p, s.data, s.len);
}

/* count host-order 32-bit values (float or uint32_t) as little-endian. */
static void put_words(ddpw_writer *w, const void *src, uint64_t count)
{
    uint8_t *p;
    uint64_t i;
    if (count > UINT64_MAX / 4) {
        w->overflowed = 1;
        return;
    }
    p = reserve(w, count * 4);
    if (!p || count == 0)
        return;
    if (host_is_little_endian()) {
        memcpy(p, src, (size_t)count * 4);
        return;
    }
    for (i = 0; i < count; i++) {
        uint32_t v;
        memcpy(&v, (const uint8_t *)src + 4 * i, 4);
        store_u32le(p + 4 * i, v);
    }
}

/* ------------------------------------------------------------------ */
/* Encoding                                                            */
/* ------------------------------------------------------------------ */

/* Bytes of the extension block (0 without one). Each term is below 2^33
 * and there are at most 2^16 of them: no overflow. */
static uint64_t ext_block_size(const ddpw_message *m)
{
    uint64_t size = DDPW_EXT_HEADER_LEN;
    size_t i;
    if (!m->has_ext)
        return 0;
    for (i = 0; i < m->ext_count; i++)
        size += DDPW_EXT_ENTRY_HEADER_LEN + (uint64_t)m->ext_entries[i].len;
    return size;
}

/* The encoder refuses what the decoder would refuse. */
static ddpw_status check_ext_entries(const ddpw_message *m, const char *type, ddpw_error *err)
{
    uint64_t size;
    size_t i, j;
    if (!m->has_ext)
        return DDPW_OK;
    if (m->ext_count > DDPW_EXT_MAX_ENTRIES) {
        fail(err, DDPW_ERR_VALUE, type, "extensions", m->ext_count, DDPW_EXT_MAX_ENTRIES);
        err->value = m->ext_count;
        err->detail = "entries";
        return DDPW_ERR_VALUE;
    }
    if (m->ext_count > 0 && m->ext_entries == NULL)
        return fail(err, DDPW_ERR_VALUE, type, "extensions", m->ext_count, 0);
    for (i = 0; i < m->ext_count; i++)
        for (j = 0; j < i; j++)
            if (m->ext_entries[i].type == m->ext_entries[j].type)
                return fail_invalid(err, type, "extensions entry type", m->ext_entries[i].type,
                                    "repeated in the block");
    size = ext_block_size(m);
    if (size > DDPW_EXT_MAX_BLOCK) {
        err->value = size;
        return fail(err, DDPW_ERR_VALUE, type, "extensions", size, DDPW_EXT_MAX_BLOCK);
    }
    return DDPW_OK;
}

/* Payload bytes before the bulk field (all of them for a message without
 * one). */
static uint64_t head_fields_size(const ddpw_message *m)
{
    switch (m->tag) {
    case DDPW_JOIN_REQUEST:
        return 1 + 4 + (uint64_t)m->node_id.len + 4 + 4 + (uint64_t)m->backend.len +
               ext_block_size(m);
    case DDPW_JOIN_ACCEPTED:
        return 1 + 4 + 4 + ext_block_size(m);
    case DDPW_AUTH_CHALLENGE:
        return 1 + 2 * DDPW_AUTH_BYTES;
    case DDPW_AUTH_PROOF:
        return 1 + DDPW_AUTH_BYTES;
    case DDPW_JOIN_REFUSED:
        return 1 + 1 + 4 + (uint64_t)m->detail.len;
    case DDPW_COLLECTIVE_REQUEST:
        return 1 + 8 + 1 + 1 + 1 + 4 + 8 + 8;
    case DDPW_COLLECTIVE_RESULT:
        return 1 + 8 + 1 + 1 + 8 + 8;
    case DDPW_MODEL_STATE:
        return 1 + 8 + 8 + DDPW_AUTH_BYTES + 8;
    case DDPW_COLLECTIVE_ERROR:
        return 1 + 8 + 4 + 4 + (uint64_t)m->detail.len;
    case DDPW_MESH_PEERS:
        return 1 + DDPW_AUTH_BYTES + 1 + 1 + 2 + 4 + (uint64_t)m->peers.len;
    case DDPW_PEER_HELLO:
        return 1 + 4 + DDPW_AUTH_BYTES;
    case DDPW_STEP_REPORT:
        return 1 + 8 + 4 + 8 + 4 + 8 + 8 + 4 + 8 + 4;
    case DDPW_STEP_COMMIT:
        return 1 + 8 + 4 + 4 + 8 + 4;
    case DDPW_STEP_TIMING:
        return 1 + 8 + 8;
    case DDPW_SHARD_SCALE:
        return 1 + 8 + 4;
    case DDPW_STEP_ABORTED:
        return 1 + 8 + 4 + 4;
    case DDPW_STATE_REQUEST:
        return 1 + 8;
    case DDPW_SHARD_ASSIGNMENT:
        return 1 + 8 + 8 + 8;
    case DDPW_GRADIENT_PAYLOAD:
        return 1 + 8 + 4 + 8;
    case DDPW_AVERAGED_GRADIENT:
        return 1 + 8 + 8;
    case DDPW_HEARTBEAT:
        return 1 + 4 + (uint64_t)m->node_id.len + 8;
    case DDPW_SHUTDOWN:
        return 1;
    case DDPW_BLOCK_GRADIENT_PAYLOAD:
        return 1 + 8 + 4 + 4 + 4 + 4 + 4 * (uint64_t)m->component_count + 8;
    case DDPW_AVERAGED_BLOCK_GRADIENT:
        return 1 + 8 + 4 + 4 + 4 * (uint64_t)m->component_count + 8;
    case DDPW_NON_BLOCK_GRADIENT_PAYLOAD:
        return 1 + 8 + 4 + 1 + 8;
    default: /* DDPW_AVERAGED_NON_BLOCK_GRADIENT */
        return 1 + 8 + 1 + 8;
    }
}

ddpw_status ddpw_payload_size(const ddpw_message *m, uint64_t *size, ddpw_error *err)
{
    const char *type = ddpw_message_type(m->tag);
    uint64_t head, count = 0;
    if (type == NULL) {
        err->tag = m->tag;
        return fail(err, DDPW_ERR_UNKNOWN_TAG, NULL, "tag", 0, 0);
    }
    if ((uint64_t)m->node_id.len > UINT32_MAX) {
        err->value = m->node_id.len;
        return fail(err, DDPW_ERR_VALUE, type, "node_id", m->node_id.len, UINT32_MAX);
    }
    if ((uint64_t)m->backend.len > UINT32_MAX) {
        err->value = m->backend.len;
        return fail(err, DDPW_ERR_VALUE, type, "backend", m->backend.len, UINT32_MAX);
    }
    if ((uint64_t)m->detail.len > UINT32_MAX) {
        err->value = m->detail.len;
        return fail(err, DDPW_ERR_VALUE, type, "detail", m->detail.len, UINT32_MAX);
    }
    if ((uint64_t)m->peers.len > UINT32_MAX) {
        err->value = m->peers.len;
        return fail(err, DDPW_ERR_VALUE, type, "peers", m->peers.len, UINT32_MAX);
    }
    if ((m->tag == DDPW_AUTH_CHALLENGE && m->nonce == NULL) ||
        ((m->tag == DDPW_AUTH_CHALLENGE || m->tag == DDPW_AUTH_PROOF ||
          m->tag == DDPW_PEER_HELLO) && m->proof == NULL))
        return fail(err, DDPW_ERR_VALUE, type, m->nonce == NULL ? "nonce" : "proof", 0,
                    DDPW_AUTH_BYTES);
    if (m->tag == DDPW_MODEL_STATE && (m->digest == NULL || (m->data == NULL && m->data_len)))
        return fail(err, DDPW_ERR_VALUE, type, m->digest == NULL ? "digest" : "data", 0,
                    m->digest == NULL ? DDPW_AUTH_BYTES : m->data_len);
    if (m->tag == DDPW_MODEL_STATE && m->data_len > m->total)
        return fail_invalid(err, type, "data length", m->data_len, "more than the state's total");
    if (m->tag == DDPW_MESH_PEERS && m->key == NULL)
        return fail(err, DDPW_ERR_VALUE, type, "key", 0, DDPW_AUTH_BYTES);
    if (m->tag == DDPW_MESH_PEERS && ddpw_code_name(DDPW_CODES_CODEC, m->codec) == NULL)
        return fail_invalid(err, type, "codec", m->codec, "unknown codec");
    if (m->tag == DDPW_MESH_PEERS && m->shared_memory > 1)
        return fail_invalid(err, type, "shared_memory", m->shared_memory, "not 0 or 1");
    if (m->tag == DDPW_SHARD_SCALE && scale_refusal(m->scale) != NULL)
        return fail_invalid_f32(err, type, "scale", m->scale, scale_refusal(m->scale));
    TRY(check_ext_entries(m, type, err));
    head = head_fields_size(m); /* each term < 2^35: no overflow */
    if (is_collective_bulk(m->tag)) {
        const size_t item = ddpw_dtype_size(m->dtype);
        if (item == 0)
            return fail_invalid(err, type, "dtype", m->dtype, "unknown dtype code");
        if (m->count > UINT64_MAX / item)
            return fail_invalid(err, type, "count", m->count,
                                "elements whose byte length overflows 64 bits");
        if (m->data_len != m->count * item)
            return fail(err, DDPW_ERR_MISMATCH, type, "data", m->data_len, m->count * item);
        if (m->data_len > UINT64_MAX - head)
            return fail(err, DDPW_ERR_TOO_LARGE, type, NULL, UINT64_MAX, UINT32_MAX);
        *size = head + m->data_len;
    } else if (m->tag == DDPW_MODEL_STATE) {
        if (m->data_len > UINT64_MAX - head)
            return fail(err, DDPW_ERR_TOO_LARGE, type, NULL, UINT64_MAX, UINT32_MAX);
        *size = head + m->data_len;
    } else {
        if (ddpw_has_gradients(m->tag))
            count = m->gradient_count;
        if (count > (UINT64_MAX - head - ddpw_tail_len(m->tag)) / 4) {
            err->value = count;
            return fail(err, DDPW_ERR_OVERFLOW, type, "gradients", 0, UINT64_MAX);
        }
        *size = head + 4 * count + ddpw_tail_len(m->tag);
    }
    if (*size > UINT32_MAX)
        return fail(err, DDPW_ERR_TOO_LARGE, type, NULL, *size, UINT32_MAX);
    return DDPW_OK;
}

size_t ddpw_head_size(const ddpw_message *m)
{
    if (ddpw_message_type(m->tag) == NULL)
        return 0;
    return DDPW_PREFIX_LEN + (size_t)head_fields_size(m);
}

static ddpw_status finish(const ddpw_writer *w, size_t *written, const char *type, uint64_t need,
                          ddpw_error *err)
{
    if (w->overflowed)
        return fail(err, DDPW_ERR_BUFFER, type, NULL, w->cap, need);
    *written = w->pos;
    return DDPW_OK;
}

static void write_ext_block(ddpw_writer *w, const ddpw_message *m)
{
    size_t i;
    if (!m->has_ext)
        return;
    put_bytes(w, EXT_MAGIC, DDPW_EXT_MAGIC_LEN);
    put_u8(w, DDPW_EXT_VERSION);
    put_u16(w, m->ext_count);
    for (i = 0; i < m->ext_count; i++) {
        put_u16(w, m->ext_entries[i].type);
        put_u32(w, m->ext_entries[i].len);
        put_bytes(w, m->ext_entries[i].value, m->ext_entries[i].len);
    }
}

static void write_head(ddpw_writer *w, const ddpw_message *m, uint32_t payload_size)
{
    put_prefix(w, payload_size);
    put_u8(w, m->tag);
    switch (m->tag) {
    case DDPW_JOIN_REQUEST:
        put_str(w, m->node_id);
        put_u32(w, m->gpu_count);
        put_str(w, m->backend);
        write_ext_block(w, m);
        break;
    case DDPW_JOIN_ACCEPTED:
        put_u32(w, m->worker_id);
        put_u32(w, m->total_workers);
        write_ext_block(w, m);
        break;
    case DDPW_AUTH_CHALLENGE:
        put_bytes(w, m->nonce, DDPW_AUTH_BYTES);
        put_bytes(w, m->proof, DDPW_AUTH_BYTES);
        break;
    case DDPW_AUTH_PROOF:
        put_bytes(w, m->proof, DDPW_AUTH_BYTES);
        break;
    case DDPW_JOIN_REFUSED:
        put_u8(w, m->reason);
        put_str(w, m->detail);
        break;
    case DDPW_COLLECTIVE_REQUEST:
        put_u64(w, m->seq);
        put_u8(w, m->kind);
        put_u8(w, m->op);
        put_u8(w, m->dtype);
        put_u32(w, m->root);
        put_u64(w, m->count);
        put_u64(w, m->data_len);
        break;
    case DDPW_COLLECTIVE_RESULT:
        put_u64(w, m->seq);
        put_u8(w, m->kind);
        put_u8(w, m->dtype);
        put_u64(w, m->count);
        put_u64(w, m->data_len);
        break;
    case DDPW_COLLECTIVE_ERROR:
        put_u64(w, m->seq);
        put_u32(w, m->worker_id);
        put_str(w, m->detail);
        break;
    case DDPW_MESH_PEERS:
        put_bytes(w, m->key, DDPW_AUTH_BYTES);
        put_u8(w, m->codec);
        put_u8(w, m->shared_memory);
        put_u16(w, m->coordinator_share);
        put_str(w, m->peers);
        break;
    case DDPW_PEER_HELLO:
        put_u32(w, m->worker_id);
        put_bytes(w, m->proof, DDPW_AUTH_BYTES);
        break;
    case DDPW_STEP_REPORT:
        put_u64(w, m->step);
        put_u32(w, m->worker_id);
        put_u64(w, m->count);
        put_f32(w, m->loss);
        put_u64(w, m->correct);
        put_u64(w, m->total);
        put_u32(w, m->bad_worker);
        put_u64(w, m->bad_index);
        put_f32(w, m->bad_value);
        break;
    case DDPW_STEP_COMMIT:
        put_u64(w, m->step);
        put_f32(w, m->global_loss);
        put_u32(w, m->bad_worker);
        put_u64(w, m->bad_index);
        put_f32(w, m->bad_value);
        break;
    case DDPW_STEP_TIMING:
        put_u64(w, m->step);
        put_u64(w, m->compute_us);
        break;
    case DDPW_SHARD_SCALE:
        put_u64(w, m->step);
        put_f32(w, m->scale);
        break;
    case DDPW_STATE_REQUEST:
        put_u64(w, m->step);
        break;
    case DDPW_MODEL_STATE:
        put_u64(w, m->step);
        put_u64(w, m->total);
        put_bytes(w, m->digest, DDPW_AUTH_BYTES);
        put_u64(w, m->data_len);
        break;
    case DDPW_STEP_ABORTED:
        put_u64(w, m->step);
        put_u32(w, m->worker_id);
        put_u32(w, m->total_workers);
        break;
    case DDPW_SHARD_ASSIGNMENT:
        put_u64(w, m->step);
        put_u64(w, m->shard_start);
        put_u64(w, m->shard_end);
        break;
    case DDPW_GRADIENT_PAYLOAD:
        put_u64(w, m->step);
        put_u32(w, m->worker_id);
        put_u64(w, m->gradient_count);
        break;
    case DDPW_AVERAGED_GRADIENT:
        put_u64(w, m->step);
        put_u64(w, m->gradient_count);
        break;
    case DDPW_HEARTBEAT:
        put_str(w, m->node_id);
        put_u64(w, m->timestamp_ms);
        break;
    case DDPW_SHUTDOWN:
        break;
    case DDPW_BLOCK_GRADIENT_PAYLOAD:
        put_u64(w, m->step);
        put_u32(w, m->worker_id);
        put_u32(w, m->block_idx);
        put_u32(w, m->num_blocks);
        put_u32(w, m->component_count);
        put_words(w, m->component_sizes, m->component_count);
        put_u64(w, m->gradient_count);
        break;
    case DDPW_AVERAGED_BLOCK_GRADIENT:
        put_u64(w, m->step);
        put_u32(w, m->block_idx);
        put_u32(w, m->component_count);
        put_words(w, m->component_sizes, m->component_count);
        put_u64(w, m->gradient_count);
        break;
    case DDPW_NON_BLOCK_GRADIENT_PAYLOAD:
        put_u64(w, m->step);
        put_u32(w, m->worker_id);
        put_u8(w, m->component);
        put_u64(w, m->gradient_count);
        break;
    default: /* DDPW_AVERAGED_NON_BLOCK_GRADIENT */
        put_u64(w, m->step);
        put_u8(w, m->component);
        put_u64(w, m->gradient_count);
        break;
    }
}

static void write_tail(ddpw_writer *w, const ddpw_message *m)
{
    if (m->tag == DDPW_GRADIENT_PAYLOAD) {
        put_f32(w, m->loss);
        put_u64(w, m->correct);
        put_u64(w, m->total);
    } else if (m->tag == DDPW_AVERAGED_GRADIENT) {
        put_f32(w, m->global_loss);
    }
}

ddpw_status ddpw_encode_head(const ddpw_message *m, uint8_t *out, size_t cap, size_t *written,
                             ddpw_error *err)
{
    ddpw_writer w;
    uint64_t size;
    TRY(ddpw_payload_size(m, &size, err));
    writer_init(&w, out, cap);
    write_head(&w, m, (uint32_t)size);
    return finish(&w, written, ddpw_message_type(m->tag), ddpw_head_size(m), err);
}

ddpw_status ddpw_encode_tail(const ddpw_message *m, uint8_t *out, size_t cap, size_t *written,
                             ddpw_error *err)
{
    ddpw_writer w;
    const char *type = ddpw_message_type(m->tag);
    if (type == NULL) {
        err->tag = m->tag;
        return fail(err, DDPW_ERR_UNKNOWN_TAG, NULL, "tag", 0, 0);
    }
    writer_init(&w, out, cap);
    write_tail(&w, m);
    return finish(&w, written, type, ddpw_tail_len(m->tag), err);
}

ddpw_status ddpw_encode_frame(const ddpw_message *m, uint8_t *out, size_t cap, size_t *written,
                              ddpw_error *err)
{
    ddpw_writer w;
    uint64_t size;
    TRY(ddpw_payload_size(m, &size, err));
    writer_init(&w, out, cap);
    write_head(&w, m, (uint32_t)size);
    if (ddpw_has_gradients(m->tag)) {
        put_words(&w, m->gradients, m->gradient_count);
        write_tail(&w, m);
    } else if (is_collective_bulk(m->tag) || m->tag == DDPW_MODEL_STATE) {
        put_bytes(&w, m->data, m->data_len);
    }
    return finish(&w, written, ddpw_message_type(m->tag), DDPW_PREFIX_LEN + size, err);
}

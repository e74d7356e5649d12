/*
 * wire.c: see wire.h. Plain C99, no allocation, no dependency beyond libc.
 *
 * Every message's layout comes from messages.def; the reader and the writer
 * below walk those tables, so no message is spelled out here.
 */
#include "wire.h"

#include <float.h>
#include <stddef.h>
#include <string.h>

#define COUNT(table) (sizeof (table) / sizeof *(table))

/* ------------------------------------------------------------------ */
/* Message table                                                       */
/* ------------------------------------------------------------------ */

/* The name a variable field's count or length goes by in errors. */
#define COUNT_NAME_U8(name) NULL
#define COUNT_NAME_U16(name) NULL
#define COUNT_NAME_U32(name) NULL
#define COUNT_NAME_U64(name) NULL
#define COUNT_NAME_F32(name) NULL
#define COUNT_NAME_BYTES32(name) NULL
#define COUNT_NAME_STRING(name) #name " length"
#define COUNT_NAME_U32LIST(name) #name " count"
#define COUNT_NAME_F32VEC(name) #name " count"
#define COUNT_NAME_BYTES(name) #name " length"

/* One field table per message, each ended by an entry without a name. */
#define DDPW_F(type, name, member, rule)                                     \
    {#name, COUNT_NAME_##type(name), DDPW_WT_##type, DDPW_RULE_##rule,        \
     (uint16_t)offsetof(ddpw_message, member)},
#define DDPW_MESSAGE(tag, ENUM, Class, direction, extensible, fields, doc) \
    static const ddpw_field FIELDS_##ENUM[] = {fields{NULL, NULL, 0, 0, 0}};
#include "messages.def"
#undef DDPW_MESSAGE
#undef DDPW_F

#define DDPW_F(type, name, member, rule)
#define DDPW_MESSAGE(tag, ENUM, Class, direction, extensible, fields, doc)                   \
    static const ddpw_layout LAYOUT_##ENUM = {tag, extensible,                                \
                                              (uint8_t)(COUNT(FIELDS_##ENUM) - 1), #Class,   \
                                              direction, doc, FIELDS_##ENUM};
#include "messages.def"
#undef DDPW_MESSAGE

#define DDPW_MESSAGE(tag, ENUM, Class, direction, extensible, fields, doc) &LAYOUT_##ENUM,
static const ddpw_layout *const LAYOUTS[] = {
#include "messages.def"
};
#undef DDPW_MESSAGE

#define DDPW_MESSAGE(tag, ENUM, Class, direction, extensible, fields, doc) [tag] = &LAYOUT_##ENUM,
static const ddpw_layout *const BY_TAG[256] = {
#include "messages.def"
};
#undef DDPW_MESSAGE
#undef DDPW_F

/* A member that does not fit its field's wire type stops the build: each
 * message gets a struct whose bit-field widths are 1 where the member's size
 * is right and -1 (an error) where it is not. */
#define SIZE_U8 1
#define SIZE_U16 2
#define SIZE_U32 4
#define SIZE_U64 8
#define SIZE_F32 4
#define SIZE_STRING sizeof(ddpw_str)
#define SIZE_BYTES32 sizeof(const uint8_t *)
#define SIZE_U32LIST sizeof(ddpw_span)
#define SIZE_F32VEC sizeof(ddpw_span)
#define SIZE_BYTES sizeof(ddpw_span)
#define DDPW_F(type, name, member, rule) \
    unsigned name : sizeof(((ddpw_message *)0)->member) == SIZE_##type ? 1 : -1;
#define DDPW_MESSAGE(tag, ENUM, Class, direction, extensible, fields, doc) \
    struct member_fits_##ENUM {                                            \
        unsigned tag_ : 1;                                                 \
        fields                                                             \
    };
#include "messages.def"
#undef DDPW_MESSAGE
#undef DDPW_F

/* The names of wire.h's lists, indexed by value. */
#define DDPW_NAME_AT(ENUM, value, name) [value] = name,
static const char *const WIRE_TYPE_NAMES[] = {DDPW_WIRE_TYPES(DDPW_NAME_AT)};
static const char *const RULE_NAMES[] = {DDPW_RULES(DDPW_NAME_AT)};
#undef DDPW_NAME_AT

const ddpw_layout *ddpw_layout_at(size_t i)
{
    return i < COUNT(LAYOUTS) ? LAYOUTS[i] : NULL;
}

const char *ddpw_wire_type_name(unsigned type)
{
    return type < COUNT(WIRE_TYPE_NAMES) ? WIRE_TYPE_NAMES[type] : NULL;
}

const char *ddpw_rule_name(unsigned rule)
{
    return rule < COUNT(RULE_NAMES) ? RULE_NAMES[rule] : NULL;
}

const char *ddpw_message_type(uint8_t tag)
{
    return BY_TAG[tag] ? BY_TAG[tag]->name : NULL;
}

static int is_bulk(uint8_t type)
{
    return type == DDPW_WT_F32VEC || type == DDPW_WT_BYTES;
}

/* Bytes of a fixed-size wire type; 0 for a variable one. */
static size_t fixed_size(uint8_t type)
{
    switch (type) {
    case DDPW_WT_U8:
        return 1;
    case DDPW_WT_U16:
        return 2;
    case DDPW_WT_U32:
    case DDPW_WT_F32:
        return 4;
    case DDPW_WT_U64:
        return 8;
    case DDPW_WT_BYTES32:
        return DDPW_AUTH_BYTES;
    default:
        return 0;
    }
}

unsigned ddpw_layout_bulk(const ddpw_layout *L)
{
    unsigned i;
    for (i = 0; i < L->field_count; i++)
        if (is_bulk(L->fields[i].type))
            break;
    return i;
}

/* Bytes of the fields after field `from` (all fixed-size: messages.def); 0
 * from field_count on. */
static size_t fixed_after(const ddpw_layout *L, unsigned from)
{
    size_t size = 0;
    unsigned i;
    for (i = from + 1; i < L->field_count; i++)
        size += fixed_size(L->fields[i].type);
    return size;
}

size_t ddpw_tail_len(uint8_t tag)
{
    const ddpw_layout *L = BY_TAG[tag];
    /* without a bulk, nothing follows field_count */
    return L != NULL ? fixed_after(L, ddpw_layout_bulk(L)) : 0;
}

uint64_t ddpw_tag_max_payload(uint8_t tag, uint64_t max_frame)
{
    const ddpw_layout *L = BY_TAG[tag];
    uint64_t size = 1;
    unsigned i;
    if (L == NULL)
        return 0;
    if (ddpw_layout_bulk(L) < L->field_count)
        return max_frame;
    if (L->extensible)
        return DDPW_SMALL_MAX_PAYLOAD;
    for (i = 0; i < L->field_count; i++) {
        const size_t n = fixed_size(L->fields[i].type);
        if (n == 0)
            return DDPW_SMALL_MAX_PAYLOAD;
        size += n;
    }
    return size;
}

/* codes.def's names, indexed by code (NULL marks a gap): one table a
 * family, whose length is its bound. */
#define DDPW_EXT(name, ENUM, value) [value] = #name,
static const char *const EXT_NAMES[] = {
#include "codes.def"
};
#define DDPW_REFUSAL(name, ENUM, value) [value] = #name,
static const char *const REFUSAL_NAMES[] = {
#include "codes.def"
};
#define DDPW_KIND(name, ENUM, value) [value] = #name,
static const char *const KIND_NAMES[] = {
#include "codes.def"
};
#define DDPW_OP(name, ENUM, value) [value] = #name,
static const char *const OP_NAMES[] = {
#include "codes.def"
};
#define DDPW_DTYPE(name, ENUM, value, size) [value] = #name,
static const char *const DTYPE_NAMES[] = {
#include "codes.def"
};
#define DDPW_DTYPE(name, ENUM, value, size) [value] = size,
static const uint8_t DTYPE_SIZES[] = {
#include "codes.def"
};
#define DDPW_CODEC(name, ENUM, value) [value] = #name,
static const char *const CODEC_NAMES[] = {
#include "codes.def"
};

size_t ddpw_dtype_size(uint8_t dtype)
{
    return dtype < COUNT(DTYPE_SIZES) ? DTYPE_SIZES[dtype] : 0;
}

const char *ddpw_code_name(ddpw_code_family family, unsigned value)
{
    switch (family) {
    case DDPW_CODES_EXTENSION:
        return value < COUNT(EXT_NAMES) ? EXT_NAMES[value] : NULL;
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

#define MEMBER(m, f) ((void *)((uint8_t *)(m) + (f)->offset))
#define CMEMBER(m, f) ((const void *)((const uint8_t *)(m) + (f)->offset))

/* The field's rule, on a value read or about to be written. */
static ddpw_status check_rule(const char *type, const ddpw_field *f, const ddpw_message *m,
                              ddpw_error *err)
{
    switch (f->rule) {
    case DDPW_RULE_CODEC: {
        const uint8_t v = *(const uint8_t *)CMEMBER(m, f);
        if (ddpw_code_name(DDPW_CODES_CODEC, v) == NULL)
            return fail_invalid(err, type, f->name, v, "unknown codec");
        return DDPW_OK;
    }
    case DDPW_RULE_FLAG: {
        const uint8_t v = *(const uint8_t *)CMEMBER(m, f);
        if (v > 1)
            return fail_invalid(err, type, f->name, v, "not 0 or 1");
        return DDPW_OK;
    }
    case DDPW_RULE_SCALE: {
        const float v = *(const float *)CMEMBER(m, f);
        if (scale_refusal(v) != NULL)
            return fail_invalid_f32(err, type, f->name, v, scale_refusal(v));
        return DDPW_OK;
    }
    case DDPW_RULE_DTYPE: {
        const uint8_t v = *(const uint8_t *)CMEMBER(m, f);
        if (ddpw_dtype_size(v) == 0)
            return fail_invalid(err, type, f->name, v, "unknown dtype code");
        return DDPW_OK;
    }
    default:
        return DDPW_OK;
    }
}

/* A bulk of bytes against its message's other fields, before a byte of it
 * is read or written (the rules name the fields they compare with). */
static ddpw_status check_bytes_rule(const char *type, const ddpw_field *f, const ddpw_message *m,
                                    uint64_t bytes, ddpw_error *err)
{
    if (f->rule == DDPW_RULE_COUNT_OF_DTYPE) {
        const uint64_t item = ddpw_dtype_size(m->dtype); /* not 0: the DTYPE rule came first */
        if (m->count > UINT64_MAX / item)
            return fail_invalid(err, type, "count", m->count,
                                "elements whose byte length overflows 64 bits");
        if (bytes != m->count * item)
            return fail(err, DDPW_ERR_MISMATCH, type, f->name, bytes, m->count * item);
    } else if (f->rule == DDPW_RULE_WITHIN_TOTAL && bytes > m->total) {
        return fail_invalid(err, type, f->count_name, bytes, "more than the state's total");
    }
    return DDPW_OK;
}

/* One field that is not a bulk. */
static ddpw_status read_field(ddpw_reader *r, const char *type, const ddpw_field *f,
                              ddpw_message *m, ddpw_error *err)
{
    void *at = MEMBER(m, f);
    switch (f->type) {
    case DDPW_WT_U8:
        TRY(read_u8(r, (uint8_t *)at, type, f->name, err));
        break;
    case DDPW_WT_U16:
        TRY(read_u16(r, (uint16_t *)at, type, f->name, err));
        break;
    case DDPW_WT_U32:
        TRY(read_u32(r, (uint32_t *)at, type, f->name, err));
        break;
    case DDPW_WT_U64:
        TRY(read_u64(r, (uint64_t *)at, type, f->name, err));
        break;
    case DDPW_WT_F32:
        TRY(read_f32(r, (float *)at, type, f->name, err));
        break;
    case DDPW_WT_STRING:
        TRY(read_str(r, (ddpw_str *)at, type, f->name, f->count_name, err));
        break;
    case DDPW_WT_BYTES32:
        TRY(take(r, DDPW_AUTH_BYTES, (const uint8_t **)at, type, f->name, err));
        break;
    default: { /* DDPW_WT_U32LIST */
        ddpw_span *span = (ddpw_span *)at;
        const uint8_t *p;
        uint32_t n;
        TRY(read_u32(r, &n, type, f->count_name, err));
        /* n <= 2^32 - 1, so n * 4 cannot overflow 64 bits */
        TRY(take(r, (uint64_t)n * 4, &p, type, f->name, err));
        span->data = p;
        span->count = n;
        break;
    }
    }
    return check_rule(type, f, m, err);
}

static ddpw_status read_fields(ddpw_reader *r, const ddpw_layout *L, unsigned from, unsigned to,
                               ddpw_message *m, ddpw_error *err)
{
    unsigned i;
    for (i = from; i < to; i++)
        TRY(read_field(r, L->name, &L->fields[i], m, err));
    return DDPW_OK;
}

/* The fields after the bulk one by one, so a short tail names the field it
 * cuts. */
static ddpw_status check_tail_fits(const ddpw_layout *L, unsigned bulk, size_t left,
                                   ddpw_error *err)
{
    unsigned i;
    for (i = bulk + 1; i < L->field_count; i++) {
        const size_t n = fixed_size(L->fields[i].type);
        if (n > left)
            return fail(err, DDPW_ERR_TRUNCATED, L->name, L->fields[i].name, left, n);
        left -= n;
    }
    return DDPW_OK;
}

/* The bulk's count, then the checks that the bulk and the fields after it
 * fill the payload exactly, without touching the bulk: a streaming reader
 * learns of every problem before the bulk arrives. The bulk's span gets its
 * count; its data pointer is the caller's to set, once the bytes are there. */
static ddpw_status read_bulk_head(ddpw_reader *r, const ddpw_layout *L, unsigned bulk, int flags,
                                  ddpw_message *m, ddpw_head *h, ddpw_error *err)
{
    const ddpw_field *f = &L->fields[bulk];
    ddpw_span *span = (ddpw_span *)MEMBER(m, f);
    uint64_t count, bytes;
    size_t left, tail, end;

    TRY(read_u64(r, &count, L->name, f->count_name, err));
    if (f->type == DDPW_WT_F32VEC) {
        if (count > UINT64_MAX / 4) {
            err->value = count;
            return fail(err, DDPW_ERR_OVERFLOW, L->name, f->name, r->len - r->pos, UINT64_MAX);
        }
        bytes = count * 4;
    } else {
        bytes = count;
        TRY(check_bytes_rule(L->name, f, m, bytes, err));
    }
    left = r->len - r->pos;
    if (bytes > (uint64_t)left)
        return fail(err, DDPW_ERR_TRUNCATED, L->name, f->name, left, bytes);
    left -= (size_t)bytes;
    TRY(check_tail_fits(L, bulk, left, err));
    tail = fixed_after(L, bulk);
    end = r->pos + (size_t)bytes + tail;
    TRY(check_end(r, end, flags, L->name, err));

    span->count = count;
    h->has_bulk = 1;
    h->has_gradients = f->type == DDPW_WT_F32VEC;
    h->bulk_offset = r->pos;
    h->bulk_len = bytes;
    h->tail_len = tail;
    h->trailing_len = r->len - end;
    return DDPW_OK;
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
    const ddpw_layout *L;
    const char *type = NULL;
    unsigned bulk;
    ddpw_status st;

    memset(head, 0, sizeof *head);
    reader_init(&r, p, avail, payload_len);
    st = read_tag(&r, &head->msg.tag, &type, err);
    if (st == DDPW_OK) {
        L = BY_TAG[head->msg.tag];
        bulk = ddpw_layout_bulk(L);
        if (bulk < L->field_count) {
            st = read_fields(&r, L, 0, bulk, &head->msg, err);
            if (st == DDPW_OK)
                st = read_bulk_head(&r, L, bulk, flags, &head->msg, head, err);
        }
    }
    if (st == DDPW_NEED_MORE)
        head->need = err->need;
    return st;
}

ddpw_status ddpw_decode_tail(uint8_t tag, const uint8_t *p, size_t avail, ddpw_message *msg,
                             ddpw_error *err)
{
    const ddpw_layout *L = BY_TAG[tag];
    ddpw_reader r;
    if (L == NULL) {
        err->tag = tag;
        return fail(err, DDPW_ERR_UNKNOWN_TAG, NULL, "tag", 0, 0);
    }
    reader_init(&r, p, avail, avail);
    return read_fields(&r, L, ddpw_layout_bulk(L) + 1, L->field_count, msg, err);
}

ddpw_status ddpw_decode_payload(const uint8_t *p, size_t len, int flags, ddpw_message *msg,
                                ddpw_error *err)
{
    ddpw_reader r;
    const ddpw_layout *L;
    const char *type = NULL;
    unsigned bulk;

    memset(msg, 0, sizeof *msg);
    reader_init(&r, p, len, len);
    TRY(read_tag(&r, &msg->tag, &type, err));
    L = BY_TAG[msg->tag];
    bulk = ddpw_layout_bulk(L);
    if (bulk < L->field_count) {
        ddpw_head h;
        memset(&h, 0, sizeof h);
        TRY(read_fields(&r, L, 0, bulk, msg, err));
        TRY(read_bulk_head(&r, L, bulk, flags, msg, &h, err));
        ((ddpw_span *)MEMBER(msg, &L->fields[bulk]))->data = p + h.bulk_offset;
        /* read_bulk_head proved the tail lies inside the payload */
        r.pos = h.bulk_offset + (size_t)h.bulk_len;
        return read_fields(&r, L, bulk + 1, L->field_count, msg, err);
    }
    TRY(read_fields(&r, L, 0, L->field_count, msg, err));
    if (L->extensible)
        return read_ext_block(&r, flags, type, msg, err);
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

/* Payload bytes of a field; for a bulk, of its count alone. */
static uint64_t field_size(const ddpw_field *f, const ddpw_message *m)
{
    const void *at = CMEMBER(m, f);
    switch (f->type) {
    case DDPW_WT_STRING:
        return 4 + (uint64_t)((const ddpw_str *)at)->len;
    case DDPW_WT_U32LIST:
        return 4 + 4 * ((const ddpw_span *)at)->count; /* count checked < 2^32 */
    case DDPW_WT_F32VEC:
    case DDPW_WT_BYTES:
        return 8;
    default:
        return fixed_size(f->type);
    }
}

/* Payload bytes before the bulk, the bulk's count included (all of them
 * for a message without a bulk). */
static uint64_t head_fields_size(const ddpw_layout *L, const ddpw_message *m)
{
    const unsigned bulk = ddpw_layout_bulk(L);
    uint64_t size = 1 + (L->extensible ? ext_block_size(m) : 0);
    unsigned i;
    for (i = 0; i < L->field_count && i <= bulk; i++)
        size += field_size(&L->fields[i], m);
    return size;
}

/* The encoder refuses what the decoder would refuse, field by field. */
static ddpw_status check_field(const char *type, const ddpw_field *f, const ddpw_message *m,
                               ddpw_error *err)
{
    const void *at = CMEMBER(m, f);
    switch (f->type) {
    case DDPW_WT_STRING: {
        const ddpw_str *s = (const ddpw_str *)at;
        if ((uint64_t)s->len > UINT32_MAX) {
            err->value = s->len;
            return fail(err, DDPW_ERR_VALUE, type, f->name, s->len, UINT32_MAX);
        }
        if (s->len && s->data == NULL)
            return fail(err, DDPW_ERR_VALUE, type, f->name, 0, s->len);
        break;
    }
    case DDPW_WT_BYTES32:
        if (*(const uint8_t *const *)at == NULL)
            return fail(err, DDPW_ERR_VALUE, type, f->name, 0, DDPW_AUTH_BYTES);
        break;
    case DDPW_WT_U32LIST:
    case DDPW_WT_F32VEC:
    case DDPW_WT_BYTES: {
        const ddpw_span *span = (const ddpw_span *)at;
        if (f->type == DDPW_WT_U32LIST && span->count > UINT32_MAX) {
            err->value = span->count;
            return fail(err, DDPW_ERR_VALUE, type, f->name, span->count, UINT32_MAX);
        }
        if (span->count && span->data == NULL)
            return fail(err, DDPW_ERR_VALUE, type, f->name, 0, span->count);
        break;
    }
    default:
        break;
    }
    return check_rule(type, f, m, err);
}

ddpw_status ddpw_payload_size(const ddpw_message *m, uint64_t *size, ddpw_error *err)
{
    const ddpw_layout *L = BY_TAG[m->tag];
    uint64_t head, tail;
    unsigned i, bulk;
    if (L == NULL) {
        err->tag = m->tag;
        return fail(err, DDPW_ERR_UNKNOWN_TAG, NULL, "tag", 0, 0);
    }
    for (i = 0; i < L->field_count; i++)
        TRY(check_field(L->name, &L->fields[i], m, err));
    if (L->extensible)
        TRY(check_ext_entries(m, L->name, err));
    head = head_fields_size(L, m); /* each term < 2^35: no overflow */
    bulk = ddpw_layout_bulk(L);
    *size = head;
    if (bulk < L->field_count) {
        const ddpw_field *f = &L->fields[bulk];
        const uint64_t count = ((const ddpw_span *)CMEMBER(m, f))->count;
        tail = fixed_after(L, bulk);
        if (f->type == DDPW_WT_F32VEC) {
            if (count > (UINT64_MAX - head - tail) / 4) {
                err->value = count;
                return fail(err, DDPW_ERR_OVERFLOW, L->name, f->name, 0, UINT64_MAX);
            }
            *size = head + 4 * count + tail;
        } else {
            TRY(check_bytes_rule(L->name, f, m, count, err));
            if (count > UINT64_MAX - head - tail)
                return fail(err, DDPW_ERR_TOO_LARGE, L->name, NULL, UINT64_MAX, UINT32_MAX);
            *size = head + count + tail;
        }
    }
    if (*size > UINT32_MAX)
        return fail(err, DDPW_ERR_TOO_LARGE, L->name, NULL, *size, UINT32_MAX);
    return DDPW_OK;
}

size_t ddpw_head_size(const ddpw_message *m)
{
    const ddpw_layout *L = BY_TAG[m->tag];
    if (L == NULL)
        return 0;
    return DDPW_PREFIX_LEN + (size_t)head_fields_size(L, m);
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

/* One field; for a bulk, its count alone. */
static void write_field(ddpw_writer *w, const ddpw_field *f, const ddpw_message *m)
{
    const void *at = CMEMBER(m, f);
    switch (f->type) {
    case DDPW_WT_U8:
        put_u8(w, *(const uint8_t *)at);
        break;
    case DDPW_WT_U16:
        put_u16(w, *(const uint16_t *)at);
        break;
    case DDPW_WT_U32:
        put_u32(w, *(const uint32_t *)at);
        break;
    case DDPW_WT_U64:
        put_u64(w, *(const uint64_t *)at);
        break;
    case DDPW_WT_F32:
        put_f32(w, *(const float *)at);
        break;
    case DDPW_WT_STRING:
        put_str(w, *(const ddpw_str *)at);
        break;
    case DDPW_WT_BYTES32:
        put_bytes(w, *(const uint8_t *const *)at, DDPW_AUTH_BYTES);
        break;
    case DDPW_WT_U32LIST: {
        const ddpw_span *span = (const ddpw_span *)at;
        put_u32(w, (uint32_t)span->count); /* ddpw_payload_size checked it fits */
        put_words(w, span->data, span->count);
        break;
    }
    default: /* a bulk's count */
        put_u64(w, ((const ddpw_span *)at)->count);
        break;
    }
}

static void write_head(ddpw_writer *w, const ddpw_layout *L, const ddpw_message *m,
                       uint32_t payload_size)
{
    const unsigned bulk = ddpw_layout_bulk(L);
    unsigned i;
    put_prefix(w, payload_size);
    put_u8(w, m->tag);
    for (i = 0; i < L->field_count && i <= bulk; i++)
        write_field(w, &L->fields[i], m);
    if (L->extensible)
        write_ext_block(w, m);
}

static void write_tail(ddpw_writer *w, const ddpw_layout *L, const ddpw_message *m)
{
    unsigned i;
    for (i = ddpw_layout_bulk(L) + 1; i < L->field_count; i++)
        write_field(w, &L->fields[i], m);
}

ddpw_status ddpw_encode_head(const ddpw_message *m, uint8_t *out, size_t cap, size_t *written,
                             ddpw_error *err)
{
    ddpw_writer w;
    uint64_t size;
    TRY(ddpw_payload_size(m, &size, err));
    writer_init(&w, out, cap);
    write_head(&w, BY_TAG[m->tag], m, (uint32_t)size);
    return finish(&w, written, ddpw_message_type(m->tag), ddpw_head_size(m), err);
}

ddpw_status ddpw_encode_tail(const ddpw_message *m, uint8_t *out, size_t cap, size_t *written,
                             ddpw_error *err)
{
    const ddpw_layout *L = BY_TAG[m->tag];
    ddpw_writer w;
    if (L == NULL) {
        err->tag = m->tag;
        return fail(err, DDPW_ERR_UNKNOWN_TAG, NULL, "tag", 0, 0);
    }
    writer_init(&w, out, cap);
    write_tail(&w, L, m);
    return finish(&w, written, L->name, ddpw_tail_len(m->tag), err);
}

ddpw_status ddpw_encode_frame(const ddpw_message *m, uint8_t *out, size_t cap, size_t *written,
                              ddpw_error *err)
{
    const ddpw_layout *L;
    ddpw_writer w;
    uint64_t size;
    unsigned bulk;
    TRY(ddpw_payload_size(m, &size, err));
    L = BY_TAG[m->tag];
    bulk = ddpw_layout_bulk(L);
    writer_init(&w, out, cap);
    write_head(&w, L, m, (uint32_t)size);
    if (bulk < L->field_count) {
        const ddpw_field *f = &L->fields[bulk];
        const ddpw_span *span = (const ddpw_span *)CMEMBER(m, f);
        if (f->type == DDPW_WT_F32VEC)
            put_words(&w, span->data, span->count);
        else
            put_bytes(&w, (const uint8_t *)span->data, span->count);
        write_tail(&w, L, m);
    }
    return finish(&w, written, L->name, DDPW_PREFIX_LEN + size, err);
}

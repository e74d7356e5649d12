/* int8.c: the int8 wire codec (int8.h has the layout and the arithmetic). */
#include "int8.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* 1.5 * 2^23: adding and subtracting it rounds a float of magnitude below
 * 2^22 to an integer, to nearest with ties to even (the default rounding
 * mode, which nothing in ddpwire changes), in two operations the compiler
 * vectorises where nearbyintf would be a call per element. */
#define ROUNDER 12582912.0f

#define SCALE_BYTES 4

static size_t blocks_of(size_t n)
{
    return n / DDPW_INT8_BLOCK + (n % DDPW_INT8_BLOCK != 0);
}

size_t ddpw_int8_size(size_t n)
{
    size_t scales = blocks_of(n) * SCALE_BYTES;  /* at most n / 64 + 4: no overflow */
    return n > SIZE_MAX - scales ? 0 : n + scales;
}

static float get_scale(const uint8_t *p)
{
    uint32_t bits = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                    (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void put_scale(uint8_t *p, float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    p[0] = (uint8_t)bits;
    p[1] = (uint8_t)(bits >> 8);
    p[2] = (uint8_t)(bits >> 16);
    p[3] = (uint8_t)(bits >> 24);
}

static int64_t first_non_finite(const float *x, size_t m, size_t base)
{
    for (size_t i = 0; i < m; i++)
        if (!isfinite(x[i]))
            return (int64_t)(base + i);
    return -1;
}

/* One block of m elements: its scale, then its m codes. */
static void encode_block(uint8_t *restrict dst, const float *restrict src, size_t m, int *bad)
{
    float amax = 0.0f;
    int non_finite = 0;
    for (size_t i = 0; i < m; i++) {
        float a = fabsf(src[i]);
        non_finite |= !(a <= FLT_MAX);  /* NaN fails every comparison */
        amax = a > amax ? a : amax;
    }
    int8_t *codes = (int8_t *)(dst + SCALE_BYTES);
    float scale = non_finite ? NAN : amax / 127.0f;
    /* a block within a rounding of FLT_MAX: 127 * scale would decode to
     * inf, one step lower does not (its largest code clamps to 127) */
    if (!non_finite && !(scale * 127.0f <= FLT_MAX))
        scale = nextafterf(scale, 0.0f);
    *bad = non_finite;
    put_scale(dst, scale);
    if (non_finite || scale == 0.0f) {
        memset(codes, 0, m);
        return;
    }
    for (size_t i = 0; i < m; i++) {
        float v = src[i] / scale;
        v = v > 127.0f ? 127.0f : v;   /* clamped before rounding: 127 is whole, so */
        v = v < -127.0f ? -127.0f : v; /* it is the same as rounding, then clamping */
        codes[i] = (int8_t)((v + ROUNDER) - ROUNDER);
    }
}

int64_t ddpw_int8_encode(uint8_t *restrict dst, const float *restrict src, size_t n)
{
    int64_t first = -1;
    for (size_t at = 0; at < n; at += DDPW_INT8_BLOCK) {
        size_t m = n - at < DDPW_INT8_BLOCK ? n - at : DDPW_INT8_BLOCK;
        int bad;
        encode_block(dst + ddpw_int8_size(at), src + at, m, &bad);
        if (bad && first < 0)
            first = first_non_finite(src + at, m, at);
    }
    return first;
}

/* Whether a block of this scale can decode to a non-finite element: a
 * non-finite scale, or one so near FLT_MAX / 127 that 127 * scale rounds
 * past FLT_MAX. */
static int may_overflow(float scale)
{
    return !(fabsf(scale) * 127.0f <= FLT_MAX);
}

/* out[i] = code * scale (first) or out[i] + code * scale, for one block. */
static void decode_block(float *restrict out, const uint8_t *restrict src, size_t m, int first)
{
    float scale = get_scale(src);
    const int8_t *codes = (const int8_t *)(src + SCALE_BYTES);
    if (first) {
        for (size_t i = 0; i < m; i++)
            out[i] = (float)codes[i] * scale;
    } else {
        for (size_t i = 0; i < m; i++) {
            float x = (float)codes[i] * scale;  /* rounded here: -ffp-contract=off */
            out[i] = out[i] + x;
        }
    }
}

int64_t ddpw_int8_decode(float *restrict dst, const uint8_t *restrict src, size_t n)
{
    int64_t first = -1;
    for (size_t at = 0; at < n; at += DDPW_INT8_BLOCK) {
        size_t m = n - at < DDPW_INT8_BLOCK ? n - at : DDPW_INT8_BLOCK;
        const uint8_t *block = src + ddpw_int8_size(at);
        decode_block(dst + at, block, m, 1);
        if (first < 0 && may_overflow(get_scale(block)))
            first = first_non_finite(dst + at, m, at);
    }
    return first;
}

int64_t ddpw_int8_mean(float *restrict out, const uint8_t *const *inputs, size_t k, size_t n,
                       int divide, size_t *bad_input)
{
    int64_t first = -1;
    size_t first_input = 0;
    if (k == 0)
        return -1;
    float d = (float)k;
    /* block by block, every input in order: the block's sum stays in cache */
    for (size_t at = 0; at < n; at += DDPW_INT8_BLOCK) {
        size_t m = n - at < DDPW_INT8_BLOCK ? n - at : DDPW_INT8_BLOCK;
        size_t offset = ddpw_int8_size(at);
        for (size_t j = 0; j < k; j++) {
            const uint8_t *block = inputs[j] + offset;
            float scale = get_scale(block);
            const int8_t *codes = (const int8_t *)(block + SCALE_BYTES);
            if (may_overflow(scale)) {
                for (size_t i = 0; i < m; i++) {
                    float x = (float)codes[i] * scale;
                    if (!isfinite(x) && (first < 0 || j < first_input ||
                                         (j == first_input && (int64_t)(at + i) < first))) {
                        first = (int64_t)(at + i);
                        first_input = j;
                    }
                }
            }
            decode_block(out + at, block, m, j == 0);
        }
        if (divide)
            for (size_t i = 0; i < m; i++)
                out[at + i] = out[at + i] / d;
    }
    if (first >= 0 && bad_input != NULL)
        *bad_input = first_input;
    return first;
}

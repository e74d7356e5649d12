/* reduce.c: see reduce.h.
 *
 * The kernels are plain C loops written so the compiler vectorises them
 * (restrict pointers, one sum per element, vectors across elements only).
 * One generic loop body is compiled several times, once per instruction-set
 * path, by wrapping it in functions carrying GCC's target("...") attribute;
 * the path is picked at run time from cpuid. The portable path is all a
 * non-x86 or non-GNU compiler sees.
 *
 * Work goes in blocks of DDPW_BLOCK elements. Inside a block the inputs are
 * summed in groups of up to DDPW_GROUP: a group's inputs stream through one
 * loop together and the block of out stays in L1 between groups, so memory
 * sees each input read once and out written once. A block whose inputs hold
 * a non-finite value is rescanned (still in cache) to find the first one.
 *
 * A mean whose output range is far bigger than the cache writes it with
 * non-temporal stores on the x86 paths: a normal store first reads each line
 * of out from memory (read-for-ownership), a fifth more traffic for k = 4,
 * only to overwrite it. The sums then go to a block on the stack, which
 * stays in L1, and are streamed from there to out; the arithmetic is the
 * same loop as always, so the bits cannot change.
 */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* sysconf, pthreads under -std=c99 */
#endif

#include "reduce.h"

#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(DDPW_REDUCE_PORTABLE_ONLY)
#define DDPW_X86 1
#include <immintrin.h>
#endif

#if (defined(__unix__) || defined(__APPLE__)) && !defined(DDPW_REDUCE_NO_THREADS)
#define DDPW_THREADS 1
#include <pthread.h>
#include <unistd.h>
#endif

#if defined(__GNUC__)
#define DDPW_INLINE static inline __attribute__((always_inline))
#else
#define DDPW_INLINE static inline
#endif

/* 16 KiB of out per block: it and a group's input blocks fit in L1/L2. */
#define DDPW_BLOCK ((size_t)4096)
/* Inputs summed per loop: enough streams to keep memory busy, few enough
 * for the registers; 4 measured as fast as 8 and halves the code. */
#define DDPW_GROUP 4
/* Elements of out in one thread's range from which a mean streams its
 * stores (8 MiB): well past L2, and a quarter of this machine's L3, where
 * the output would be evicted before anyone read it anyway. */
#define DDPW_STREAM_MIN ((size_t)1 << 21)
/* Non-temporal stores go in whole cache lines. */
#define DDPW_LINE 64

/* The sign bit of the result is set exactly when x is a NaN or +/-inf (its
 * exponent is all ones): the add carries into bit 31 only from 0xff. An
 * integer test, so OR-ing it over a block vectorises and never traps. */
DDPW_INLINE uint32_t nonfinite_bit(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7f800000u) + 0x00800000u;
}

/* ---- loop bodies ---- */

DDPW_INLINE uint32_t body_check(const float *restrict s, size_t n)
{
    uint32_t f = 0;
    size_t i;
    for (i = 0; i < n; i++)
        f |= nonfinite_bit(s[i]);
    return f >> 31;
}

/* One group of c inputs x[0..c) into out, element by element:
 *   cont == 0:  s = ((x0 + x1) + ...) + x[c-1]
 *   cont == 1:  s = ((out + x0) + ...) + x[c-1]
 * then out = s, or s / d when dv. Returns nonzero when an x holds a
 * non-finite value (out is not checked). c, cont and dv are constants in
 * every caller, so the j loops unroll and the i loop vectorises. */
DDPW_INLINE uint32_t body_group(float *restrict out, const float *const *x, size_t c, int cont,
                               int dv, float d, size_t n)
{
    const float *p[DDPW_GROUP];
    uint32_t f = 0;
    size_t i, j;
    for (j = 0; j < c; j++)
        p[j] = x[j];
    for (i = 0; i < n; i++) {
        float s = cont ? out[i] : p[0][i];
        for (j = cont ? 0 : 1; j < c; j++)
            s = s + p[j][i];
        for (j = 0; j < c; j++)
            f |= nonfinite_bit(p[j][i]);
        out[i] = dv ? s / d : s;
    }
    return f >> 31;
}

DDPW_INLINE void body_scale(float *restrict b, float d, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        b[i] = b[i] / d;
}

/* ---- 16-bit conversions ----
 * Branch-free integer selects on each element's bits, so the loops vectorise
 * on every path and all paths agree. */

DDPW_INLINE uint32_t float_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

DDPW_INLINE float bits_float(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

DDPW_INLINE uint16_t narrow_bf16(uint32_t u)
{
    /* adding 0x7fff plus the lowest kept bit carries exactly when the
     * dropped half is above a tie, or a tie next to an odd kept value */
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

DDPW_INLINE uint16_t narrow_fp16(uint32_t u)
{
    uint32_t a = u & 0x7fffffffu, sign = (u >> 16) & 0x8000u;
    /* normal: rebias the exponent (127 - 15 = 112) and round as for bf16;
     * a carry out of the mantissa correctly bumps the exponent */
    uint32_t norm = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    /* below 2^-14: adding 0.5f leaves the value rounded (nearest even, the
     * float adder's own rounding) to a multiple of 2^-24, 0.5f's ulp, in
     * the low bits; f32 subnormals are far below half of 2^-24 */
    uint32_t sub = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x03ffu);
    uint32_t r = a < 0x38800000u ? sub : norm;
    /* 65520 and up (halfway past 65504, whose mantissa is odd) round to inf */
    r = a >= 0x477ff000u ? 0x7c00u : r;
    r = a > 0x7f800000u ? nan : r;
    return (uint16_t)(r | sign);
}

DDPW_INLINE float widen_bf16(uint16_t h)
{
    return bits_float((uint32_t)h << 16);
}

DDPW_INLINE float widen_fp16(uint16_t h)
{
    uint32_t a = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t r = (a << 13) + 0x38000000u;
    /* exponent 31 (inf, NaN) maps to 255, payload kept */
    r = a >= 0x7c00u ? r + 0x38000000u : r;
    /* subnormal: a * 2^-24, exact in float32 */
    r = a < 0x0400u ? float_bits((float)(int32_t)a * 0x1p-24f) : r;
    return bits_float(r | sign);
}

DDPW_INLINE uint32_t body_to_half(uint16_t *restrict d, const float *restrict s, int codec,
                                  size_t n)
{
    uint32_t f = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t u = float_bits(s[i]);
        f |= nonfinite_bit(s[i]);
        d[i] = codec == DDPW_HALF_BF16 ? narrow_bf16(u) : narrow_fp16(u);
    }
    return f >> 31;
}

DDPW_INLINE uint32_t body_from_half(float *restrict d, const uint16_t *restrict s, int codec,
                                    size_t n)
{
    uint32_t f = 0;
    size_t i;
    for (i = 0; i < n; i++) {
        float x = codec == DDPW_HALF_BF16 ? widen_bf16(s[i]) : widen_fp16(s[i]);
        f |= nonfinite_bit(x);
        d[i] = x;
    }
    return f >> 31;
}

/* ---- one table of block kernels per path ---- */

typedef uint32_t (*group_fn)(float *, const float *const *, float, size_t);

typedef struct kernels {
    uint32_t (*check)(const float *, size_t);
    group_fn group[2][2][DDPW_GROUP]; /* [cont][dv][c - 1] */
    void (*scale)(float *, float, size_t);
    /* [codec - 1]: bf16, fp16; return nonzero when src holds a non-finite */
    uint32_t (*to_half[2])(uint16_t *, const float *, size_t);
    uint32_t (*from_half[2])(float *, const uint16_t *, size_t);
    /* NULL where the path has no non-temporal stores; else out[0..n) =
     * src[0..n) past the cache (out and src line-aligned, n a multiple of
     * a line), and the fence that orders those stores before returning. */
    void (*stream)(float *, const float *, size_t);
    void (*fence)(void);
} kernels;

#define DDPW_GROUP_FN(sfx, ATTR, c, cont, dv)                                              \
    ATTR static uint32_t group_##sfx##_##c##_##cont##dv(float *restrict o,                \
                                                        const float *const *x, float d,   \
                                                        size_t n)                         \
    {                                                                                     \
        return body_group(o, x, c, cont, dv, d, n);                                       \
    }

#define DDPW_GROUP_FNS(sfx, ATTR, cont, dv)                                                \
    DDPW_GROUP_FN(sfx, ATTR, 1, cont, dv)                                                  \
    DDPW_GROUP_FN(sfx, ATTR, 2, cont, dv)                                                  \
    DDPW_GROUP_FN(sfx, ATTR, 3, cont, dv)                                                  \
    DDPW_GROUP_FN(sfx, ATTR, 4, cont, dv)

#define DDPW_GROUP_ROW(sfx, cont, dv)                                                      \
    {                                                                                     \
        group_##sfx##_1_##cont##dv, group_##sfx##_2_##cont##dv,                           \
            group_##sfx##_3_##cont##dv, group_##sfx##_4_##cont##dv                        \
    }

/* fp16 conversions. The bodies above are exact but slow (1-2 ns per
 * element however they are compiled: the rounding takes integer and float
 * steps per element); x86's F16C instructions do the same conversions,
 * rounding to nearest even, in one instruction per 8 elements. */
static uint32_t to_fp16_portable(uint16_t *restrict d, const float *restrict s, size_t n)
{
    return body_to_half(d, s, DDPW_HALF_FP16, n);
}

static uint32_t from_fp16_portable(float *restrict d, const uint16_t *restrict s, size_t n)
{
    return body_from_half(d, s, DDPW_HALF_FP16, n);
}

#if defined(DDPW_X86)
#include <cpuid.h>

/* -1 until asked; libgcc's __builtin_cpu_supports has no reliable "f16c" */
static int f16c_present = -1;

static int have_f16c(void)
{
    int v = __atomic_load_n(&f16c_present, __ATOMIC_RELAXED);
    if (v < 0) {
        unsigned a = 0, b = 0, c = 0, d = 0;
        v = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) ? 1 : 0;
        __atomic_store_n(&f16c_present, v, __ATOMIC_RELAXED);
    }
    return v;
}

__attribute__((target("avx2,f16c"))) static uint32_t to_fp16_f16c(uint16_t *restrict d,
                                                                   const float *restrict s,
                                                                   size_t n)
{
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    size_t i = 0;
    /* vcvtps2ph rounds to nearest even, overflows to inf, keeps a NaN's top
     * payload bits with the quiet bit set: narrow_fp16's bits for every input */
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        __m256i u = _mm256_and_si256(_mm256_castps_si256(x), exp);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(u, exp));
        _mm_storeu_si128((__m128i *)(void *)(d + i),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    return (uint32_t)!_mm256_testz_si256(bad, bad) | to_fp16_portable(d + i, s + i, n - i);
}

__attribute__((target("avx2,f16c"))) static uint32_t from_fp16_f16c(float *restrict d,
                                                                     const uint16_t *restrict s,
                                                                     size_t n)
{
    const __m128i magnitude = _mm_set1_epi16(0x7fff);
    const __m128i inf_less_1 = _mm_set1_epi16(0x7bff), quiet = _mm_set1_epi16(0x7e00);
    uint32_t f = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(s + i));
        __m128i a = _mm_and_si128(h, magnitude);
        __m128i nonfinite = _mm_cmpgt_epi16(a, inf_less_1);
        /* vcvtph2ps quiets a signalling NaN; widen_fp16 keeps its bits */
        __m128i signalling = _mm_and_si128(_mm_cmpgt_epi16(a, _mm_set1_epi16(0x7c00)),
                                           _mm_cmplt_epi16(a, quiet));
        if (!_mm_testz_si128(signalling, signalling)) {
            f |= from_fp16_portable(d + i, s + i, 8);
            continue;
        }
        f |= (uint32_t)!_mm_testz_si128(nonfinite, nonfinite);
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
    }
    return f | from_fp16_portable(d + i, s + i, n - i);
}

static uint32_t to_fp16_x86(uint16_t *restrict d, const float *restrict s, size_t n)
{
    return have_f16c() ? to_fp16_f16c(d, s, n) : to_fp16_portable(d, s, n);
}

static uint32_t from_fp16_x86(float *restrict d, const uint16_t *restrict s, size_t n)
{
    return have_f16c() ? from_fp16_f16c(d, s, n) : from_fp16_portable(d, s, n);
}
#endif

/* Stamps out the bodies above as functions compiled for one target. */
#define DDPW_STAMP(sfx, ATTR, STREAM, FENCE, TO_FP16, FROM_FP16)                           \
    ATTR static uint32_t check_##sfx(const float *restrict s, size_t n)                   \
    {                                                                                     \
        return body_check(s, n);                                                          \
    }                                                                                     \
    ATTR static void scale_##sfx(float *restrict b, float d, size_t n)                    \
    {                                                                                     \
        body_scale(b, d, n);                                                              \
    }                                                                                     \
    ATTR static uint32_t to_bf16_##sfx(uint16_t *restrict d, const float *restrict s,     \
                                       size_t n)                                          \
    {                                                                                     \
        return body_to_half(d, s, DDPW_HALF_BF16, n);                                     \
    }                                                                                     \
    ATTR static uint32_t from_bf16_##sfx(float *restrict d, const uint16_t *restrict s,   \
                                         size_t n)                                        \
    {                                                                                     \
        return body_from_half(d, s, DDPW_HALF_BF16, n);                                   \
    }                                                                                     \
    DDPW_GROUP_FNS(sfx, ATTR, 0, 0)                                                        \
    DDPW_GROUP_FNS(sfx, ATTR, 0, 1)                                                        \
    DDPW_GROUP_FNS(sfx, ATTR, 1, 0)                                                        \
    DDPW_GROUP_FNS(sfx, ATTR, 1, 1)                                                        \
    static const kernels kernels_##sfx = {                                                \
        check_##sfx,                                                                      \
        {{DDPW_GROUP_ROW(sfx, 0, 0), DDPW_GROUP_ROW(sfx, 0, 1)},                            \
         {DDPW_GROUP_ROW(sfx, 1, 0), DDPW_GROUP_ROW(sfx, 1, 1)}},                           \
        scale_##sfx,                                                                      \
        {to_bf16_##sfx, TO_FP16},                                                         \
        {from_bf16_##sfx, FROM_FP16},                                                     \
        STREAM, FENCE}

#if defined(DDPW_X86)
__attribute__((target("avx2"))) static void stream_avx2(float *out, const float *src, size_t n)
{
    size_t i;
    for (i = 0; i < n; i += 8)
        _mm256_stream_ps(out + i, _mm256_load_ps(src + i));
}

__attribute__((target("avx512f"))) static void stream_avx512(float *out, const float *src,
                                                             size_t n)
{
    size_t i;
    for (i = 0; i < n; i += 16)
        _mm512_stream_ps(out + i, _mm512_load_ps(src + i));
}

__attribute__((target("avx2"))) static void fence_avx2(void)
{
    _mm_sfence();
}
#endif

#define DDPW_NO_ATTR
DDPW_STAMP(portable, DDPW_NO_ATTR, NULL, NULL, to_fp16_portable, from_fp16_portable);
#if defined(DDPW_X86)
DDPW_STAMP(avx2, __attribute__((target("avx2"))), stream_avx2, fence_avx2, to_fp16_x86,
           from_fp16_x86);
DDPW_STAMP(avx512, __attribute__((target("avx512f"))), stream_avx512, fence_avx2, to_fp16_x86,
           from_fp16_x86);
#endif

static const kernels *const table[DDPW_REDUCE_NPATHS] = {
    &kernels_portable,
#if defined(DDPW_X86)
    &kernels_avx2,
    &kernels_avx512,
#else
    NULL,
    NULL,
#endif
};

/* ---- settings: path and threads ---- */

#if defined(__GNUC__)
#define DDPW_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define DDPW_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#else
#define DDPW_LOAD(p) (*(p))
#define DDPW_STORE(p, v) (*(p) = (v))
#endif

/* -1 until first use, which picks the best path / the default count. */
static int selected_path = -1;
static int thread_limit = -1;

unsigned ddpw_reduce_paths(void)
{
    unsigned mask = 1u << DDPW_REDUCE_PORTABLE;
#if defined(DDPW_X86)
    __builtin_cpu_init();
    /* libgcc's answer includes the OS check (XGETBV) for the wider registers */
    if (__builtin_cpu_supports("avx2"))
        mask |= 1u << DDPW_REDUCE_AVX2;
    if (__builtin_cpu_supports("avx512f"))
        mask |= 1u << DDPW_REDUCE_AVX512;
#endif
    return mask;
}

const char *ddpw_reduce_path_name(int path)
{
    switch (path) {
    case DDPW_REDUCE_PORTABLE:
        return "portable";
    case DDPW_REDUCE_AVX2:
        return "avx2";
    case DDPW_REDUCE_AVX512:
        return "avx512";
    default:
        return NULL;
    }
}

static int best_path(void)
{
    unsigned mask = ddpw_reduce_paths();
    int p;
    for (p = DDPW_REDUCE_NPATHS - 1; p > 0; p--)
        if (mask & (1u << p))
            return p;
    return DDPW_REDUCE_PORTABLE;
}

int ddpw_reduce_set_path(int path)
{
    if (path == DDPW_REDUCE_AUTO) {
        DDPW_STORE(&selected_path, best_path());
        return 0;
    }
    if (path < 0 || path >= DDPW_REDUCE_NPATHS || !(ddpw_reduce_paths() & (1u << path)))
        return -1;
    DDPW_STORE(&selected_path, path);
    return 0;
}

int ddpw_reduce_get_path(void)
{
    int p = DDPW_LOAD(&selected_path);
    if (p < 0) {
        p = best_path(); /* racing first callers all store the same value */
        DDPW_STORE(&selected_path, p);
    }
    return p;
}

static int default_threads(void)
{
#if defined(DDPW_THREADS) && defined(_SC_NPROCESSORS_ONLN)
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus > DDPW_REDUCE_MAX_THREADS)
        return DDPW_REDUCE_MAX_THREADS;
    if (cpus > 1)
        return (int)cpus;
#endif
    return 1;
}

int ddpw_reduce_set_threads(int threads)
{
    if (threads < 0)
        return -1;
    if (threads > DDPW_REDUCE_MAX_THREADS)
        threads = DDPW_REDUCE_MAX_THREADS;
    DDPW_STORE(&thread_limit, threads == 0 ? default_threads() : threads);
    return 0;
}

int ddpw_reduce_get_threads(void)
{
    int t = DDPW_LOAD(&thread_limit);
    if (t < 0) {
        t = default_threads();
        DDPW_STORE(&thread_limit, t);
    }
    return t;
}

/* ---- drivers over one element range ---- */

static size_t min_size(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* First non-finite index of s[0..n), or -1; scalar, for flagged blocks only. */
static int64_t scan(const float *s, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        if (nonfinite_bit(s[i]) >> 31)
            return (int64_t)i;
    return -1;
}

/* The first non-finite so far, ordered by (input, index). Blocks go in
 * index order, so an input's first hit is final; only a lower-numbered
 * input can replace it. */
typedef struct first_bad {
    size_t input; /* k (no input) while none is found */
    int64_t index;
} first_bad;

static void note(first_bad *fb, size_t input, const float *block, size_t at, size_t m)
{
    int64_t i;
    if (input >= fb->input)
        return;
    i = scan(block, m);
    if (i >= 0) {
        fb->input = input;
        fb->index = (int64_t)at + i;
    }
}

enum {
    OP_MEAN, OP_TOTAL, OP_ACCUMULATE, OP_COPY, OP_SCALE, OP_TO_HALF, OP_FROM_HALF, OP_MEAN_HALF,
    OP_TOTAL_HALF
};

/* One call's work on elements [from, to). For OP_ACCUMULATE and OP_SCALE,
 * out is also the first operand; OP_COPY, OP_ACCUMULATE and OP_TO_HALF use
 * inputs[0]; the 16-bit side of a conversion or a 16-bit mean is hout and
 * hin. */
typedef struct task {
    const kernels *K;
    int op;
    float *out;
    const float *const *inputs;
    size_t k;
    float d;
    size_t from, to;
    first_bad fb;
    int codec;
    uint16_t *hout;
    const uint16_t *const *hin;
    float *also; /* OP_MEAN and OP_TOTAL: a second copy of out, or NULL */
} task;

/* The mean (OP_TOTAL: the sum) of elements [from, to), block by block. With
 * stage == NULL each block is written to out with normal stores. Otherwise
 * every group, the last included, writes the block into stage (a
 * line-aligned block on the stack), which is then streamed to out, so no
 * line of out is ever read; out + from must then be line-aligned and
 * to - from a multiple of a line. */
static void run_mean_blocks(task *t, size_t from, size_t to, float *stage)
{
    const kernels *K = t->K;
    const size_t k = t->k;
    size_t at, m, j, c;
    for (at = from; at < to; at += m) {
        const float *x[DDPW_GROUP];
        float *dst = stage != NULL ? stage : t->out + at;
        m = min_size(DDPW_BLOCK, to - at);
        for (j = 0; j < k; j += c) {
            const int cont = j > 0;
            size_t g;
            c = min_size(DDPW_GROUP, k - j);
            for (g = 0; g < c; g++)
                x[g] = t->inputs[j + g] + at;
            if (K->group[cont][t->op == OP_MEAN && j + c == k][c - 1](dst, x, t->d, m))
                for (g = 0; g < c; g++)
                    note(&t->fb, j + g, x[g], at, m);
        }
        if (stage != NULL)
            K->stream(t->out + at, stage, m);
        if (t->also != NULL) /* dst still holds the block: L1 to lines just read */
            memcpy(t->also + at, dst, m * sizeof(float));
    }
}

#if defined(DDPW_X86)
static void run_mean_streamed(task *t, size_t from, size_t to)
{
    float stage[DDPW_BLOCK] __attribute__((aligned(DDPW_LINE)));
    run_mean_blocks(t, from, to, stage);
}
#endif

/* A large range streams its whole lines and stores the partial lines at
 * either end normally, so no line is written both ways or by two threads.
 * The three pieces go in index order, which note() relies on. */
static void run_mean(task *t)
{
#if defined(DDPW_X86)
    const size_t per_line = DDPW_LINE / sizeof(float);
    if (t->K->stream != NULL && t->to - t->from >= DDPW_STREAM_MIN) {
        /* out is float-aligned, so the misalignment is whole floats */
        size_t skew = (size_t)((uintptr_t)(t->out + t->from) % DDPW_LINE) / sizeof(float);
        size_t head = t->from + (skew ? per_line - skew : 0);
        size_t tail = head + (t->to - head) / per_line * per_line;
        run_mean_blocks(t, t->from, head, NULL);
        run_mean_streamed(t, head, tail);
        t->K->fence(); /* before the caller (or a join) may read out */
        run_mean_blocks(t, tail, t->to, NULL);
        return;
    }
#endif
    run_mean_blocks(t, t->from, t->to, NULL);
}

/* A 16-bit mean block by block: each group's inputs are widened into
 * float32 blocks on the stack and summed by the float32 group kernels, so
 * the arithmetic is ddpw_mean's own; the finished block is narrowed once.
 * The block is small so the widened inputs and the sum stay in L1. */
#define DDPW_HALF_BLOCK ((size_t)1024)

static void run_mean_half(task *t)
{
    const kernels *K = t->K;
    const size_t k = t->k;
    const int ci = t->codec - 1;
    float acc[DDPW_HALF_BLOCK];
    float wide[DDPW_GROUP][DDPW_HALF_BLOCK];
    size_t at, m, j, c, g;
    for (at = t->from; at < t->to; at += m) {
        const float *x[DDPW_GROUP];
        m = min_size(DDPW_HALF_BLOCK, t->to - at);
        for (j = 0; j < k; j += c) {
            c = min_size(DDPW_GROUP, k - j);
            for (g = 0; g < c; g++) {
                K->from_half[ci](wide[g], t->hin[j + g] + at, m);
                x[g] = wide[g];
            }
            /* widened blocks hold a non-finite exactly where the inputs do */
            if (K->group[j > 0][t->op == OP_MEAN_HALF && j + c == k][c - 1](acc, x, t->d, m))
                for (g = 0; g < c; g++)
                    note(&t->fb, j + g, x[g], at, m);
        }
        K->to_half[ci](t->hout + at, acc, m);
    }
}

static void run_task(task *t)
{
    size_t at, m;
    switch (t->op) {
    case OP_MEAN:
    case OP_TOTAL:
        run_mean(t);
        break;
    case OP_ACCUMULATE:
    case OP_COPY:
        for (at = t->from; at < t->to; at += m) {
            const float *x = t->inputs[0] + at;
            m = min_size(DDPW_BLOCK, t->to - at);
            if (t->K->group[t->op == OP_ACCUMULATE][0][0](t->out + at, &x, 1.0f, m))
                note(&t->fb, 0, x, at, m);
        }
        break;
    case OP_SCALE:
        t->K->scale(t->out + t->from, t->d, t->to - t->from);
        break;
    case OP_TO_HALF:
        for (at = t->from; at < t->to; at += m) {
            const float *x = t->inputs[0] + at;
            m = min_size(DDPW_BLOCK, t->to - at);
            if (t->K->to_half[t->codec - 1](t->hout + at, x, m))
                note(&t->fb, 0, x, at, m);
        }
        break;
    case OP_FROM_HALF:
        for (at = t->from; at < t->to; at += m) {
            m = min_size(DDPW_BLOCK, t->to - at);
            /* the widened block is non-finite exactly where the source is */
            if (t->K->from_half[t->codec - 1](t->out + at, t->hin[0] + at, m))
                note(&t->fb, 0, t->out + at, at, m);
        }
        break;
    case OP_MEAN_HALF:
    case OP_TOTAL_HALF:
        run_mean_half(t);
        break;
    default:
        break;
    }
}

#if defined(DDPW_THREADS)
static void *thread_main(void *arg)
{
    run_task((task *)arg);
    return NULL;
}
#endif

/* Runs t over [0, n), split into contiguous block-aligned ranges when n is
 * large and threads are allowed. Each element is computed by exactly the same
 * instructions whichever range holds it, so the split cannot change a bit;
 * the ranges' first non-finite values are merged by (input, index). */
static first_bad run_split(task *t, size_t n)
{
    first_bad fb;
#if defined(DDPW_THREADS)
    task parts[DDPW_REDUCE_MAX_THREADS];
    pthread_t ids[DDPW_REDUCE_MAX_THREADS];
    int started[DDPW_REDUCE_MAX_THREADS];
    size_t nparts = (size_t)ddpw_reduce_get_threads(), per, i;
    if (nparts > n / DDPW_REDUCE_MIN_SPLIT)
        nparts = n / DDPW_REDUCE_MIN_SPLIT;
    if (nparts > 1) {
        per = (n / nparts + DDPW_BLOCK - 1) / DDPW_BLOCK * DDPW_BLOCK;
        for (i = 0; i < nparts; i++) {
            parts[i] = *t;
            parts[i].from = min_size(i * per, n);
            parts[i].to = i + 1 == nparts ? n : min_size((i + 1) * per, n);
            started[i] = 0;
        }
        /* part 0 runs here; a part whose thread cannot start runs here too */
        for (i = 1; i < nparts; i++)
            started[i] = pthread_create(&ids[i], NULL, thread_main, &parts[i]) == 0;
        run_task(&parts[0]);
        for (i = 1; i < nparts; i++) {
            if (started[i])
                pthread_join(ids[i], NULL);
            else
                run_task(&parts[i]);
        }
        fb = parts[0].fb;
        for (i = 1; i < nparts; i++)
            if (parts[i].fb.input < fb.input) /* equal input: the lower range wins */
                fb = parts[i].fb;
        return fb;
    }
#endif
    t->from = 0;
    t->to = n;
    run_task(t);
    fb = t->fb;
    return fb;
}

static task make_task(int op, float *out, const float *const *inputs, size_t k, float d)
{
    task t;
    t.K = table[ddpw_reduce_get_path()];
    t.op = op;
    t.out = out;
    t.inputs = inputs;
    t.k = k;
    t.d = d;
    t.from = t.to = 0;
    t.fb.input = k;
    t.fb.index = -1;
    t.codec = DDPW_HALF_NONE;
    t.hout = NULL;
    t.hin = NULL;
    t.also = NULL;
    return t;
}

/* ---- public kernels ---- */

int64_t ddpw_first_non_finite(const float *buf, size_t n)
{
    const kernels *K = table[ddpw_reduce_get_path()];
    size_t at, m;
    for (at = 0; at < n; at += m) {
        m = min_size(DDPW_BLOCK, n - at);
        if (K->check(buf + at, m))
            return (int64_t)at + scan(buf + at, m);
    }
    return -1;
}

int64_t ddpw_copy_checked(float *restrict dst, const float *restrict src, size_t n)
{
    const float *x = src;
    task t = make_task(OP_COPY, dst, &x, 1, 1.0f);
    return run_split(&t, n).index;
}

int64_t ddpw_accumulate(float *restrict acc, const float *restrict src, size_t n)
{
    const float *x = src;
    task t = make_task(OP_ACCUMULATE, acc, &x, 1, 1.0f);
    return run_split(&t, n).index;
}

void ddpw_scale(float *buf, float divisor, size_t n)
{
    task t = make_task(OP_SCALE, buf, NULL, 0, divisor);
    run_split(&t, n);
}

static int64_t run_k(int op, float *out, float *also, const float *const *inputs, size_t k,
                     size_t n, size_t *bad_input)
{
    task t;
    first_bad fb;
    if (k == 0)
        return -1;
    t = make_task(op, out, inputs, k, (float)k);
    t.also = also;
    fb = run_split(&t, n);
    if (fb.index >= 0 && bad_input != NULL)
        *bad_input = fb.input;
    return fb.index;
}

int64_t ddpw_mean(float *restrict out, const float *const *inputs, size_t k, size_t n,
                 size_t *bad_input)
{
    return run_k(OP_MEAN, out, NULL, inputs, k, n, bad_input);
}

int64_t ddpw_total(float *restrict out, const float *const *inputs, size_t k, size_t n,
                  size_t *bad_input)
{
    return run_k(OP_TOTAL, out, NULL, inputs, k, n, bad_input);
}

int64_t ddpw_reduce_also(float *restrict out, float *also, const float *const *inputs, size_t k,
                        size_t n, int divide, size_t *bad_input)
{
    return run_k(divide ? OP_MEAN : OP_TOTAL, out, also, inputs, k, n, bad_input);
}

static int known_codec(int codec)
{
    return codec == DDPW_HALF_BF16 || codec == DDPW_HALF_FP16;
}

int64_t ddpw_to_half(uint16_t *restrict dst, const float *restrict src, size_t n, int codec)
{
    const float *x = src;
    task t;
    if (!known_codec(codec))
        return DDPW_HALF_BAD_CODEC;
    t = make_task(OP_TO_HALF, NULL, &x, 1, 1.0f);
    t.codec = codec;
    t.hout = dst;
    return run_split(&t, n).index;
}

int64_t ddpw_from_half(float *restrict dst, const uint16_t *restrict src, size_t n, int codec)
{
    const uint16_t *x = src;
    task t;
    if (!known_codec(codec))
        return DDPW_HALF_BAD_CODEC;
    t = make_task(OP_FROM_HALF, dst, NULL, 1, 1.0f);
    t.codec = codec;
    t.hin = &x;
    return run_split(&t, n).index;
}

static int64_t run_half_k(int op, uint16_t *restrict out, const uint16_t *const *inputs,
                          size_t k, size_t n, int codec, size_t *bad_input)
{
    task t;
    first_bad fb;
    if (!known_codec(codec))
        return DDPW_HALF_BAD_CODEC;
    if (k == 0)
        return -1;
    t = make_task(op, NULL, NULL, k, (float)k);
    t.codec = codec;
    t.hout = out;
    t.hin = inputs;
    fb = run_split(&t, n);
    if (fb.index >= 0 && bad_input != NULL)
        *bad_input = fb.input;
    return fb.index;
}

int64_t ddpw_mean_half(uint16_t *restrict out, const uint16_t *const *inputs, size_t k, size_t n,
                      int codec, size_t *bad_input)
{
    return run_half_k(OP_MEAN_HALF, out, inputs, k, n, codec, bad_input);
}

int64_t ddpw_total_half(uint16_t *restrict out, const uint16_t *const *inputs, size_t k,
                        size_t n, int codec, size_t *bad_input)
{
    return run_half_k(OP_TOTAL_HALF, out, inputs, k, n, codec, bad_input);
}

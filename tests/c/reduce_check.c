/* Exercises csrc/reduce.c from C, under AddressSanitizer and UBSan: every
 * path, thread counts, float-aligned (not vector-aligned) pointers, buffers
 * ending exactly at the allocation's end, and the non-finite reporting rules.
 * Compares against a scalar loop in the reference order. Exit 0 = pass. */
#include "reduce.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(cond)                                                         \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                     \
        }                                                                   \
    } while (0)

static unsigned long long rng_state = 88172645463325252ull;

static float random_float(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state % 2000001) / 1000.0 - 1000.0);
}

/* n floats that end at the end of their own allocation (so ASan sees any
 * overread), starting one float past a malloc'd (aligned) address. */
static float *tail_buffer(size_t n, float **block)
{
    *block = malloc((n + 1) * sizeof(float));
    if (*block == NULL)
        abort();
    return *block + 1;
}

static int same_bits(const float *a, const float *b, size_t n)
{
    return memcmp(a, b, n * sizeof(float)) == 0;
}

static void check_mean(size_t k, size_t n)
{
    float *blocks[10], *outblock, *refblock;
    const float *inputs[10];
    float *out = tail_buffer(n, &outblock), *ref = tail_buffer(n, &refblock);
    size_t i, j, bad_input = 99;
    for (j = 0; j < k; j++) {
        float *x = tail_buffer(n, &blocks[j]);
        for (i = 0; i < n; i++)
            x[i] = random_float();
        inputs[j] = x;
    }
    for (i = 0; i < n; i++) {
        float s = inputs[0][i];
        for (j = 1; j < k; j++)
            s = s + inputs[j][i];
        ref[i] = s / (float)k;
    }
    CHECK(ddpw_mean(out, inputs, k, n, &bad_input) == -1);
    CHECK(bad_input == 99);
    CHECK(same_bits(out, ref, n));

    if (n > 0 && k > 1) {
        /* input k-1 bad at 0, input 1 bad at the end: input 1 is first */
        ((float *)inputs[k - 1])[0] = NAN;
        ((float *)inputs[1])[n - 1] = -INFINITY;
        CHECK(ddpw_mean(out, inputs, k, n, &bad_input) == (int64_t)(k - 1 == 1 ? 0 : n - 1));
        CHECK(bad_input == 1);
        CHECK(ddpw_first_non_finite(inputs[1], n) == (int64_t)(k - 1 == 1 ? 0 : n - 1));
        /* the streaming form reports the same, and finishes the buffer */
        CHECK(ddpw_copy_checked(out, inputs[0], n) == -1);
        CHECK(ddpw_accumulate(out, inputs[1], n) == (int64_t)(k - 1 == 1 ? 0 : n - 1));
        CHECK(isinf(out[n - 1]) || isnan(out[n - 1]));
    }
    for (j = 0; j < k; j++)
        free(blocks[j]);
    free(outblock);
    free(refblock);
}

/* Scalar references for the 16-bit codecs, written on the value (ldexp,
 * frexp) rather than on the bits as the kernels are. */
static float ref_widen(uint16_t h, int codec)
{
    uint32_t u;
    float x;
    int e, sign = h >> 15;
    unsigned m;
    if (codec == DDPW_HALF_BF16) {
        u = (uint32_t)h << 16;
        memcpy(&x, &u, sizeof x);
        return x;
    }
    e = (h >> 10) & 0x1f;
    m = h & 0x3ffu;
    if (e == 31) {
        u = ((uint32_t)sign << 31) | 0x7f800000u | ((uint32_t)m << 13);
        memcpy(&x, &u, sizeof x);
        return x;
    }
    x = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 0x400u), e - 25);
    return sign ? -x : x;
}

/* Round-to-nearest-even of a finite x to 16 bits, by the value. */
static uint16_t ref_narrow(float x, int codec)
{
    const int mant = codec == DDPW_HALF_BF16 ? 7 : 10;
    const int emin = codec == DDPW_HALF_BF16 ? -126 : -14;
    const int emax = codec == DDPW_HALF_BF16 ? 127 : 15;
    uint16_t sign = signbit(x) ? 0x8000u : 0;
    double a = fabs((double)x), q, r;
    int e;
    long units;
    if (a == 0.0)
        return sign;
    frexp(a, &e);
    e -= 1; /* a in [2^e, 2^(e+1)) */
    if (e < emin)
        e = emin;
    /* a as a count of units of the last kept place: exact in a double */
    q = ldexp(a, mant - e);
    r = q - floor(q);
    units = (long)floor(q);
    if (r > 0.5 || (r == 0.5 && (units & 1)))
        units++;
    /* units in [2^mant, 2^(mant+1)] for normals, below 2^mant for subnormals */
    if (units >= (2L << mant)) {
        units >>= 1;
        e++;
    }
    if (e > emax)
        return sign | (codec == DDPW_HALF_BF16 ? 0x7f80u : 0x7c00u);
    if (units < (1L << mant))
        return sign | (uint16_t)units;
    return sign | (uint16_t)(((long)(e - emin + 1) << mant) | (units - (1L << mant)));
}

static void check_half(int codec)
{
    enum { N = 65536, K = 5, M = 5003 };
    static float wide[N], back_in[N];
    static uint16_t halves[N], back[N], ins[K][M + 1], out[M + 1], ref[M + 1];
    static float w[K][M], sum[M];
    const uint16_t *inputs[K];
    const float *winputs[K];
    size_t i, j, k, bad_input = 99;
    for (i = 0; i < N; i++)
        halves[i] = (uint16_t)i;
    ddpw_from_half(wide, halves, N, codec);
    for (i = 0; i < N; i++) {
        float r = ref_widen(halves[i], codec);
        CHECK(memcmp(&wide[i], &r, sizeof r) == 0);
    }
    /* every 16-bit value survives the round trip, NaNs included */
    CHECK(ddpw_to_half(back, wide, N, codec) == (codec == DDPW_HALF_BF16 ? 0x7f80 : 0x7c00));
    for (i = 0; i < N; i++)
        CHECK(back[i] == halves[i] || (isnan(wide[i]) && (back[i] | 0x40u << (codec == DDPW_HALF_FP16 ? 3 : 0)) == back[i]));
    /* random finite floats of every magnitude against the value reference */
    for (i = 0; i < N; i++)
        back_in[i] = ldexpf(random_float(), (int)(rng_state % 260) - 150);
    CHECK(ddpw_to_half(back, back_in, N, codec) == -1);
    for (i = 0; i < N; i++)
        if (back[i] != ref_narrow(back_in[i], codec) && failures < 5) {
            fprintf(stderr, "codec %d x %a got %04x want %04x\n", codec, (double)back_in[i], back[i], ref_narrow(back_in[i], codec));
            failures++;
        }
    CHECK(ddpw_to_half(back, back_in, 1, 0) == DDPW_HALF_BAD_CODEC);
    /* the mean is widen, ddpw_mean, narrow; inputs and out one element off;
     * values within fp16's range, so the inputs are finite */
    for (i = 0; i < N; i++)
        back_in[i] = random_float();
    for (k = 1; k <= K; k++) {
        for (j = 0; j < k; j++) {
            ddpw_to_half(ins[j] + 1, back_in + j * M, M, codec);
            inputs[j] = ins[j] + 1;
            ddpw_from_half(w[j], inputs[j], M, codec);
            winputs[j] = w[j];
        }
        CHECK(ddpw_mean_half(out + 1, inputs, k, M, codec, &bad_input) == -1);
        ddpw_mean(sum, winputs, k, M, NULL);
        ddpw_to_half(ref + 1, sum, M, codec);
        CHECK(memcmp(out + 1, ref + 1, M * sizeof(uint16_t)) == 0);
        if (k > 1) {
            ins[k - 1][1 + 7] = codec == DDPW_HALF_BF16 ? 0xff80u : 0xfc00u;
            ins[k - 2][1 + M - 1] = codec == DDPW_HALF_BF16 ? 0x7fc1u : 0x7e01u;
            CHECK(ddpw_mean_half(out + 1, inputs, k, M, codec, &bad_input) == M - 1);
            CHECK(bad_input == k - 2);
        }
    }
    CHECK(bad_input != 99);
}

int main(void)
{
    static const size_t lengths[] = {0, 1, 7, 8, 9, 4095, 4096, 4097, 12289, (1u << 19) + 5};
    static const size_t ks[] = {1, 2, 3, 4, 5, 8, 9};
    static const int threads[] = {1, 2, 3};
    unsigned paths = ddpw_reduce_paths();
    int p, t;
    size_t li, ki;
    CHECK(paths & (1u << DDPW_REDUCE_PORTABLE));
    CHECK(ddpw_reduce_set_path(DDPW_REDUCE_NPATHS) == -1);
    CHECK(ddpw_reduce_set_path(-7) == -1);
    CHECK(ddpw_reduce_path_name(DDPW_REDUCE_NPATHS) == NULL);
    CHECK(ddpw_reduce_set_threads(-1) == -1);
    CHECK(ddpw_mean(NULL, NULL, 0, 0, NULL) == -1);
    for (p = 0; p < DDPW_REDUCE_NPATHS; p++) {
        if (!(paths & (1u << p))) {
            CHECK(ddpw_reduce_set_path(p) == -1);
            continue;
        }
        CHECK(ddpw_reduce_set_path(p) == 0 && ddpw_reduce_get_path() == p);
        for (t = 0; t < 3; t++) {
            CHECK(ddpw_reduce_set_threads(threads[t]) == 0);
            for (li = 0; li < sizeof lengths / sizeof *lengths; li++)
                for (ki = 0; ki < sizeof ks / sizeof *ks; ki++)
                    check_mean(ks[ki], lengths[li]);
        }
        /* big enough per thread that a mean streams its stores (x86 paths),
         * with a partial line at each end of every thread's range */
        for (t = 0; t < 2; t++) {
            CHECK(ddpw_reduce_set_threads(threads[t]) == 0);
            check_mean(3, (4u << 20) + 5);
            check_mean(8, (4u << 20) + 5);
        }
        for (t = 0; t < 2; t++) {
            CHECK(ddpw_reduce_set_threads(threads[t]) == 0);
            check_half(DDPW_HALF_BF16);
            check_half(DDPW_HALF_FP16);
        }
        printf("path %s ok\n", ddpw_reduce_path_name(p));
    }
    return failures != 0;
}

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
        printf("path %s ok\n", ddpw_reduce_path_name(p));
    }
    return failures != 0;
}

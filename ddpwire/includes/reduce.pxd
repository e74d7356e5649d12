# Declarations mirroring csrc/reduce.h.
# Every function is safe to call without the GIL.
from libc.stdint cimport int64_t, uint16_t


cdef extern from "reduce.h" nogil:
    enum:
        DDPW_REDUCE_PORTABLE
        DDPW_REDUCE_AVX2
        DDPW_REDUCE_AVX512
        DDPW_REDUCE_NPATHS
        DDPW_REDUCE_AUTO
        DDPW_REDUCE_MAX_THREADS

    unsigned ddpw_reduce_paths()
    const char *ddpw_reduce_path_name(int path)
    int ddpw_reduce_set_path(int path)
    int ddpw_reduce_get_path()
    int ddpw_reduce_set_threads(int threads)
    int ddpw_reduce_get_threads()

    int64_t ddpw_first_non_finite(const float *buf, size_t n)
    int64_t ddpw_copy_checked(float *dst, const float *src, size_t n)
    int64_t ddpw_accumulate(float *acc, const float *src, size_t n)
    void ddpw_scale(float *buf, float divisor, size_t n)
    int64_t ddpw_mean(float *out, const float **inputs, size_t k, size_t n, size_t *bad_input)
    int64_t ddpw_total(float *out, const float **inputs, size_t k, size_t n, size_t *bad_input)

    enum:
        DDPW_HALF_NONE
        DDPW_HALF_BF16
        DDPW_HALF_FP16
        DDPW_HALF_BAD_CODEC

    int64_t ddpw_to_half(uint16_t *dst, const float *src, size_t n, int codec)
    int64_t ddpw_from_half(float *dst, const uint16_t *src, size_t n, int codec)
    int64_t ddpw_mean_half(uint16_t *out, const uint16_t **inputs, size_t k, size_t n, int codec,
                           size_t *bad_input)
    int64_t ddpw_total_half(uint16_t *out, const uint16_t **inputs, size_t k, size_t n, int codec,
                           size_t *bad_input)

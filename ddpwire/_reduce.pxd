# C declarations of csrc/reduce.h, for `cimport` from any ddpwire .pyx.
# Every function is safe to call without the GIL.
from libc.stdint cimport int64_t


cdef extern from "reduce.h" nogil:
    enum:
        DDP_REDUCE_PORTABLE
        DDP_REDUCE_AVX2
        DDP_REDUCE_AVX512
        DDP_REDUCE_NPATHS
        DDP_REDUCE_AUTO
        DDP_REDUCE_MAX_THREADS

    unsigned ddp_reduce_paths()
    const char *ddp_reduce_path_name(int path)
    int ddp_reduce_set_path(int path)
    int ddp_reduce_get_path()
    int ddp_reduce_set_threads(int threads)
    int ddp_reduce_get_threads()

    int64_t ddp_first_non_finite(const float *buf, size_t n)
    int64_t ddp_copy_checked(float *dst, const float *src, size_t n)
    int64_t ddp_accumulate(float *acc, const float *src, size_t n)
    void ddp_scale(float *buf, float divisor, size_t n)
    int64_t ddp_mean(float *out, const float **inputs, size_t k, size_t n, size_t *bad_input)

# Declarations mirroring csrc/int8.h.
# Every function is safe to call without the GIL.
from libc.stdint cimport int64_t, uint8_t


cdef extern from "int8.h" nogil:
    enum:
        DDPW_INT8_BLOCK

    size_t ddpw_int8_size(size_t n)
    int64_t ddpw_int8_encode(uint8_t *dst, const float *src, size_t n)
    int64_t ddpw_int8_decode(float *dst, const uint8_t *src, size_t n)
    int64_t ddpw_int8_mean(float *out, const uint8_t **inputs, size_t k, size_t n, int divide,
                           size_t *bad_input)

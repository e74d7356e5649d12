# Declarations mirroring csrc/shm.h.
# Every function is safe to call without the GIL.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


cdef extern from "shm.h" nogil:
    enum:
        DDPW_SHM_NONCE
        DDPW_SHM_HOST_ID
        DDPW_SHM_NAME_MAX
        DDPW_SHM_OFFER_LEN
        DDPW_SHM_MAX_WORLD
        DDPW_SHM_OK
        DDPW_SHM_TIMEOUT
        DDPW_SHM_ABORTED
        DDPW_SHM_SUM
        DDPW_SHM_AVG

    ctypedef struct ddpw_shm_offer:
        uint8_t offered
        uint8_t host_id[16]
        uint8_t nonce[16]
        uint64_t region_bytes
        char name[41]

    int ddpw_shm_offer_encode(const ddpw_shm_offer *offer, uint8_t *out)
    int ddpw_shm_offer_decode(const uint8_t *p, size_t len, ddpw_shm_offer *offer)
    size_t ddpw_shm_size(uint32_t world, uint64_t region_bytes)
    int ddpw_shm_init(void *base, size_t len, uint32_t world, uint64_t region_bytes, const uint8_t *nonce)
    int ddpw_shm_check(const void *base, size_t len, uint32_t world, uint64_t region_bytes,
                       const uint8_t *nonce)
    float *ddpw_shm_input(void *base, uint32_t rank)
    float *ddpw_shm_output(void *base)
    int64_t ddpw_shm_now_ms()
    int ddpw_shm_barrier(void *base, uint32_t rank, uint32_t world, uint32_t generation,
                         int64_t deadline_ms, uint32_t *missing)
    void ddpw_shm_abort(void *base, uint32_t world, uint32_t rank)
    int64_t ddpw_shm_aborted(const void *base)
    void ddpw_shm_post(void *base, uint32_t rank, uint64_t count, uint32_t op)
    int64_t ddpw_shm_agree(const void *base, uint32_t world)
    int ddpw_shm_stage(void *base, uint32_t rank, uint32_t world, const float *src, size_t n,
                       uint32_t op, size_t own_start, size_t own_count)
    int64_t ddpw_shm_reduce(void *base, uint32_t world, size_t start, size_t count, uint32_t op,
                            const float *own, uint32_t own_rank, float *result,
                            uint32_t *bad_rank)

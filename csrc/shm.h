/* shm.h: the allreduce of ranks that share one host, through one shared
 * mapping instead of loopback TCP. Callable without the GIL.
 *
 * Layout of the mapping (every offset a multiple of 4096):
 *
 *   control block   magic, sizes, nonce, abort word, wake word, then one
 *                   128-byte line per rank (its barrier generation and the
 *                   collective it is in), so no two ranks write one line
 *   input region r  (world of them) rank r's bucket, region_bytes each
 *   output region   the result, region_bytes
 *
 * One allreduce of n float32 elements (n * 4 <= region_bytes):
 *
 *   1. rank r copies its elements into input region r, all but its own
 *      slice (the caller's cut: ddpwire.plane.plan's, any fractions, an empty
 *      slice included), and posts (n, op): ddpw_shm_stage;
 *   2. barrier g: every input is in place;
 *   3. rank r reduces element slice r across the inputs, in rank order,
 *      into the output region, reading input r's slice from its own private
 *      buffer instead of input region r;
 *   4. barrier g + 1: the output is complete;
 *   5. every rank copies the output region out, all but its own slice,
 *      which step 3 wrote into its buffer too (the torch backend's
 *      allreduce; the mesh, which must not touch a gradient before the
 *      coordinator's go-ahead, copies the whole region).
 *
 * Why a rank need not stage its own slice: slice r of input region r is
 * read by rank r alone (only the owner of a slice reduces it), so the copy
 * would carry bytes from rank r to rank r, 1/world of the copy-in traffic.
 * The price: rank r's private buffer is an input until step 3 ends, so its
 * own slice must not change between steps 1 and 3. The torch backend's
 * allreduce holds the buffer for the whole call; the mesh's caller does
 * not touch its gradients until reduce_scatter (which ends with step 3)
 * returns. Slice r of input region r holds stale bytes, never read.
 *
 * Why the regions can be reused by the next allreduce without a third
 * barrier: a rank writes its input region again (step 1 of the next one)
 * only after passing barrier g + 1, which no rank reaches before finishing
 * its step 3, the only reads of the inputs. A rank writes the output region
 * again (step 3 of the next one) only after passing the next barrier g + 2,
 * which every rank reaches only after its step 5, the only reads of the
 * output. The posted (n, op) line follows the input rule. Slices move with
 * n (and with the fractions), so the slice a rank skipped last time may be
 * another's to read this time: every element another rank reads is staged
 * afresh in step 1.
 *
 * The slices must tile [0, n) alike on every rank; nothing here can check
 * that, so every rank computes them from the same inputs (ddpwire.plane.plan,
 * the same rule as the links), and DDPW_SHM_VERSION changes whenever the
 * rule does: a rank of another version cannot attach.
 *
 * The arithmetic is reduce.h's: AVG is ddpw_mean (float32 sum in rank
 * order, then a true division by (float)world), SUM is ddpw_total (the same
 * sum without the division, also in one pass), so each slice holds exactly
 * the reference coordinator's bits.
 */
#ifndef DDPW_SHM_H
#define DDPW_SHM_H

#include <stddef.h>
#include <stdint.h>

#define DDPW_SHM_MAGIC 0x6d6873777064646eULL /* "nddpwshm" little-endian */
#define DDPW_SHM_VERSION 2u /* 2: the caller's cut (1: 16-element lines) */
#define DDPW_SHM_NONCE 16
#define DDPW_SHM_MAX_WORLD 1024

/* ddpw_shm_barrier results */
enum {
    DDPW_SHM_OK = 0,
    DDPW_SHM_TIMEOUT = 1, /* the deadline passed; *missing did not arrive */
    DDPW_SHM_ABORTED = 2  /* another rank called the group off; *missing is the rank it blamed */
};

/* ddpw_shm_reduce ops (the collectives extension's codes) */
enum { DDPW_SHM_SUM = 0, DDPW_SHM_AVG = 1 };

/* Where a segment is, as rank 0 (or mesh worker 0) tells the others: the
 * data of a uint8 collective in both negotiations (the torch backend's
 * broadcast, the mesh's set-up over its links), docs/extensions.md. Little
 * endian: offered u8 (0: no segment, the rest is zero), host id (16
 * bytes), nonce (16), region_bytes u64, the segment's name (NUL-padded). */
#define DDPW_SHM_HOST_ID 16
#define DDPW_SHM_NAME_MAX 40
#define DDPW_SHM_OFFER_LEN (1 + DDPW_SHM_HOST_ID + DDPW_SHM_NONCE + 8 + DDPW_SHM_NAME_MAX)

typedef struct ddpw_shm_offer {
    uint8_t offered;
    uint8_t host_id[DDPW_SHM_HOST_ID];
    uint8_t nonce[DDPW_SHM_NONCE];
    uint64_t region_bytes;
    char name[DDPW_SHM_NAME_MAX + 1]; /* NUL-terminated */
} ddpw_shm_offer;

/* Write the offer's DDPW_SHM_OFFER_LEN bytes: 0, or -1 when the name does
 * not fit DDPW_SHM_NAME_MAX bytes. */
int ddpw_shm_offer_encode(const ddpw_shm_offer *offer, uint8_t *out);

/* Read an offer of len bytes: 0, or -1 when len is not DDPW_SHM_OFFER_LEN,
 * offered is not 0 or 1, or the name has bytes after its padding. */
int ddpw_shm_offer_decode(const uint8_t *p, size_t len, ddpw_shm_offer *offer);

/* Bytes of the whole mapping for world ranks and regions of region_bytes
 * (rounded up to 4096); 0 when world is 0 or over DDPW_SHM_MAX_WORLD or the
 * size overflows. */
size_t ddpw_shm_size(uint32_t world, uint64_t region_bytes);

/* The creator fills the control block of a zeroed mapping of len bytes:
 * 0, or -1 when len is not ddpw_shm_size(world, region_bytes). */
int ddpw_shm_init(void *base, size_t len, uint32_t world, uint64_t region_bytes,
                  const uint8_t nonce[DDPW_SHM_NONCE]);

/* An attaching rank checks that the mapping is the one announced: 0, or -1
 * when the magic, version, sizes or nonce differ. */
int ddpw_shm_check(const void *base, size_t len, uint32_t world, uint64_t region_bytes,
                   const uint8_t nonce[DDPW_SHM_NONCE]);

float *ddpw_shm_input(void *base, uint32_t rank);
float *ddpw_shm_output(void *base);

/* Milliseconds on the clock the barrier's deadlines use (monotonic). */
int64_t ddpw_shm_now_ms(void);

/* Arrive at generation (generations only grow, by one per barrier; they
 * may wrap) and wait until every rank of world has. Spins briefly, then
 * sleeps (a shared futex on Linux, a short nanosleep backoff elsewhere) and
 * returns DDPW_SHM_TIMEOUT once ddpw_shm_now_ms() passes deadline_ms. A
 * rank that has arrived wins over an abort, so a group ending normally
 * never reports one. Calling it again with the same generation after a
 * timeout waits again (arriving twice is harmless). */
int ddpw_shm_barrier(void *base, uint32_t rank, uint32_t world, uint32_t generation,
                     int64_t deadline_ms, uint32_t *missing);

/* Call the group off, blaming rank: every barrier waiting now or later on
 * a missing rank returns DDPW_SHM_ABORTED. The first blame stays. */
void ddpw_shm_abort(void *base, uint32_t world, uint32_t rank);

/* The rank a barrier would blame after an abort, or -1 when none. */
int64_t ddpw_shm_aborted(const void *base);

/* Post this rank's collective (element count and op) before step 2; after
 * barrier g, ddpw_shm_agree returns -1 when every rank posted the same, or
 * the first rank that differs from rank 0. */
void ddpw_shm_post(void *base, uint32_t rank, uint64_t count, uint32_t op);
int64_t ddpw_shm_agree(const void *base, uint32_t world);

/* Step 1: copy src[0..n) into rank's input region except rank's own slice
 * [own_start, own_start + own_count) (which no other rank reads), then post
 * (n, op). Returns 0, or -1 (nothing copied or posted) when rank is not
 * below world, world is over DDPW_SHM_MAX_WORLD, n elements do not fit a
 * region or the slice does not lie within n. src must not overlap the
 * mapping's input region. */
int ddpw_shm_stage(void *base, uint32_t rank, uint32_t world, const float *src, size_t n,
                   uint32_t op, size_t own_start, size_t own_count);

/* Reduce elements [start, start + count) of every rank's input into the
 * output region: op DDPW_SHM_AVG or DDPW_SHM_SUM. Rank r's input is input
 * region r, except that when own is not NULL rank own_rank's is own, that
 * rank's whole private vector (at least start + count elements, indexed
 * like the regions, overlapping no output): the slice ddpw_shm_stage did
 * not copy. The whole slice is always written; when result is not NULL it
 * is written there too (result[start..start + count), in the same pass),
 * and result may be own: each element is stored after it is read. Returns
 * -1 when every input element of the slice is finite, -2 for another op, an
 * own_rank not below world or a slice past the region, else the element
 * (of the whole vector) of the first non-finite value of the lowest rank
 * holding one, that rank in *bad_rank (which may be NULL): the report the
 * mesh halts a step on. */
int64_t ddpw_shm_reduce(void *base, uint32_t world, size_t start, size_t count, uint32_t op,
                        const float *own, uint32_t own_rank, float *result, uint32_t *bad_rank);

#endif

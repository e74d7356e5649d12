/* int8.h: the int8 wire codec, a byte per element and a float32 scale per
 * block of DDPW_INT8_BLOCK elements, callable without the GIL.
 *
 * Layout. A vector of n float32 elements is cut into blocks of
 * DDPW_INT8_BLOCK elements from its first element (the last block may be
 * shorter). Each block travels as its scale (4 bytes, a little-endian
 * IEEE float32) followed by one signed byte per element, so the vector
 * takes ddpw_int8_size(n) = n + 4 * ceil(n / DDPW_INT8_BLOCK) bytes, and
 * the blocks from element e (a multiple of DDPW_INT8_BLOCK) begin at byte
 * ddpw_int8_size(e). That size grows strictly with n, so a byte count
 * names its element count: a peer whose vector has another length is
 * caught by the count of its bytes.
 *
 * Encoding, per block, all in float32:
 *   - a block holding a NaN or an infinity has scale NaN and codes 0, so
 *     the whole block decodes to NaN (a non-finite element is passed on,
 *     as a float32 sum would; its exact value and index within the block
 *     are not kept);
 *   - otherwise scale = max |x| / 127.0f (the next float32 towards 0
 *     where 127.0f * scale would round past FLT_MAX, so that no finite
 *     element decodes to inf), and each code is x / scale rounded to
 *     nearest, ties to even, clamped to [-127, 127]; a scale of 0 (a block
 *     of zeros, or one too small for a float32 scale) gives codes 0.
 * Decoding: x = (float)code * scale, rounded to float32 (finite for
 * every scale an encoder writes; a peer's NaN or huge scale decodes to
 * NaN or inf, reported).
 *
 * The mean of k encoded vectors decodes every element and sums in float32
 * in input order, ((x0 + x1) + x2) + ..., then divides by (float)k (a true
 * division), as reduce.h's ddpw_mean does on decoded inputs: each product
 * is rounded to float32 before it is added (never a fused multiply-add;
 * the build turns contraction off). A sum reports the first non-finite
 * decoded input as reduce.h does ("first": the lowest input, then index).
 *
 * Every function reads and writes only the bytes its lengths name; sizes
 * are computed with overflow checks by the caller through ddpw_int8_size,
 * which returns 0 for an n whose encoding does not fit a size_t. Pointers
 * need no alignment.
 */
#ifndef DDPW_INT8_H
#define DDPW_INT8_H

#include <stddef.h>
#include <stdint.h>

#define DDPW_INT8_BLOCK 256

/* Bytes the encoding of n elements takes (0 for n = 0, or on overflow). */
size_t ddpw_int8_size(size_t n);

/* Encode src[0..n) into dst (ddpw_int8_size(n) bytes). Returns the index of
 * the first non-finite element of src, or -1. */
int64_t ddpw_int8_encode(uint8_t *restrict dst, const float *restrict src, size_t n);

/* Decode n elements from src (ddpw_int8_size(n) bytes) into dst. Returns
 * the index of the first non-finite decoded element, or -1. */
int64_t ddpw_int8_decode(float *restrict dst, const uint8_t *restrict src, size_t n);

/* out[i] = the sum over j < k, in order, of inputs[j]'s decoded element i,
 * divided by (float)k when divide is non-zero, for i < n. Returns the
 * first non-finite decoded input element's index and sets *bad_input to
 * its input, or returns -1. k == 0 writes nothing and returns -1. out must
 * not overlap any input. */
int64_t ddpw_int8_mean(float *restrict out, const uint8_t *const *inputs, size_t k, size_t n,
                       int divide, size_t *bad_input);

#endif

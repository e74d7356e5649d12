/* reduce.h: in-place float32 averaging kernels for ddpwire, callable without the GIL.
 *
 * Arithmetic contract. The mean of k buffers is, element by element, the
 * float32 sum in input order, ((x0 + x1) + x2) + ..., divided by (float)k with
 * a true division (never a multiplication by 1/k). That is what the reference
 * coordinator computes, and every kernel here gives those exact bits whatever
 * the instruction-set path, the alignment of the pointers or the block size:
 * vectors only ever run across elements, never across inputs, and nothing is
 * contracted into a fused multiply-add. Streaming the same average as
 * ddpw_copy_checked (input 0), ddpw_accumulate (inputs 1..k-1 in order) and
 * ddpw_scale(k) gives bit-identical results to ddpw_mean.
 *
 * Non-finite values. A float is non-finite when it is a NaN or +/-inf. The
 * checking kernels inspect their inputs (never the running sum, which may
 * overflow to inf legitimately, as in the reference) in the same pass as the
 * arithmetic. A kernel that meets a non-finite value still FINISHES the whole
 * buffer, so the output always holds the full reference result (NaN and inf
 * propagating as IEEE-754 says); the return value only reports. "First" means
 * the lowest input number, then the lowest element index within that input.
 *
 * Pointers need only float (4-byte) alignment. Buffers marked restrict must
 * not overlap each other. Indices are returned as int64_t, -1 meaning "none".
 */
#ifndef DDPW_REDUCE_H
#define DDPW_REDUCE_H

#include <stddef.h>
#include <stdint.h>

/* Instruction-set paths. Every path computes the same bits; they differ in
 * speed only. Paths a CPU lacks are never selected. */
enum {
    DDPW_REDUCE_PORTABLE = 0, /* plain C, vectorised for the build's baseline ISA */
    DDPW_REDUCE_AVX2 = 1,     /* x86-64 with AVX2, chosen at run time */
    DDPW_REDUCE_AVX512 = 2,   /* x86-64 with AVX-512F, chosen at run time */
    DDPW_REDUCE_NPATHS = 3,
    DDPW_REDUCE_AUTO = -1     /* for ddpw_reduce_set_path: the fastest available */
};

/* Bit p is set when path p is compiled in and this CPU (and OS) runs it. */
unsigned ddpw_reduce_paths(void);

/* "portable", "avx2", "avx512"; NULL for an unknown path number. */
const char *ddpw_reduce_path_name(int path);

/* Force path (tests, benchmarks) or DDPW_REDUCE_AUTO. Returns 0, or -1 when
 * the path is unknown or unavailable here (the selection is then unchanged).
 * Safe to call from any thread; a kernel already running keeps its path. */
int ddpw_reduce_set_path(int path);

/* The path the kernels use now. */
int ddpw_reduce_get_path(void);

/* Most threads one kernel call may split a large buffer over (contiguous
 * element ranges, so the bits do not change); 0 restores the default, the
 * number of online CPUs capped at DDPW_REDUCE_MAX_THREADS. Returns 0, or -1
 * for a negative count. Buffers under DDPW_REDUCE_MIN_SPLIT elements per
 * thread are never split; ddpw_first_non_finite never is (it stops early). */
#define DDPW_REDUCE_MAX_THREADS 8
#define DDPW_REDUCE_MIN_SPLIT ((size_t)1 << 18)
int ddpw_reduce_set_threads(int threads);
int ddpw_reduce_get_threads(void);

/* Index of the first non-finite element of buf[0..n), or -1. */
int64_t ddpw_first_non_finite(const float *buf, size_t n);

/* dst[i] = src[i] for i < n; returns the first non-finite index of src, or -1. */
int64_t ddpw_copy_checked(float *restrict dst, const float *restrict src, size_t n);

/* acc[i] = acc[i] + src[i] for i < n; returns the first non-finite index of
 * src, or -1. acc itself is not checked: it holds a sum of inputs that were. */
int64_t ddpw_accumulate(float *restrict acc, const float *restrict src, size_t n);

/* buf[i] = buf[i] / divisor for i < n. Unchecked: its input is a sum of
 * checked inputs, where inf can only be an overflow the reference keeps too. */
void ddpw_scale(float *buf, float divisor, size_t n);

/* out[i] = (((inputs[0][i] + inputs[1][i]) + ...) + inputs[k-1][i]) / (float)k
 * for i < n, in one pass over memory. out must not overlap any input (inputs
 * may overlap each other). Returns -1 when every input element is finite;
 * otherwise the index of the first non-finite element of the lowest-numbered
 * input holding one, whose number is stored in *bad_input (which may be NULL).
 * k == 0 writes nothing and returns -1. On the x86 paths an out of 2^21
 * elements or more per thread is written with non-temporal stores (fenced
 * before return), so it is in memory, not in cache, afterwards. */
int64_t ddpw_mean(float *restrict out, const float *const *inputs, size_t k, size_t n,
                 size_t *bad_input);

/* out[i] = ((inputs[0][i] + inputs[1][i]) + ...) + inputs[k-1][i]: ddpw_mean
 * without the division, in the same one pass, with the same report and
 * stores. Bit for bit ddpw_copy_checked of inputs[0], then ddpw_accumulate of
 * each later input in order, which make k passes over out. */
int64_t ddpw_total(float *restrict out, const float *const *inputs, size_t k, size_t n,
                  size_t *bad_input);

/* ddpw_mean (divide nonzero) or ddpw_total (divide zero) that also stores
 * each finished element in also[i], in the same pass: also may be one of the
 * inputs (an element is stored only after every input's is read), never out.
 * A rank of a shared-memory allreduce gets its own slice of the result into
 * its own buffer this way, while that slice's lines are still in its cache,
 * so its copy out of the shared result can skip the slice. */
int64_t ddpw_reduce_also(float *restrict out, float *also, const float *const *inputs, size_t k,
                        size_t n, int divide, size_t *bad_input);

/* ---- 16-bit gradients on the wire ----
 *
 * Gradients may travel as bfloat16 or IEEE binary16 ("fp16"). Narrowing
 * rounds to nearest, ties to even: finite values too large for fp16 become
 * +/-inf, tiny ones fp16 subnormals or a signed zero, exactly as
 * tensor.to(torch.bfloat16 / torch.float16) gives. A NaN stays a quiet NaN
 * of the same sign carrying the top bits of its payload (the x86 converters'
 * rule; torch's own NaN bits differ between its scalar and vector loops).
 * Widening is exact; a NaN keeps its sign and payload.
 *
 * The mean of k 16-bit buffers widens each element, sums in float32 in
 * input order, divides by (float)k and narrows once, so it is bit for bit
 * ddpw_from_half on every input, ddpw_mean, then ddpw_to_half: every worker
 * expanding the result sees the same bits. Every path gives the same bits,
 * and the thread split and non-finite rules are those above. Pointers need
 * only their element's alignment. A codec other than the two below converts
 * nothing and returns DDPW_HALF_BAD_CODEC. */
enum {
    DDPW_HALF_NONE = 0,
    DDPW_HALF_BF16 = 1,
    DDPW_HALF_FP16 = 2,
    DDPW_HALF_BAD_CODEC = -2
};

/* dst[i] = src[i] narrowed, for i < n; returns the first non-finite index of
 * src, or -1. */
int64_t ddpw_to_half(uint16_t *restrict dst, const float *restrict src, size_t n, int codec);

/* dst[i] = src[i] widened, for i < n; returns the first non-finite index of
 * src (a 16-bit NaN or inf), or -1. */
int64_t ddpw_from_half(float *restrict dst, const uint16_t *restrict src, size_t n, int codec);

/* out[i] = narrow((((wide(inputs[0][i]) + wide(inputs[1][i])) + ...)) / (float)k)
 * for i < n, with non-finite reporting, overlap rules and k == 0 as in
 * ddpw_mean. */
int64_t ddpw_mean_half(uint16_t *restrict out, const uint16_t *const *inputs, size_t k, size_t n,
                      int codec, size_t *bad_input);

/* out[i] = narrow(((wide(inputs[0][i]) + wide(inputs[1][i])) + ...)), the
 * sum without the division (a SUM of 16-bit values), as ddpw_mean_half. */
int64_t ddpw_total_half(uint16_t *restrict out, const uint16_t *const *inputs, size_t k,
                        size_t n, int codec, size_t *bad_input);

#endif

/* shm.c: see shm.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "shm.h"
#include "reduce.h"

#include <errno.h>
#include <string.h>
#include <time.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DDPW_SHM_FUTEX 1
/* unistd.h declares syscall() only under _DEFAULT_SOURCE, which the strict
 * C99 build (tests/test_clang.py) does not define. */
extern long syscall(long number, ...);
#else
#define DDPW_SHM_FUTEX 0
#endif

#define PAGE 4096u
#define LINE 128u /* two cache lines: the adjacent-line prefetcher pairs them */
#define SPINS 256

/* The control block. Shared words are only touched through __atomic
 * builtins (gcc and clang both have them in C99 mode). */
struct head {
    uint64_t magic;
    uint32_t version;
    uint32_t world;
    uint64_t region_bytes;
    uint64_t size;
    uint8_t nonce[DDPW_SHM_NONCE];
};

struct rank_line {
    uint32_t generation; /* the last barrier this rank arrived at */
    uint32_t op;
    uint64_t count;
};

/* Offsets inside the control block. The wake word gets its own line: every
 * arrival bumps it, and waiters read it before sleeping on it. */
#define OFF_ABORT LINE
#define OFF_WAKE (2 * LINE)
#define OFF_RANKS (3 * LINE)

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

static size_t control_bytes(uint32_t world) { return round_up(OFF_RANKS + (size_t)world * LINE, PAGE); }

static uint32_t *abort_word(const void *base) { return (uint32_t *)((char *)base + OFF_ABORT); }
static uint32_t *wake_word(const void *base) { return (uint32_t *)((char *)base + OFF_WAKE); }
static struct rank_line *line_of(const void *base, uint32_t rank)
{
    return (struct rank_line *)((char *)base + OFF_RANKS + (size_t)rank * LINE);
}
static const struct head *head_of(const void *base) { return (const struct head *)base; }

size_t ddpw_shm_size(uint32_t world, uint64_t region_bytes)
{
    size_t region, total;
    if (world == 0 || world > DDPW_SHM_MAX_WORLD || region_bytes > (uint64_t)SIZE_MAX / 2)
        return 0;
    region = round_up((size_t)region_bytes, PAGE);
    if (region != 0 && (size_t)world + 1 > (SIZE_MAX - control_bytes(world)) / region)
        return 0;
    total = control_bytes(world) + ((size_t)world + 1) * region;
    return total;
}

static size_t region_stride(const void *base) { return round_up((size_t)head_of(base)->region_bytes, PAGE); }

float *ddpw_shm_input(void *base, uint32_t rank)
{
    const struct head *h = head_of(base);
    return (float *)((char *)base + control_bytes(h->world) + (size_t)rank * region_stride(base));
}

float *ddpw_shm_output(void *base)
{
    const struct head *h = head_of(base);
    return (float *)((char *)base + control_bytes(h->world) + (size_t)h->world * region_stride(base));
}

int ddpw_shm_init(void *base, size_t len, uint32_t world, uint64_t region_bytes,
                  const uint8_t nonce[DDPW_SHM_NONCE])
{
    struct head *h = (struct head *)base;
    size_t want = ddpw_shm_size(world, region_bytes);
    if (want == 0 || len != want)
        return -1;
    memset(base, 0, control_bytes(world));
    h->version = DDPW_SHM_VERSION;
    h->world = world;
    h->region_bytes = region_bytes;
    h->size = len;
    memcpy(h->nonce, nonce, DDPW_SHM_NONCE);
    /* the magic last: a rank that sees it sees the fields before it */
    __atomic_store_n(&h->magic, DDPW_SHM_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

int ddpw_shm_check(const void *base, size_t len, uint32_t world, uint64_t region_bytes,
                   const uint8_t nonce[DDPW_SHM_NONCE])
{
    const struct head *h = head_of(base);
    if (len < sizeof(struct head) || len != ddpw_shm_size(world, region_bytes))
        return -1;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != DDPW_SHM_MAGIC)
        return -1;
    if (h->version != DDPW_SHM_VERSION || h->world != world || h->region_bytes != region_bytes ||
        h->size != len || memcmp(h->nonce, nonce, DDPW_SHM_NONCE) != 0)
        return -1;
    return 0;
}

int64_t ddpw_shm_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("pause");
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sleep while *word == seen, at most ms milliseconds (spurious returns are
 * fine: the caller looks again). */
static void sleep_on(uint32_t *word, uint32_t seen, int64_t ms, unsigned *backoff_us)
{
#if DDPW_SHM_FUTEX
    struct timespec ts;
    (void)backoff_us;
    ts.tv_sec = (time_t)(ms / 1000);
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    /* not FUTEX_PRIVATE: the word lives in a mapping other processes share */
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
#else
    /* No portable cross-process wait on a word: back off from 20 us to 1 ms,
     * so a short wait stays short and a long one costs little CPU. */
    struct timespec ts;
    int64_t us = *backoff_us;
    (void)word;
    (void)seen;
    if (us > ms * 1000)
        us = ms * 1000;
    ts.tv_sec = (time_t)(us / 1000000);
    ts.tv_nsec = (long)(us % 1000000) * 1000L;
    nanosleep(&ts, NULL);
    if (*backoff_us < 1000)
        *backoff_us *= 2;
#endif
}

static void wake_all(void *base)
{
    uint32_t *wake = wake_word(base);
    __atomic_fetch_add(wake, 1u, __ATOMIC_SEQ_CST);
#if DDPW_SHM_FUTEX
    syscall(SYS_futex, wake, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#endif
}

/* The first rank not yet at generation (wrap-safe), or world when all are. */
static uint32_t first_missing(const void *base, uint32_t world, uint32_t generation)
{
    uint32_t r;
    for (r = 0; r < world; r++) {
        uint32_t g = __atomic_load_n(&line_of(base, r)->generation, __ATOMIC_ACQUIRE);
        if ((int32_t)(g - generation) < 0)
            return r;
    }
    return world;
}

int ddpw_shm_barrier(void *base, uint32_t rank, uint32_t world, uint32_t generation,
                     int64_t deadline_ms, uint32_t *missing)
{
    unsigned backoff_us = 20;
    int spins = 0;
    uint32_t m = 0;
    __atomic_store_n(&line_of(base, rank)->generation, generation, __ATOMIC_RELEASE);
    wake_all(base);
    for (;;) {
        /* read the wake word before looking, so an arrival after the look
         * changes it and the sleep below returns at once */
        uint32_t seen = __atomic_load_n(wake_word(base), __ATOMIC_ACQUIRE);
        int64_t left;
        m = first_missing(base, world, generation);
        if (m == world)
            return DDPW_SHM_OK;
        if (__atomic_load_n(abort_word(base), __ATOMIC_ACQUIRE) != 0) {
            /* an arrival wins over an abort: a group whose last rank leaves
             * right after the last barrier must not report a failure */
            if (first_missing(base, world, generation) == world)
                return DDPW_SHM_OK;
            if (missing)
                *missing = __atomic_load_n(abort_word(base), __ATOMIC_ACQUIRE) - 1u;
            return DDPW_SHM_ABORTED;
        }
        left = deadline_ms - ddpw_shm_now_ms();
        if (left <= 0) {
            if (missing)
                *missing = m;
            return DDPW_SHM_TIMEOUT;
        }
        if (spins < SPINS) {
            spins++;
            cpu_relax();
            continue;
        }
        sleep_on(wake_word(base), seen, left, &backoff_us);
    }
}

void ddpw_shm_abort(void *base, uint32_t world, uint32_t rank)
{
    uint32_t none = 0;
    (void)world;
    __atomic_compare_exchange_n(abort_word(base), &none, rank + 1u, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    wake_all(base);
}

int64_t ddpw_shm_aborted(const void *base)
{
    uint32_t a = __atomic_load_n(abort_word(base), __ATOMIC_ACQUIRE);
    return a == 0 ? -1 : (int64_t)a - 1;
}

void ddpw_shm_post(void *base, uint32_t rank, uint64_t count, uint32_t op)
{
    /* plain stores: the barrier's release store publishes them */
    line_of(base, rank)->count = count;
    line_of(base, rank)->op = op;
}

int64_t ddpw_shm_agree(const void *base, uint32_t world)
{
    uint32_t r;
    const struct rank_line *first = line_of(base, 0);
    for (r = 1; r < world; r++) {
        const struct rank_line *l = line_of(base, r);
        if (l->count != first->count || l->op != first->op)
            return r;
    }
    return -1;
}

int ddpw_shm_stage(void *base, uint32_t rank, uint32_t world, const float *src, size_t n,
                   uint32_t op, size_t own_start, size_t own_count)
{
    size_t start = own_start, count = own_count;
    float *in;
    if (world == 0 || world > DDPW_SHM_MAX_WORLD || rank >= world ||
        n > (size_t)(head_of(base)->region_bytes / 4) || start > n || count > n - start)
        return -1;
    in = ddpw_shm_input(base, rank);
    if (start > 0)
        memcpy(in, src, start * sizeof(float));
    if (start + count < n)
        memcpy(in + start + count, src + start + count, (n - start - count) * sizeof(float));
    ddpw_shm_post(base, rank, n, op);
    return 0;
}

int64_t ddpw_shm_reduce(void *base, uint32_t world, size_t start, size_t count, uint32_t op,
                        const float *own, uint32_t own_rank, float *result, uint32_t *bad_rank)
{
    const float *inputs[DDPW_SHM_MAX_WORLD];
    float *out;
    size_t bad_input = 0;
    int64_t bad;
    uint32_t r;
    size_t elements = (size_t)(head_of(base)->region_bytes / 4);
    if ((op != DDPW_SHM_AVG && op != DDPW_SHM_SUM) || world == 0 || world > DDPW_SHM_MAX_WORLD ||
        (own != NULL && own_rank >= world) || start > elements || count > elements - start)
        return -2;
    if (count == 0)
        return -1;
    out = ddpw_shm_output(base) + start;
    for (r = 0; r < world; r++)
        inputs[r] = ddpw_shm_input(base, r) + start;
    if (own != NULL)
        inputs[own_rank] = own + start;
    /* the kernels finish the slice whatever they meet: a caller that halts
     * on the report still holds the reference's bits, one that does not
     * (the collectives service) simply ignores it */
    bad = ddpw_reduce_also(out, result != NULL ? result + start : NULL, inputs, world, count,
                           op == DDPW_SHM_AVG, &bad_input);
    if (bad < 0)
        return -1;
    if (bad_rank)
        *bad_rank = (uint32_t)bad_input;
    return (int64_t)start + bad;
}

int ddpw_shm_offer_encode(const ddpw_shm_offer *offer, uint8_t *out)
{
    size_t name_len = 0, i;
    uint8_t *p = out;
    while (name_len <= DDPW_SHM_NAME_MAX && offer->name[name_len] != '\0')
        name_len++;
    if (name_len > DDPW_SHM_NAME_MAX)
        return -1;
    *p++ = offer->offered;
    memcpy(p, offer->host_id, DDPW_SHM_HOST_ID);
    p += DDPW_SHM_HOST_ID;
    memcpy(p, offer->nonce, DDPW_SHM_NONCE);
    p += DDPW_SHM_NONCE;
    for (i = 0; i < 8; i++)
        *p++ = (uint8_t)(offer->region_bytes >> (8 * i));
    memset(p, 0, DDPW_SHM_NAME_MAX);
    memcpy(p, offer->name, name_len);
    return 0;
}

int ddpw_shm_offer_decode(const uint8_t *p, size_t len, ddpw_shm_offer *offer)
{
    size_t i, name_len = 0;
    if (len != DDPW_SHM_OFFER_LEN || p[0] > 1)
        return -1;
    offer->offered = *p++;
    memcpy(offer->host_id, p, DDPW_SHM_HOST_ID);
    p += DDPW_SHM_HOST_ID;
    memcpy(offer->nonce, p, DDPW_SHM_NONCE);
    p += DDPW_SHM_NONCE;
    offer->region_bytes = 0;
    for (i = 0; i < 8; i++)
        offer->region_bytes |= (uint64_t)p[i] << (8 * i);
    p += 8;
    while (name_len < DDPW_SHM_NAME_MAX && p[name_len] != 0)
        name_len++;
    for (i = name_len; i < DDPW_SHM_NAME_MAX; i++)
        if (p[i] != 0)
            return -1; /* a byte after the padding started: not an offer we wrote */
    memcpy(offer->name, p, name_len);
    offer->name[name_len] = '\0';
    return 0;
}

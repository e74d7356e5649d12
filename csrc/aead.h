/* aead.h: AES-256-GCM from the process's OpenSSL libcrypto, loaded at run time.
 *
 * No cipher is written here: the EVP interface of libcrypto (1.1 or 3) does
 * the work, hardware-accelerated where the CPU has AES instructions. It is
 * loaded with dlopen rather than linked so that the wheel needs no OpenSSL
 * headers to build (every target cross-compiles) and ships no second copy of
 * it: the caller names the libcrypto the Python process already uses
 * (ddpwire/wire/seal.py finds it). Seven EVP calls are declared below; their
 * signatures have been the same since OpenSSL 1.1.0.
 *
 * A record's nonce is 4 zero bytes and a 64-bit counter, little-endian: keys
 * are per link and per direction (ddpwire/wire/seal.py derives them), so a
 * counter never repeats under one key; the counter is never sent, so a
 * replayed, reordered or dropped record fails to authenticate.
 */
#ifndef DDPW_AEAD_H
#define DDPW_AEAD_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define DDPW_AEAD_KEY_BYTES 32
#define DDPW_AEAD_TAG_BYTES 16

/* Load libcrypto from `path` (a file name dlopen takes). 0 on success;
 * else -1 with why (NUL-terminated, at most why_len bytes) saying what is
 * missing. Loading again after a success does nothing; call it with the
 * GIL held (it is not thread-safe). */
int ddpw_aead_load(const char *path, char *why, size_t why_len);

/* 1 once ddpw_aead_load succeeded. */
int ddpw_aead_ready(void);

typedef struct ddpw_aead ddpw_aead;

/* One direction's cipher state under key[32]: sealing (encrypt = 1) or
 * opening. NULL without libcrypto or memory. One thread at a time. */
ddpw_aead *ddpw_aead_new(const uint8_t *key, int encrypt);
void ddpw_aead_free(ddpw_aead *a);

/* Seal `len` bytes of the concatenation of iov (at most 8 entries) from
 * byte `skip`, under nonce `counter` and the additional data aad, into
 * out[0, len) and tag[0, 16). 0, or -1 when libcrypto failed. len <= 1 GiB. */
int ddpw_aead_seal(ddpw_aead *a, uint64_t counter, const uint8_t *aad, size_t aad_len,
                   const struct iovec *iov, int iovcnt, size_t skip, size_t len,
                   uint8_t *out, uint8_t *tag);

/* Open in[0, len) with its tag into the concatenation of out (at most 8
 * entries) from byte `skip`: 0 when authentic, -1 when not (what was
 * written to out then means nothing and must not be used). */
int ddpw_aead_open(ddpw_aead *a, uint64_t counter, const uint8_t *aad, size_t aad_len,
                   const uint8_t *in, size_t len, const uint8_t *tag,
                   const struct iovec *out, int outcnt, size_t skip);

#endif

/* aead.c: see aead.h. */
#if !defined(_WIN32)
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#if defined(__APPLE__) && !defined(_DARWIN_C_SOURCE)
#define _DARWIN_C_SOURCE
#endif
#endif

#include "aead.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* libcrypto's types stay opaque: only pointers to them pass through here */
typedef struct evp_cipher_ctx EVP_CIPHER_CTX;
typedef struct evp_cipher EVP_CIPHER;

/* from openssl/evp.h, unchanged since 1.0 */
#define EVP_CTRL_GCM_GET_TAG 0x10
#define EVP_CTRL_GCM_SET_TAG 0x11

static struct {
    void *lib;
    EVP_CIPHER_CTX *(*ctx_new)(void);
    void (*ctx_free)(EVP_CIPHER_CTX *);
    const EVP_CIPHER *(*aes_256_gcm)(void);
    int (*init)(EVP_CIPHER_CTX *, const EVP_CIPHER *, void *engine, const unsigned char *key,
                const unsigned char *iv, int enc);
    int (*update)(EVP_CIPHER_CTX *, unsigned char *out, int *outl, const unsigned char *in,
                  int inl);
    int (*final)(EVP_CIPHER_CTX *, unsigned char *out, int *outl);
    int (*ctrl)(EVP_CIPHER_CTX *, int type, int arg, void *ptr);
} evp;

struct ddpw_aead {
    EVP_CIPHER_CTX *ctx;
    int encrypt;
};

/* dlsym's void * to a function pointer, without the cast ISO C warns of */
static int bind(void *lib, const char *name, void *slot, char *why, size_t why_len)
{
    void *sym = dlsym(lib, name);
    if (sym == NULL) {
        snprintf(why, why_len, "libcrypto has no %s", name);
        return -1;
    }
    memcpy(slot, &sym, sizeof sym);
    return 0;
}

int ddpw_aead_load(const char *path, char *why, size_t why_len)
{
    void *lib;
    if (evp.lib != NULL)
        return 0;
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *e = dlerror();
        snprintf(why, why_len, "cannot load %s: %s", path, e != NULL ? e : "unknown error");
        return -1;
    }
    if (bind(lib, "EVP_CIPHER_CTX_new", &evp.ctx_new, why, why_len) ||
        bind(lib, "EVP_CIPHER_CTX_free", &evp.ctx_free, why, why_len) ||
        bind(lib, "EVP_aes_256_gcm", &evp.aes_256_gcm, why, why_len) ||
        bind(lib, "EVP_CipherInit_ex", &evp.init, why, why_len) ||
        bind(lib, "EVP_CipherUpdate", &evp.update, why, why_len) ||
        bind(lib, "EVP_CipherFinal_ex", &evp.final, why, why_len) ||
        bind(lib, "EVP_CIPHER_CTX_ctrl", &evp.ctrl, why, why_len)) {
        dlclose(lib);
        return -1;
    }
    evp.lib = lib;
    return 0;
}

int ddpw_aead_ready(void)
{
    return evp.lib != NULL;
}

ddpw_aead *ddpw_aead_new(const uint8_t *key, int encrypt)
{
    ddpw_aead *a;
    if (evp.lib == NULL)
        return NULL;
    a = (ddpw_aead *)calloc(1, sizeof *a);
    if (a == NULL)
        return NULL;
    a->encrypt = encrypt ? 1 : 0;
    a->ctx = evp.ctx_new();
    if (a->ctx == NULL || evp.init(a->ctx, evp.aes_256_gcm(), NULL, key, NULL, a->encrypt) != 1) {
        ddpw_aead_free(a);
        return NULL;
    }
    return a;
}

void ddpw_aead_free(ddpw_aead *a)
{
    if (a == NULL)
        return;
    if (a->ctx != NULL)
        evp.ctx_free(a->ctx);
    free(a);
}

/* A new record under the nonce of `counter`, its additional data fed. */
static int start(ddpw_aead *a, uint64_t counter, const uint8_t *aad, size_t aad_len)
{
    unsigned char iv[12] = {0};
    int k, outl = 0;
    for (k = 0; k < 8; k++)
        iv[4 + k] = (unsigned char)(counter >> (8 * k));
    if (aad_len > (1u << 30) || evp.init(a->ctx, NULL, NULL, NULL, iv, -1) != 1)
        return -1;
    if (aad_len > 0 && evp.update(a->ctx, NULL, &outl, aad, (int)aad_len) != 1)
        return -1;
    return 0;
}

/* Run the cipher over `len` bytes: from `in` (or, with in NULL, from iov
 * at `skip`) into `out` (or, with out NULL, into iov at `skip`). */
static int run(ddpw_aead *a, const uint8_t *in, uint8_t *out, const struct iovec *iov,
               int iovcnt, size_t skip, size_t len)
{
    size_t off = 0;
    int i;
    for (i = 0; i < iovcnt && off < len; i++) {
        size_t seg = iov[i].iov_len, take;
        uint8_t *base = (uint8_t *)iov[i].iov_base;
        int outl = 0;
        if (skip >= seg) {
            skip -= seg;
            continue;
        }
        take = seg - skip;
        if (take > len - off)
            take = len - off;
        if (in == NULL) {
            if (evp.update(a->ctx, out + off, &outl, base + skip, (int)take) != 1)
                return -1;
        } else if (evp.update(a->ctx, base + skip, &outl, in + off, (int)take) != 1) {
            return -1;
        }
        if ((size_t)outl != take) /* GCM is a stream mode: nothing is held back */
            return -1;
        off += take;
        skip = 0;
    }
    return off == len ? 0 : -1;
}

int ddpw_aead_seal(ddpw_aead *a, uint64_t counter, const uint8_t *aad, size_t aad_len,
                   const struct iovec *iov, int iovcnt, size_t skip, size_t len,
                   uint8_t *out, uint8_t *tag)
{
    int outl = 0;
    if (!a->encrypt || len > (1u << 30) || iovcnt < 0 || iovcnt > 8)
        return -1;
    if (start(a, counter, aad, aad_len) != 0 || run(a, NULL, out, iov, iovcnt, skip, len) != 0)
        return -1;
    if (evp.final(a->ctx, out + len, &outl) != 1 || outl != 0)
        return -1;
    return evp.ctrl(a->ctx, EVP_CTRL_GCM_GET_TAG, DDPW_AEAD_TAG_BYTES, tag) == 1 ? 0 : -1;
}

int ddpw_aead_open(ddpw_aead *a, uint64_t counter, const uint8_t *aad, size_t aad_len,
                   const uint8_t *in, size_t len, const uint8_t *tag,
                   const struct iovec *out, int outcnt, size_t skip)
{
    unsigned char t[DDPW_AEAD_TAG_BYTES], sink[16];
    int outl = 0;
    if (a->encrypt || len > (1u << 30) || outcnt < 0 || outcnt > 8)
        return -1;
    memcpy(t, tag, sizeof t);
    if (start(a, counter, aad, aad_len) != 0 || run(a, in, NULL, out, outcnt, skip, len) != 0)
        return -1;
    if (evp.ctrl(a->ctx, EVP_CTRL_GCM_SET_TAG, DDPW_AEAD_TAG_BYTES, t) != 1)
        return -1;
    return evp.final(a->ctx, sink, &outl) == 1 ? 0 : -1;
}

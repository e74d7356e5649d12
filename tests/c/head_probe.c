/*
 * head_probe: drives the streaming C API of csrc/wire.h the way a socket
 * reader would, for tests/test_wire_c.py.
 *
 * Reads one payload (no length prefix) from stdin; argv[1] is the decoder
 * flags. Offers ddpw_decode_head the payload's bytes as they would arrive,
 * one more at a time, and prints one line per answer:
 *   need AVAIL NEED                     DDPW_NEED_MORE
 *   error STATUS TYPE FIELD HAVE NEED VALUE
 *   head AVAIL TAG HAS_GRADIENTS STEP WORKER_ID BLOCK_IDX NUM_BLOCKS COMPONENT
 *        COMPONENT_COUNT SIZES... GRADIENT_COUNT OFFSET TAIL_LEN TRAILING_LEN
 *   tail LOSS_BITS CORRECT TOTAL GLOBAL_LOSS_BITS
 *   reencode same|different
 * Every buffer is malloc'ed at its exact size so that a sanitizer build
 * catches any read past it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

static uint32_t f32_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static void print_error(const ddpw_error *err)
{
    printf("error %d %s %s %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", (int)err->status,
           err->message_type ? err->message_type : "-", err->field ? err->field : "-",
           err->have, err->need, err->value);
}

/* Rebuild the frame from the decoded head and tail; compare with the input. */
static void reencode(const uint8_t *payload, size_t len, const ddpw_head *h, const ddpw_tail *t)
{
    ddpw_message m;
    ddpw_error err;
    uint32_t *sizes = NULL;
    uint8_t *out;
    size_t head_len, written = 0, tail_written = 0;
    const size_t grad_bytes = (size_t)h->gradient_count * 4;
    int same;

    memset(&m, 0, sizeof m);
    m.tag = h->tag;
    m.step = h->step;
    m.worker_id = h->worker_id;
    m.block_idx = h->block_idx;
    m.num_blocks = h->num_blocks;
    m.component = h->component;
    m.component_count = h->component_count;
    if (h->component_count) {
        sizes = malloc((size_t)h->component_count * 4);
        if (!sizes)
            exit(3);
        ddpw_load_u32s(h->component_sizes, h->component_count, sizes);
    }
    m.component_sizes = sizes;
    m.gradients = payload + h->gradient_offset; /* the host is little-endian in CI */
    m.gradient_count = h->gradient_count;
    m.loss = t->loss;
    m.correct = t->correct;
    m.total = t->total;
    m.global_loss = t->global_loss;

    head_len = ddpw_head_size(&m);
    out = malloc(head_len + grad_bytes + h->tail_len + 1);
    if (!out)
        exit(3);
    if (ddpw_encode_head(&m, out, head_len, &written, &err) != DDPW_OK) {
        print_error(&err);
        exit(4);
    }
    memcpy(out + written, payload + h->gradient_offset, grad_bytes);
    if (ddpw_encode_tail(&m, out + written + grad_bytes, h->tail_len, &tail_written, &err) !=
        DDPW_OK) {
        print_error(&err);
        exit(4);
    }
    same = written == DDPW_PREFIX_LEN + h->gradient_offset && tail_written == h->tail_len &&
           ddpw_read_prefix(out) == len - h->trailing_len &&
           memcmp(out + DDPW_PREFIX_LEN, payload, len - h->trailing_len) == 0;
    printf("reencode %s\n", same ? "same" : "different");
    free(out);
    free(sizes);
}

int main(int argc, char **argv)
{
    const int flags = argc > 1 ? atoi(argv[1]) : 0;
    size_t cap = 1 << 16, len = 0, avail, n, i;
    uint8_t *buf = malloc(cap);
    uint8_t *payload;

    if (!buf)
        return 3;
    while ((n = fread(buf + len, 1, cap - len, stdin)) > 0) {
        len += n;
        if (len == cap) {
            uint8_t *bigger = realloc(buf, cap * 2);
            if (!bigger)
                return 3;
            buf = bigger;
            cap *= 2;
        }
    }
    /* exact-size copy: one byte past it is a sanitizer error */
    payload = malloc(len ? len : 1);
    if (!payload)
        return 3;
    memcpy(payload, buf, len);
    free(buf);

    for (avail = 0; avail <= len; avail++) {
        ddpw_head h;
        ddpw_error err;
        uint8_t *part = malloc(avail ? avail : 1); /* only what has "arrived" */
        ddpw_status st;
        if (!part)
            return 3;
        memcpy(part, payload, avail);
        st = ddpw_decode_head(part, avail, len, flags, &h, &err);
        free(part);
        if (st == DDPW_NEED_MORE) {
            printf("need %zu %zu\n", avail, h.need);
            continue;
        }
        if (st != DDPW_OK) {
            print_error(&err);
            break;
        }
        /* decode again over the whole payload: its pointers must stay valid */
        ddpw_decode_head(payload, len, len, flags, &h, &err);
        printf("head %zu %u %d %" PRIu64 " %" PRIu32 " %" PRIu32 " %" PRIu32 " %u %" PRIu32, avail,
               (unsigned)h.tag, h.has_gradients, h.step, h.worker_id, h.block_idx, h.num_blocks,
               (unsigned)h.component, h.component_count);
        for (i = 0; i < h.component_count; i++) {
            uint32_t size;
            ddpw_load_u32s(h.component_sizes + 4 * i, 1, &size);
            printf(" %" PRIu32, size);
        }
        printf(" %" PRIu64 " %zu %zu %zu\n", h.gradient_count, h.gradient_offset, h.tail_len,
               h.trailing_len);
        if (h.has_gradients) {
            ddpw_tail t;
            const size_t at = h.gradient_offset + (size_t)h.gradient_count * 4;
            if (ddpw_decode_tail(h.tag, payload + at, len - at, &t, &err) != DDPW_OK) {
                print_error(&err);
                break;
            }
            printf("tail %" PRIu32 " %" PRIu64 " %" PRIu64 " %" PRIu32 "\n", f32_bits(t.loss),
                   t.correct, t.total, f32_bits(t.global_loss));
            reencode(payload, len, &h, &t);
        }
        break;
    }
    free(payload);
    return 0;
}

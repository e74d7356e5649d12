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
 *        (OFFSET: of the first gradient byte; 0 without gradients)
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
static void reencode(const uint8_t *payload, size_t len, const ddpw_head *h)
{
    ddpw_message m = h->msg;
    ddpw_error err;
    uint32_t *sizes = NULL;
    uint8_t *out;
    size_t head_len, written = 0, tail_written = 0;
    const uint64_t count = m.component_sizes.count;
    int same;

    if (count) {
        sizes = malloc((size_t)count * 4);
        if (!sizes)
            exit(3);
        ddpw_load_u32s(m.component_sizes.data, (size_t)count, sizes);
    }
    m.component_sizes.data = sizes; /* the encoder takes host order */
    m.gradients.data = payload + h->bulk_offset; /* the host is little-endian in CI */

    head_len = ddpw_head_size(&m);
    out = malloc(head_len + h->bulk_len + h->tail_len + 1);
    if (!out)
        exit(3);
    if (ddpw_encode_head(&m, out, head_len, &written, &err) != DDPW_OK) {
        print_error(&err);
        exit(4);
    }
    memcpy(out + written, payload + h->bulk_offset, h->bulk_len);
    if (ddpw_encode_tail(&m, out + written + h->bulk_len, h->tail_len, &tail_written, &err) !=
        DDPW_OK) {
        print_error(&err);
        exit(4);
    }
    same = written == DDPW_PREFIX_LEN + h->bulk_offset && tail_written == h->tail_len &&
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
        printf("head %zu %u %d %" PRIu64 " %" PRIu32 " %" PRIu32 " %" PRIu32 " %u %" PRIu64, avail,
               (unsigned)h.msg.tag, h.has_gradients, h.msg.step, h.msg.worker_id,
               h.msg.block_idx, h.msg.num_blocks, (unsigned)h.msg.component,
               h.msg.component_sizes.count);
        for (i = 0; i < h.msg.component_sizes.count; i++) {
            uint32_t size;
            ddpw_load_u32s((const uint8_t *)h.msg.component_sizes.data + 4 * i, 1, &size);
            printf(" %" PRIu32, size);
        }
        printf(" %" PRIu64 " %zu %zu %zu\n", h.msg.gradients.count,
               h.has_gradients ? h.bulk_offset : 0, h.tail_len, h.trailing_len);
        if (h.has_gradients) {
            const size_t at = h.bulk_offset + (size_t)h.bulk_len;
            if (ddpw_decode_tail(h.msg.tag, payload + at, len - at, &h.msg, &err) != DDPW_OK) {
                print_error(&err);
                break;
            }
            printf("tail %" PRIu32 " %" PRIu64 " %" PRIu64 " %" PRIu32 "\n", f32_bits(h.msg.loss),
                   h.msg.correct, h.msg.total, f32_bits(h.msg.global_loss));
            reencode(payload, len, &h);
        }
        break;
    }
    free(payload);
    return 0;
}

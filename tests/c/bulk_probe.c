/*
 * bulk_probe: the streaming head decoder on messages with a bulk field, for
 * tests/test_ext_head.py.
 *
 * Reads one payload (no length prefix) from stdin; argv[1] is the decoder
 * flags. Offers ddpw_decode_head the payload one more byte at a time until
 * it answers something other than DDPW_NEED_MORE, and prints that answer:
 *   error STATUS TYPE FIELD HAVE NEED VALUE
 *   head AVAIL TAG HAS_GRADIENTS HAS_BULK SEQ KIND OP DTYPE ROOT COUNT
 *        BULK_OFFSET BULK_LEN TAIL_LEN TRAILING_LEN
 * Each offer is copied into a buffer of exactly that size, so a sanitizer
 * build catches a read past what has arrived.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

int main(int argc, char **argv)
{
    static uint8_t payload[1 << 20];
    const int flags = argc > 1 ? atoi(argv[1]) : 0;
    const size_t len = fread(payload, 1, sizeof payload, stdin);
    size_t avail;
    for (avail = 0; avail <= len; avail++) {
        ddpw_head h;
        ddpw_error err;
        ddpw_status st;
        uint8_t *copy = malloc(avail ? avail : 1);
        if (!copy)
            return 3;
        memcpy(copy, payload, avail);
        st = ddpw_decode_head(copy, avail, len, flags, &h, &err);
        free(copy);
        if (st == DDPW_NEED_MORE) {
            if (h.need <= avail || h.need > len)
                return 5; /* must ask for more, and never past the payload */
            continue;
        }
        if (st != DDPW_OK) {
            printf("error %d %s %s %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", (int)st,
                   err.message_type ? err.message_type : "-", err.field ? err.field : "-",
                   err.have, err.need, err.value);
            return 0;
        }
        printf("head %zu %u %d %d %" PRIu64 " %u %u %u %" PRIu32 " %" PRIu64 " %zu %" PRIu64
               " %zu %zu\n",
               avail, (unsigned)h.msg.tag, h.has_gradients, h.has_bulk, h.msg.seq,
               (unsigned)h.msg.kind, (unsigned)h.msg.op, (unsigned)h.msg.dtype, h.msg.root,
               h.msg.count, h.bulk_offset, h.bulk_len, h.tail_len, h.trailing_len);
        return 0;
    }
    return 4;
}

/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Framing of the kvd protocol, shared by the daemon and libkvd.
 *
 * A frame is an 8-byte header (u32 LE payload length, u32 LE number of attached fds)
 * followed by a protobuf-encoded kvd.v1.Envelope. fds travel in SCM_RIGHTS of the
 * sendmsg() that carries the header; since a stream socket may split or merge sends, the
 * receiver keeps received fds in a FIFO (struct wire_rx) and takes a frame's fds when the
 * whole frame has arrived. Payloads above WIRE_PAYLOAD_MAX are refused before anything is
 * buffered, and decoding draws from a fixed arena, so a peer cannot make the receiver
 * allocate more than WIRE_ARENA_BYTES per message.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvd.pb-c.h"

#define WIRE_HEADER_BYTES 8
#define WIRE_PAYLOAD_MAX (64u * 1024u)
#define WIRE_FDS_MAX 253u /* SCM_MAX_FD */
/* protobuf-c allocates per field: a well-formed 64 KiB message decodes into well under 4x
 * its size. A hostile one built to need more (thousands of empty submessages) runs out of
 * arena and fails to decode with -EBADMSG, which is the bound working. */
#define WIRE_ARENA_BYTES (4u * WIRE_PAYLOAD_MAX)
/* Chunk ids one message carries at most (an unmap request, a release reply, ChunksUnmapped);
 * a longer list goes in several. Packed, each id is at most 5 bytes of payload and 4 of
 * arena; unpacked, as libkvd 1.8 and earlier send them, protobuf-c's bookkeeping of each
 * repeated field takes about 64 bytes of arena per id, and the arena decodes 4080 of them:
 * half of that leaves such a peer room (test-wire, ids_at_the_limit). */
#define WIRE_IDS_MAX 2048u

typedef Kvd__V1__Envelope Envelope;

/* The length of HelloReply.device_uuid and ChunkGrant.device_uuid (a CUuuid). */
#define WIRE_DEVICE_UUID_BYTES 16u

/*
 * Encodes env into a newly allocated frame (header included) announcing nfds fds.
 * Returns 0, or -EMSGSIZE (payload over WIRE_PAYLOAD_MAX), -EINVAL (nfds over WIRE_FDS_MAX),
 * -ENOMEM.
 */
int wire_encode(const Envelope *env, uint32_t nfds, uint8_t **ret_frame, size_t *ret_size);

/* Receive side: a reassembly buffer plus the FIFO of received fds. */
struct wire_rx {
	uint8_t buf[WIRE_HEADER_BYTES + WIRE_PAYLOAD_MAX];
	size_t len;                    /* bytes buffered */
	int fds[2 * WIRE_FDS_MAX];     /* received fds not yet claimed by a frame */
	uint32_t nfds;
	uint32_t max_fds;              /* fds it may hold (wire_rx_init: all of fds[]) */
	_Alignas(16) uint8_t arena[WIRE_ARENA_BYTES];
	size_t arena_used;
	size_t frame_size;             /* size of the frame last returned by wire_rx_next() */
	uint32_t frame_nfds;
};

void wire_rx_init(struct wire_rx *rx);
/* Closes every unclaimed fd. */
void wire_rx_done(struct wire_rx *rx);

/* Where the next received bytes go, and how many fit. */
static inline uint8_t *wire_rx_space(struct wire_rx *rx, size_t *ret_n) {
	*ret_n = sizeof(rx->buf) - rx->len;
	return rx->buf + rx->len;
}

/* Accounts for n bytes received into wire_rx_space(). */
static inline void wire_rx_commit(struct wire_rx *rx, size_t n) {
	rx->len += n;
}

/* Adds received fds to the FIFO; on -EMFILE (more than max_fds) they are all closed. */
int wire_rx_push_fds(struct wire_rx *rx, const int *fds, uint32_t n);

/*
 * Decodes the next complete frame. Returns 1 with the envelope in *ret_env (valid until
 * the next call) and its fds in ret_fds[0..*ret_nfds) (now owned by the caller), 0 when more
 * bytes are needed, or: -EBADMSG (the payload does not decode; the frame and its fds are
 * dropped and the next call goes on with the following frame), -EMSGSIZE (announced
 * payload over the cap) or -EPROTO (more fds announced than allowed or received): after
 * these two the stream cannot be resynchronised, so drop the connection.
 */
int wire_rx_next(struct wire_rx *rx, Envelope **ret_env, int ret_fds[static WIRE_FDS_MAX],
                 uint32_t *ret_nfds);

/* Whether bytes of a frame not yet complete are buffered (after the last frame returned). */
bool wire_rx_frame_begun(struct wire_rx *rx);

/*
 * Closes the fds no frame can claim any more: fds travel with the first byte of the frame
 * that announces them, so with every received byte consumed (no frame begun), fds still
 * queued came with no announcing frame. Call when wire_rx_next() returned 0. Returns how
 * many it closed (a sender that attaches fds no frame announces breaks the protocol; they
 * would otherwise stay queued, up to the FIFO's 2 * WIRE_FDS_MAX).
 */
uint32_t wire_rx_drop_unannounced(struct wire_rx *rx);

/* Builds a receive cmsg buffer big enough for WIRE_FDS_MAX fds. */
#define WIRE_CMSG_SPACE (sizeof(struct cmsghdr) + WIRE_FDS_MAX * sizeof(int) + 16)

struct msghdr;
/* Moves the fds of a received SCM_RIGHTS control message into the FIFO. Returns 0, or
 * -EMFILE (FIFO full), -EBADMSG (control data truncated: the fds were lost). */
int wire_rx_take_cmsg(struct wire_rx *rx, struct msghdr *msg);

/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "basic/macro.h"
#include "wire.h"

static void put_le32(uint8_t *p, uint32_t v) {
	p[0] = v;
	p[1] = v >> 8;
	p[2] = v >> 16;
	p[3] = v >> 24;
}

static uint32_t get_le32(const uint8_t *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int wire_encode(const Envelope *env, uint32_t nfds, uint8_t **ret_frame, size_t *ret_size) {
	size_t n = kvd__v1__envelope__get_packed_size(env);
	uint8_t *frame;

	if (n > WIRE_PAYLOAD_MAX)
		return -EMSGSIZE;
	if (nfds > WIRE_FDS_MAX)
		return -EINVAL;
	frame = malloc(WIRE_HEADER_BYTES + n);
	if (!frame)
		return -ENOMEM;
	put_le32(frame, n);
	put_le32(frame + 4, nfds);
	kvd__v1__envelope__pack(env, frame + WIRE_HEADER_BYTES);
	*ret_frame = frame;
	*ret_size = WIRE_HEADER_BYTES + n;
	return 0;
}

void wire_rx_init(struct wire_rx *rx) {
	rx->len = 0;
	rx->nfds = 0;
	rx->arena_used = 0;
	rx->frame_size = 0;
	rx->frame_nfds = 0;
	rx->max_fds = ELEMENTSOF(rx->fds);
}

void wire_rx_done(struct wire_rx *rx) {
	for (uint32_t i = 0; i < rx->nfds; i++)
		safe_close(rx->fds[i]);
	rx->nfds = 0;
}

int wire_rx_push_fds(struct wire_rx *rx, const int *fds, uint32_t n) {
	if (n > MIN(rx->max_fds, (uint32_t)ELEMENTSOF(rx->fds)) - rx->nfds) {
		for (uint32_t i = 0; i < n; i++)
			safe_close(fds[i]);
		return -EMFILE;
	}
	memcpy(rx->fds + rx->nfds, fds, n * sizeof(int));
	rx->nfds += n;
	return 0;
}

int wire_rx_take_cmsg(struct wire_rx *rx, struct msghdr *msg) {
	int r = 0;

	for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		uint32_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int fds[WIRE_FDS_MAX];

		n = MIN(n, WIRE_FDS_MAX);
		memcpy(fds, CMSG_DATA(c), n * sizeof(int));
		if (wire_rx_push_fds(rx, fds, n) < 0)
			r = -EMFILE;
	}
	if (msg->msg_flags & MSG_CTRUNC)
		return -EBADMSG;
	return r;
}

/* protobuf-c allocator drawing from the receiver's arena; freeing is a no-op because the
 * whole arena is reset for the next frame. */
static void *arena_alloc(void *data, size_t size) {
	struct wire_rx *rx = data;
	size_t off = ALIGN_TO(rx->arena_used, 16);

	if (size > sizeof(rx->arena) || off > sizeof(rx->arena) - size)
		return NULL;
	rx->arena_used = off + size;
	return rx->arena + off;
}

static void arena_free(void *data _unused_, void *p _unused_) {
}

/* Drops the frame returned last time, if any. */
static void rx_consume(struct wire_rx *rx) {
	if (rx->frame_size == 0)
		return;
	memmove(rx->buf, rx->buf + rx->frame_size, rx->len - rx->frame_size);
	rx->len -= rx->frame_size;
	memmove(rx->fds, rx->fds + rx->frame_nfds, (rx->nfds - rx->frame_nfds) * sizeof(int));
	rx->nfds -= rx->frame_nfds;
	rx->frame_size = 0;
	rx->frame_nfds = 0;
}

bool wire_rx_frame_begun(struct wire_rx *rx) {
	rx_consume(rx);
	return rx->len > 0;
}

uint32_t wire_rx_drop_unannounced(struct wire_rx *rx) {
	uint32_t n;

	if (wire_rx_frame_begun(rx))
		return 0;
	n = rx->nfds;
	for (uint32_t i = 0; i < n; i++)
		rx->fds[i] = safe_close(rx->fds[i]);
	rx->nfds = 0;
	return n;
}

int wire_rx_next(struct wire_rx *rx, Envelope **ret_env, int ret_fds[static WIRE_FDS_MAX],
                 uint32_t *ret_nfds) {
	ProtobufCAllocator alloc = { .alloc = arena_alloc, .free = arena_free, .allocator_data = rx };
	uint32_t len, nfds;
	Envelope *env;

	rx_consume(rx);
	if (rx->len < WIRE_HEADER_BYTES)
		return 0;
	len = get_le32(rx->buf);
	nfds = get_le32(rx->buf + 4);
	if (len > WIRE_PAYLOAD_MAX)
		return -EMSGSIZE;
	if (nfds > WIRE_FDS_MAX)
		return -EPROTO;
	if (rx->len < WIRE_HEADER_BYTES + len)
		return 0;
	/* The fds were sent with the first byte of the frame, so they are all here by now. */
	if (nfds > rx->nfds)
		return -EPROTO;

	rx->arena_used = 0;
	env = kvd__v1__envelope__unpack(&alloc, len, rx->buf + WIRE_HEADER_BYTES);
	rx->frame_size = WIRE_HEADER_BYTES + len;
	rx->frame_nfds = nfds;
	if (!env) {
		for (uint32_t i = 0; i < nfds; i++)
			rx->fds[i] = safe_close(rx->fds[i]);
		return -EBADMSG;
	}
	memcpy(ret_fds, rx->fds, nfds * sizeof(int));
	/* Ownership of the frame's fds passes to the caller. */
	memset(rx->fds, 0xff, nfds * sizeof(int));
	*ret_env = env;
	*ret_nfds = nfds;
	return 1;
}

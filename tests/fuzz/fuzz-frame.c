/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target: the frame decoder (struct wire_rx), fed as a connection feeds it: bytes in
 * pieces of fuzzed sizes, fds (real ones) arriving with them, either pushed as they are or
 * in a kernel-format SCM_RIGHTS control message. Every frame that decodes is re-encoded,
 * and the re-encoding must decode and encode again to the same bytes; every fd the decoder
 * hands out is closed, and at the end wire_rx_done() must leave no fd open.
 *
 * Input:
 *   byte 0    mode: bit 0 fds come with the pieces, bit 1 through a control message,
 *             bit 2 that control message is flagged truncated (MSG_CTRUNC)
 *   byte 1    k - 1: the number of piece descriptors (1..16, low 4 bits)
 *   k bytes   piece descriptors, used in turn: bits 0-4 the piece's size - 1, 31 meaning as
 *             much as fits; bits 5-7 how many fds come with it (with mode bit 0)
 *   the rest  the byte stream
 *
 * Decoding stops where the daemon would drop the connection: -EMSGSIZE, -EPROTO, or fds
 * that do not fit or were lost.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "basic/macro.h"
#include "fuzz.h"
#include "wire.h"

static struct wire_rx *rx;
static int null_fd = -1;

/*
 * Whether m or a message inside it kept an unknown field numbered 0. protobuf-c refuses a
 * one-byte tag 0 but takes a longer encoding of it (0x80 0x00) as an unknown field, which it
 * then re-encodes in one byte: its own output no longer decodes. Harmless to kvd, which
 * never re-encodes what it received; such inputs skip the round trip.
 */
static bool has_unknown_tag0(const ProtobufCMessage *m) {
	const ProtobufCMessageDescriptor *d = m->descriptor;

	for (unsigned i = 0; i < m->n_unknown_fields; i++)
		if (m->unknown_fields[i].tag == 0)
			return true;
	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		const char *base = (const char *)m;

		if (f->type != PROTOBUF_C_TYPE_MESSAGE)
			continue;
		if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
		    *(const uint32_t *)(base + f->quantifier_offset) != f->id)
			continue;
		if (f->label == PROTOBUF_C_LABEL_REPEATED) {
			size_t n = *(const size_t *)(base + f->quantifier_offset);
			ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + f->offset);

			for (size_t j = 0; j < n; j++)
				if (has_unknown_tag0(v[j]))
					return true;
		} else {
			const ProtobufCMessage *sub = *(const ProtobufCMessage *const *)(base + f->offset);

			if (sub && has_unknown_tag0(sub))
				return true;
		}
	}
	return false;
}

/* Re-encodes a decoded envelope; our own encoding must be canonical: decoding it and
 * encoding again gives the same bytes. */
static void check_reencode(const Envelope *env, uint32_t nfds) {
	size_t packed = kvd__v1__envelope__get_packed_size(env), n1, n2;
	_cleanup_(freep) uint8_t *f1 = NULL, *f2 = NULL;
	Envelope *again;
	int r;

	r = wire_encode(env, nfds, &f1, &n1);
	if (r == -EMSGSIZE) {
		/* A packed repeated field is re-encoded unpacked: it may grow past the cap. */
		FUZZ_CHECK(packed > WIRE_PAYLOAD_MAX);
		return;
	}
	FUZZ_CHECK(r == 0, "wire_encode: %d", r);
	FUZZ_CHECK(n1 == WIRE_HEADER_BYTES + packed, "frame of %zu bytes for %zu packed", n1, packed);
	FUZZ_CHECK(f1[4] == (uint8_t)nfds && f1[5] == (uint8_t)(nfds >> 8));

	if (has_unknown_tag0(&env->base))
		return;
	again = kvd__v1__envelope__unpack(NULL, n1 - WIRE_HEADER_BYTES, f1 + WIRE_HEADER_BYTES);
	FUZZ_CHECK(again, "our own encoding does not decode");
	FUZZ_CHECK(again->body_case == env->body_case);
	FUZZ_CHECK(again->has_id == env->has_id && again->id == env->id);
	r = wire_encode(again, nfds, &f2, &n2);
	kvd__v1__envelope__free_unpacked(again, NULL);
	FUZZ_CHECK(r == 0, "wire_encode of the decoded encoding: %d", r);
	FUZZ_CHECK(n1 == n2, "re-encoding changed the size: %zu, then %zu", n1, n2);
	FUZZ_CHECK(memcmp(f1, f2, n1) == 0, "re-encoding is not stable");
}

/* Adds n new fds, as a connection's receive does. Returns false when the daemon would drop
 * the connection. */
static bool add_fds(uint32_t n, uint8_t mode) {
	int fds[8];

	for (uint32_t i = 0; i < n; i++) {
		fds[i] = fcntl(null_fd, F_DUPFD_CLOEXEC, 3);
		FUZZ_CHECK(fds[i] >= 0);
	}
	if (mode & 2) {
		_Alignas(struct cmsghdr) uint8_t control[CMSG_SPACE(sizeof(fds))];
		struct msghdr msg = {
			.msg_control = control,
			.msg_controllen = CMSG_SPACE(n * sizeof(int)),
			.msg_flags = mode & 4 ? MSG_CTRUNC : 0,
		};
		struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
		int r;

		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(n * sizeof(int));
		memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
		r = wire_rx_take_cmsg(rx, &msg);
		FUZZ_CHECK(r == 0 || r == -EMFILE || r == -EBADMSG, "wire_rx_take_cmsg: %d", r);
		return r == 0;
	}
	if (n == 0)
		return true;
	return wire_rx_push_fds(rx, fds, n) == 0;
}

/* Decodes every complete frame. Returns false when the stream cannot go on. */
static bool decode(void) {
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	Envelope *env;
	int r;

	while ((r = wire_rx_next(rx, &env, fds, &nfds)) != 0) {
		if (r == -EBADMSG)
			continue;
		if (r < 0) {
			FUZZ_CHECK(r == -EMSGSIZE || r == -EPROTO, "wire_rx_next: %d", r);
			return false;
		}
		FUZZ_CHECK(r == 1 && nfds <= WIRE_FDS_MAX);
		FUZZ_CHECK(rx->frame_size >= WIRE_HEADER_BYTES && rx->frame_size <= rx->len);
		for (uint32_t i = 0; i < nfds; i++) {
			FUZZ_CHECK(fcntl(fds[i], F_GETFD) >= 0, "frame fd %u is not open", i);
			close(fds[i]);
		}
		check_reencode(env, nfds);
	}
	return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
	const uint8_t *desc, *stream;
	size_t k, n, step = 0;
	unsigned fds_before;
	uint8_t mode;

	if (size < 3)
		return 0;
	if (!rx) {
		/* Over 300 KiB: allocated once. */
		rx = malloc(sizeof(*rx));
		null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		FUZZ_CHECK(rx && null_fd >= 0);
	}
	mode = data[0];
	k = (data[1] & 15) + 1;
	if (size < 2 + k)
		return 0;
	desc = data + 2;
	stream = data + 2 + k;
	n = size - 2 - k;

	fds_before = fuzz_fd_count();
	wire_rx_init(rx);
	while (n > 0) {
		uint8_t d = desc[step++ % k];
		size_t space, piece;
		uint8_t *p = wire_rx_space(rx, &space);

		/* A connection's buffer never fills up without a whole frame in it. */
		FUZZ_CHECK(space > 0, "receive buffer full with %zu bytes", rx->len);
		piece = (d & 31) == 31 ? space : (size_t)(d & 31) + 1;
		piece = MIN(MIN(piece, space), n);
		if ((mode & 1) && !add_fds(d >> 5, mode))
			break;
		memcpy(p, stream, piece);
		wire_rx_commit(rx, piece);
		stream += piece;
		n -= piece;
		if (!decode())
			break;
	}
	wire_rx_done(rx);
	FUZZ_CHECK(rx->nfds == 0);
	FUZZ_CHECK(fuzz_fd_count() == fds_before, "fds leaked: %u before, %u after", fds_before,
	           fuzz_fd_count());
	return 0;
}

/* SPDX-License-Identifier: MIT */
/*
 * Framing: envelopes survive encode -> wire_rx -> decode, however the bytes are split or
 * merged; the fd FIFO hands each frame the fds it announces; every size and fd cap is
 * enforced before anything is buffered or decoded; a bad payload costs only its frame.
 */

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basic/macro.h"
#include "test.h"
#include "wire.h"

static struct wire_rx *rx_new(void) {
	/* Over 300 KiB: too big for the stack. */
	struct wire_rx *rx = malloc(sizeof(*rx));

	ASSERT_NOT_NULL(rx);
	wire_rx_init(rx);
	return rx;
}

static void rx_free(struct wire_rx *rx) {
	wire_rx_done(rx);
	free(rx);
}

static void feed(struct wire_rx *rx, const void *data, size_t n) {
	size_t space;
	uint8_t *p = wire_rx_space(rx, &space);

	ASSERT_LE(n, space);
	memcpy(p, data, n);
	wire_rx_commit(rx, n);
}

static void put_header(uint8_t h[WIRE_HEADER_BYTES], uint32_t len, uint32_t nfds) {
	for (int i = 0; i < 4; i++) {
		h[i] = len >> (8 * i);
		h[4 + i] = nfds >> (8 * i);
	}
}

/* Feeds a hand-made frame: header announcing len payload bytes and nfds fds, then payload. */
static void feed_raw(struct wire_rx *rx, const void *payload, uint32_t len, uint32_t nfds) {
	uint8_t h[WIRE_HEADER_BYTES];

	put_header(h, len, nfds);
	feed(rx, h, sizeof(h));
	feed(rx, payload, len);
}

/* An envelope with only an id, and its frame. */
static uint8_t *frame_id(uint64_t id, uint32_t nfds, size_t *ret_size) {
	Envelope env = KVD__V1__ENVELOPE__INIT;
	uint8_t *f = NULL;

	env.has_id = 1;
	env.id = id;
	ASSERT_OK(wire_encode(&env, nfds, &f, ret_size));
	return f;
}

/* Whether a and b are the same open file description: a flag set through one shows
 * through the other (dup()s and SCM_RIGHTS copies share it, separate opens do not). */
static int same_open_file(int a, int b) {
	int fa = fcntl(a, F_GETFL), fb, same;

	ASSERT_GE(fa, 0);
	ASSERT_OK(fcntl(a, F_SETFL, fa ^ O_NONBLOCK));
	fb = fcntl(b, F_GETFL);
	ASSERT_GE(fb, 0);
	same = (fb & O_NONBLOCK) == ((fa ^ O_NONBLOCK) & O_NONBLOCK);
	ASSERT_OK(fcntl(a, F_SETFL, fa));
	return same;
}

static int fd_is_open(int fd) {
	return fcntl(fd, F_GETFD) >= 0;
}

TEST(roundtrip_hello) {
	Envelope env = KVD__V1__ENVELOPE__INIT, *got = NULL;
	Kvd__V1__Status st = KVD__V1__STATUS__INIT;
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *f = NULL;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds = 99;
	size_t size;

	env.has_id = 1;
	env.id = UINT64_C(0x1122334455667788);
	st.has_code = 1;
	st.code = -ENOSPC;
	st.message = (char *)"no room";
	env.status = &st;
	h.has_min_version = h.has_max_version = h.has_features = h.has_pid = 1;
	h.min_version = 1;
	h.max_version = 3;
	h.features = UINT64_MAX;
	h.tenant = (char *)"team-a";
	h.process_name = (char *)"vllm worker \xc3\xa9";
	h.pid = 4242;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &h;

	ASSERT_OK(wire_encode(&env, 0, &f, &size));
	ASSERT_GT(size, WIRE_HEADER_BYTES);
	/* Header: u32 LE payload length, u32 LE fd count. */
	ASSERT_EQ(f[0] | f[1] << 8 | f[2] << 16 | (uint32_t)f[3] << 24, size - WIRE_HEADER_BYTES);
	ASSERT_EQ(f[4] | f[5] | f[6] | f[7], 0);

	feed(rx, f, size);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(nfds, 0u);
	ASSERT_TRUE(got->has_id);
	ASSERT_EQ(got->id, UINT64_C(0x1122334455667788));
	ASSERT_NOT_NULL(got->status);
	ASSERT_EQ(got->status->code, -ENOSPC);
	ASSERT_STREQ(got->status->message, "no room");
	ASSERT_EQ(got->body_case, KVD__V1__ENVELOPE__BODY_HELLO);
	ASSERT_EQ(got->hello->min_version, 1u);
	ASSERT_EQ(got->hello->max_version, 3u);
	ASSERT_EQ(got->hello->features, UINT64_MAX);
	ASSERT_STREQ(got->hello->tenant, "team-a");
	ASSERT_STREQ(got->hello->process_name, "vllm worker \xc3\xa9");
	ASSERT_TRUE(got->hello->has_pid);
	ASSERT_EQ(got->hello->pid, 4242u);

	/* The frame is consumed by the next call: nothing is left. */
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	ASSERT_EQ(rx->len, 0u);
	rx_free(rx);
}

TEST(roundtrip_grow_reply_grants) {
	Envelope env = KVD__V1__ENVELOPE__INIT, *got = NULL;
	Kvd__V1__SeqGrowReply gr = KVD__V1__SEQ_GROW_REPLY__INIT;
	Kvd__V1__ChunkGrant g[3] = { KVD__V1__CHUNK_GRANT__INIT, KVD__V1__CHUNK_GRANT__INIT,
	                             KVD__V1__CHUNK_GRANT__INIT };
	Kvd__V1__ChunkGrant *gp[3] = { &g[0], &g[1], &g[2] };
	static const uint32_t ids[3] = { 0, 7, 4000000000u };
	static const uint64_t bytes[3] = { 4096, UINT64_C(1) << 40, 2 * 1024 * 1024 };
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *f = NULL;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	size_t size;

	for (int i = 0; i < 3; i++) {
		g[i].has_chunk_id = g[i].has_bytes = 1;
		g[i].chunk_id = ids[i];
		g[i].bytes = bytes[i];
	}
	gr.has_tokens = gr.has_generation = 1;
	gr.tokens = 48;
	gr.generation = 6;
	gr.n_grants = 3;
	gr.grants = gp;
	env.has_id = 1;
	env.id = 9;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW_REPLY;
	env.seq_grow_reply = &gr;

	ASSERT_OK(wire_encode(&env, 0, &f, &size));
	feed(rx, f, size);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 9u);
	ASSERT_NULL(got->status);
	ASSERT_EQ(got->body_case, KVD__V1__ENVELOPE__BODY_SEQ_GROW_REPLY);
	ASSERT_EQ(got->seq_grow_reply->tokens, 48u);
	ASSERT_EQ(got->seq_grow_reply->generation, 6u);
	ASSERT_EQ(got->seq_grow_reply->n_grants, 3u);
	for (int i = 0; i < 3; i++) {
		ASSERT_TRUE(got->seq_grow_reply->grants[i]->has_chunk_id);
		ASSERT_EQ(got->seq_grow_reply->grants[i]->chunk_id, ids[i]);
		ASSERT_EQ(got->seq_grow_reply->grants[i]->bytes, bytes[i]);
	}
	rx_free(rx);
}

TEST(byte_by_byte) {
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *a = NULL, *b = NULL, *all = NULL;
	size_t na, nb;
	Envelope *got;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	unsigned frames = 0;

	a = frame_id(1, 0, &na);
	b = frame_id(UINT64_C(1) << 62, 0, &nb);
	all = malloc(na + nb);
	ASSERT_NOT_NULL(all);
	memcpy(all, a, na);
	memcpy(all + na, b, nb);

	for (size_t i = 0; i < na + nb; i++) {
		int r;

		feed(rx, all + i, 1);
		r = wire_rx_next(rx, &got, fds, &nfds);
		if (i == na - 1 || i == na + nb - 1) {
			ASSERT_EQ(r, 1);
			ASSERT_EQ(got->id, frames == 0 ? 1 : UINT64_C(1) << 62);
			frames++;
		} else
			ASSERT_EQ(r, 0);
	}
	ASSERT_EQ(frames, 2u);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	ASSERT_EQ(rx->len, 0u);
	rx_free(rx);
}

TEST(several_frames_in_one_buffer) {
	struct wire_rx *rx = rx_new();
	uint8_t buf[256];
	size_t n = 0, split = 0;
	Envelope *got;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;

	for (uint64_t id = 1; id <= 4; id++) {
		_cleanup_(freep) uint8_t *f = NULL;
		size_t sz;

		f = frame_id(id * 1000, 0, &sz);
		ASSERT_LE(n + sz, sizeof(buf));
		memcpy(buf + n, f, sz);
		n += sz;
		if (id == 3)
			split = n + 3; /* three bytes into the header of the fourth frame */
	}

	feed(rx, buf, split);
	for (uint64_t id = 1; id <= 3; id++) {
		ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
		ASSERT_EQ(got->id, id * 1000);
	}
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	ASSERT_EQ(rx->len, 3u);
	feed(rx, buf + split, n - split);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 4000u);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	rx_free(rx);
}

TEST(fds_follow_their_frame) {
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *a = NULL, *b = NULL, *c = NULL, *d = NULL;
	size_t na, nb, nc, nd;
	int efd, p[2], fds[WIRE_FDS_MAX], extra, stray;
	uint64_t v = 5;
	uint32_t nfds;
	Envelope *got;
	char ch;

	efd = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(efd, 0);
	ASSERT_OK(pipe2(p, O_CLOEXEC));
	extra = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(extra, 0);

	a = frame_id(1, 1, &na);
	b = frame_id(2, 0, &nb);
	c = frame_id(3, 2, &nc);
	d = frame_id(4, 1, &nd);

	/* fds arrive with the first byte of their frame; frames C and D arrive in one read
	 * together with all three of their fds. */
	ASSERT_OK(wire_rx_push_fds(rx, &efd, 1));
	feed(rx, a, na);
	feed(rx, b, nb);
	ASSERT_OK(wire_rx_push_fds(rx, p, 2));
	ASSERT_OK(wire_rx_push_fds(rx, &extra, 1));
	feed(rx, c, nc);
	feed(rx, d, nd - 1); /* D stays incomplete */

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 1u);
	ASSERT_EQ(nfds, 1u);
	ASSERT_EQ(fds[0], efd);

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 2u);
	ASSERT_EQ(nfds, 0u);

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 3u);
	ASSERT_EQ(nfds, 2u);
	ASSERT_TRUE(same_open_file(fds[0], p[0]));
	ASSERT_TRUE(same_open_file(fds[1], p[1]));
	ASSERT_FALSE(same_open_file(fds[0], extra));
	/* ...and they still work as the pipe they were. */
	ASSERT_EQ(write(fds[1], "x", 1), 1);
	ASSERT_EQ(read(fds[0], &ch, 1), 1);
	ASSERT_EQ(ch, 'x');

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);

	/* Done: the claimed fds are the caller's and stay open, the one D would have
	 * claimed is closed. Nothing opens an fd in between, so numbers are not reused. */
	stray = extra;
	wire_rx_done(rx);
	ASSERT_FALSE(fd_is_open(stray));
	ASSERT_TRUE(fd_is_open(efd));
	ASSERT_TRUE(fd_is_open(p[0]));
	ASSERT_TRUE(fd_is_open(p[1]));
	ASSERT_EQ(write(efd, &v, sizeof(v)), (ssize_t)sizeof(v));
	safe_close(efd);
	safe_close(p[0]);
	safe_close(p[1]);
	free(rx);
}

/* A connection dropped right after a frame was handed out: the frame's fds belong to the
 * caller by then, only the ones still queued are closed. */
TEST(done_after_frame_keeps_claimed_fds) {
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *f = NULL;
	int pushed[2], fds[WIRE_FDS_MAX];
	uint32_t nfds;
	size_t n;
	Envelope *got;

	pushed[0] = eventfd(0, EFD_CLOEXEC);
	pushed[1] = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(pushed[0], 0);
	ASSERT_GE(pushed[1], 0);
	f = frame_id(3, 1, &n);
	ASSERT_OK(wire_rx_push_fds(rx, pushed, 2));
	feed(rx, f, n);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(nfds, 1u);
	ASSERT_EQ(fds[0], pushed[0]);

	wire_rx_done(rx);
	ASSERT_TRUE(fd_is_open(pushed[0]));
	ASSERT_FALSE(fd_is_open(pushed[1]));
	safe_close(pushed[0]);
	free(rx);
}

/* The real path: fds passed with SCM_RIGHTS over a socket, bytes and control data read
 * with recvmsg() straight into the receive buffer. */
TEST(scm_rights_over_socketpair) {
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *f = NULL;
	int sv[2], efd, p[2], send_fds[2], fds[WIRE_FDS_MAX];
	union {
		char buf[CMSG_SPACE(2 * sizeof(int))];
		struct cmsghdr align;
	} out;
	_Alignas(struct cmsghdr) char in[WIRE_CMSG_SPACE];
	struct iovec iov;
	struct msghdr msg;
	struct cmsghdr *cm;
	struct stat a, b;
	Envelope *got;
	uint32_t nfds;
	size_t size, space;
	ssize_t n;

	ASSERT_OK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv));
	efd = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(efd, 0);
	ASSERT_OK(pipe2(p, O_CLOEXEC));
	send_fds[0] = efd;
	send_fds[1] = p[1];
	f = frame_id(77, 2, &size);

	memset(&msg, 0, sizeof(msg));
	iov = (struct iovec){ .iov_base = f, .iov_len = size };
	msg.msg_iov = &iov;
	msg.msg_iovlen = 1;
	msg.msg_control = out.buf;
	msg.msg_controllen = sizeof(out.buf);
	cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
	memcpy(CMSG_DATA(cm), send_fds, sizeof(send_fds));
	ASSERT_EQ(sendmsg(sv[0], &msg, 0), (ssize_t)size);

	memset(&msg, 0, sizeof(msg));
	iov.iov_base = wire_rx_space(rx, &space);
	iov.iov_len = space;
	msg.msg_iov = &iov;
	msg.msg_iovlen = 1;
	msg.msg_control = in;
	msg.msg_controllen = sizeof(in);
	n = recvmsg(sv[1], &msg, MSG_CMSG_CLOEXEC);
	ASSERT_EQ(n, (ssize_t)size);
	wire_rx_commit(rx, n);
	ASSERT_OK(wire_rx_take_cmsg(rx, &msg));
	ASSERT_EQ(rx->nfds, 2u);

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 77u);
	ASSERT_EQ(nfds, 2u);
	/* New numbers, same open files, in the order they were sent. */
	ASSERT_NE(fds[0], efd);
	ASSERT_TRUE(same_open_file(fds[0], efd));
	ASSERT_TRUE(same_open_file(fds[1], p[1]));
	ASSERT_FALSE(same_open_file(fds[0], p[1]));
	ASSERT_OK(fstat(fds[1], &a));
	ASSERT_OK(fstat(p[1], &b));
	ASSERT_EQ(a.st_ino, b.st_ino);

	safe_close(fds[0]);
	safe_close(fds[1]);
	safe_close(efd);
	safe_close(p[0]);
	safe_close(p[1]);
	safe_close(sv[0]);
	safe_close(sv[1]);
	rx_free(rx);
}

TEST(encode_caps) {
	Envelope env = KVD__V1__ENVELOPE__INIT, *got;
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) char *s = NULL;
	uint8_t *f = NULL;
	size_t size, base, len;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;

	s = malloc(WIRE_PAYLOAD_MAX + 1);
	ASSERT_NOT_NULL(s);
	memset(s, 'a', WIRE_PAYLOAD_MAX);
	s[WIRE_PAYLOAD_MAX] = 0;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &h;
	h.tenant = s;

	ASSERT_ERRNO(wire_encode(&env, 0, &f, &size), -EMSGSIZE);
	ASSERT_NULL(f);

	/* A payload of exactly WIRE_PAYLOAD_MAX bytes is allowed and fits the buffer. Near
	 * the cap both length varints take 3 bytes, so the overhead is the same there. */
	s[WIRE_PAYLOAD_MAX - 100] = 0;
	base = kvd__v1__envelope__get_packed_size(&env) - (WIRE_PAYLOAD_MAX - 100);
	len = WIRE_PAYLOAD_MAX - base;
	memset(s, 'a', WIRE_PAYLOAD_MAX);
	s[len] = 0;
	ASSERT_EQ(kvd__v1__envelope__get_packed_size(&env), WIRE_PAYLOAD_MAX);
	ASSERT_OK(wire_encode(&env, 0, &f, &size));
	ASSERT_EQ(size, WIRE_HEADER_BYTES + WIRE_PAYLOAD_MAX);
	feed(rx, f, size);
	free(f);
	f = NULL;
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(strlen(got->hello->tenant), len);

	/* One byte more is refused. */
	s[len] = 'a';
	s[len + 1] = 0;
	ASSERT_ERRNO(wire_encode(&env, 0, &f, &size), -EMSGSIZE);

	/* fd count cap. */
	s[0] = 0;
	ASSERT_ERRNO(wire_encode(&env, WIRE_FDS_MAX + 1, &f, &size), -EINVAL);
	ASSERT_OK(wire_encode(&env, WIRE_FDS_MAX, &f, &size));
	ASSERT_EQ(f[4] | f[5] << 8, WIRE_FDS_MAX);
	free(f);
	rx_free(rx);
}

TEST(oversized_header_refused_early) {
	struct wire_rx *rx = rx_new();
	uint8_t h[WIRE_HEADER_BYTES];
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	Envelope *got;

	/* Only the header has arrived: the announced length alone is enough to refuse. */
	put_header(h, WIRE_PAYLOAD_MAX + 1, 0);
	feed(rx, h, sizeof(h));
	ASSERT_ERRNO(wire_rx_next(rx, &got, fds, &nfds), -EMSGSIZE);
	rx_free(rx);

	rx = rx_new();
	put_header(h, UINT32_MAX, 0);
	feed(rx, h, sizeof(h));
	ASSERT_ERRNO(wire_rx_next(rx, &got, fds, &nfds), -EMSGSIZE);
	rx_free(rx);
}

TEST(more_fds_announced_than_received) {
	static const uint8_t empty[1] = { 0 };
	struct wire_rx *rx = rx_new();
	uint8_t h[WIRE_HEADER_BYTES];
	int efd, fds[WIRE_FDS_MAX];
	uint32_t nfds;
	Envelope *got;

	efd = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(efd, 0);
	ASSERT_OK(wire_rx_push_fds(rx, &efd, 1));
	feed_raw(rx, empty, 0, 2);
	ASSERT_ERRNO(wire_rx_next(rx, &got, fds, &nfds), -EPROTO);
	/* The fd that did come stays in the FIFO until the connection is dropped. */
	ASSERT_TRUE(fd_is_open(efd));
	rx_free(rx);
	ASSERT_FALSE(fd_is_open(efd));

	/* Over the cap is refused from the header alone. */
	rx = rx_new();
	put_header(h, 10, WIRE_FDS_MAX + 1);
	feed(rx, h, sizeof(h));
	ASSERT_ERRNO(wire_rx_next(rx, &got, fds, &nfds), -EPROTO);
	rx_free(rx);
}

TEST(bad_payload_drops_only_its_frame) {
	/* Field 1 (varint) whose varint never ends. */
	static const uint8_t truncated_varint[] = { 0x08, 0xff };
	/* Field 10 (hello), length 5, but only one byte follows. */
	static const uint8_t short_submessage[] = { 0x52, 0x05, 0x08 };
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *ok = NULL;
	int efd, fds[WIRE_FDS_MAX];
	uint32_t nfds;
	size_t n;
	Envelope *got;

	efd = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(efd, 0);
	ok = frame_id(31, 0, &n);

	ASSERT_OK(wire_rx_push_fds(rx, &efd, 1));
	feed_raw(rx, truncated_varint, sizeof(truncated_varint), 1);
	feed_raw(rx, short_submessage, sizeof(short_submessage), 0);
	feed(rx, ok, n);

	ASSERT_ERRNO(wire_rx_next(rx, &got, fds, &nfds), -EBADMSG);
	/* The bad frame's fd is dropped with it. */
	ASSERT_FALSE(fd_is_open(efd));
	ASSERT_ERRNO(wire_rx_next(rx, &got, fds, &nfds), -EBADMSG);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 31u);
	ASSERT_EQ(nfds, 0u);
	ASSERT_EQ(rx->nfds, 0u);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	rx_free(rx);
}

TEST(truncated_frame_needs_more) {
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *f = NULL;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	size_t n;
	Envelope *got;

	f = frame_id(12345, 0, &n);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	feed(rx, f, WIRE_HEADER_BYTES - 1);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	feed(rx, f + WIRE_HEADER_BYTES - 1, 1);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	feed(rx, f + WIRE_HEADER_BYTES, n - WIRE_HEADER_BYTES - 1);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 0);
	ASSERT_EQ(rx->len, n - 1);
	feed(rx, f + n - 1, 1);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 12345u);
	rx_free(rx);
}

TEST(unknown_fields_are_skipped) {
	/* id = 7, then field 99 as a varint: a field from a newer peer. */
	static const uint8_t unknown_field[] = { 0x08, 0x07, 0x98, 0x06, 0x01 };
	/* Field 29, length-delimited and empty: a oneof member this side does not know. */
	static const uint8_t unknown_member[] = { 0x08, 0x08, 0xea, 0x01, 0x00 };
	struct wire_rx *rx = rx_new();
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	Envelope *got;

	feed_raw(rx, unknown_field, sizeof(unknown_field), 0);
	feed_raw(rx, unknown_member, sizeof(unknown_member), 0);

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_TRUE(got->has_id);
	ASSERT_EQ(got->id, 7u);
	ASSERT_EQ(got->body_case, KVD__V1__ENVELOPE__BODY__NOT_SET);
	ASSERT_NULL(got->status);

	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->id, 8u);
	ASSERT_EQ(got->body_case, KVD__V1__ENVELOPE__BODY__NOT_SET);
	rx_free(rx);
}

TEST(fd_fifo_full) {
	struct wire_rx *rx = rx_new();
	int efd, dups[8], fill[ELEMENTSOF(rx->fds)];
	struct rlimit rl;

	ASSERT_OK(getrlimit(RLIMIT_NOFILE, &rl));
	if (rl.rlim_cur < ELEMENTSOF(rx->fds) + 64) {
		rx_free(rx);
		TEST_SKIP("RLIMIT_NOFILE too low to fill the fd FIFO");
	}
	efd = eventfd(0, EFD_CLOEXEC);
	ASSERT_GE(efd, 0);
	for (size_t i = 0; i < ELEMENTSOF(fill); i++) {
		fill[i] = dup(efd);
		ASSERT_GE(fill[i], 0);
	}
	ASSERT_OK(wire_rx_push_fds(rx, fill, ELEMENTSOF(fill) - 4));
	for (size_t i = 0; i < ELEMENTSOF(dups); i++) {
		dups[i] = dup(efd);
		ASSERT_GE(dups[i], 0);
	}
	/* Eight do not fit where four would: all eight are closed, none is queued. */
	ASSERT_ERRNO(wire_rx_push_fds(rx, dups, ELEMENTSOF(dups)), -EMFILE);
	for (size_t i = 0; i < ELEMENTSOF(dups); i++)
		ASSERT_FALSE(fd_is_open(dups[i]));
	ASSERT_EQ(rx->nfds, ELEMENTSOF(fill) - 4);
	ASSERT_OK(wire_rx_push_fds(rx, fill + ELEMENTSOF(fill) - 4, 4));
	ASSERT_EQ(rx->nfds, ELEMENTSOF(fill));

	wire_rx_done(rx);
	for (size_t i = 0; i < ELEMENTSOF(fill); i++)
		ASSERT_FALSE(fd_is_open(fill[i]));
	safe_close(efd);
	free(rx);
}

static size_t put_varint(uint8_t *p, uint32_t v) {
	size_t n = 0;

	for (; v >= 0x80; v >>= 7)
		p[n++] = (uint8_t)(v | 0x80);
	p[n++] = (uint8_t)v;
	return n;
}

/* Decodes a ChunksUnmapped of n ids (first + i) sent unpacked, as libkvd 1.8 and earlier
 * encode them: its wire_rx_next() result, the ids checked when it decoded. */
static int decode_unpacked(uint32_t n, uint32_t first) {
	_cleanup_(freep) uint8_t *payload = malloc(WIRE_PAYLOAD_MAX), *inner = malloc(WIRE_PAYLOAD_MAX);
	struct wire_rx *rx = rx_new();
	size_t len = 0, m = 0;
	int fds[WIRE_FDS_MAX], r;
	uint32_t nfds;
	Envelope *got;

	ASSERT_NOT_NULL(payload);
	ASSERT_NOT_NULL(inner);
	for (uint32_t i = 0; i < n; i++) {
		inner[m++] = 0x08;    /* field 1, varint */
		m += put_varint(inner + m, first + i);
	}
	payload[len++] = 0xa2;        /* Envelope field 20 (chunks_unmapped), length-delimited */
	payload[len++] = 0x01;
	len += put_varint(payload + len, (uint32_t)m);
	ASSERT_LE(len + m, WIRE_PAYLOAD_MAX);
	memcpy(payload + len, inner, m);
	feed_raw(rx, payload, (uint32_t)(len + m), 0);
	r = wire_rx_next(rx, &got, fds, &nfds);
	if (r == 1) {
		ASSERT_EQ(got->body_case, KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED);
		ASSERT_EQ(got->chunks_unmapped->n_chunk_ids, n);
		for (uint32_t i = 0; i < n; i++)
			ASSERT_EQ(got->chunks_unmapped->chunk_ids[i], first + i);
	}
	rx_free(rx);
	return r;
}

/*
 * Lists of chunk ids: WIRE_IDS_MAX of the largest ids, packed as this side sends them, fit
 * a frame and decode; sent unpacked, as older peers do, they decode too, with room to
 * spare, while the 4081 a release once put in one message do not (the arena is the bound).
 */
TEST(ids_at_the_limit) {
	_cleanup_(freep) uint32_t *ids = malloc(WIRE_IDS_MAX * sizeof(*ids));
	Kvd__V1__Event ev = KVD__V1__EVENT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *got;
	struct wire_rx *rx = rx_new();
	_cleanup_(freep) uint8_t *f = NULL;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds;
	size_t size;

	ASSERT_NOT_NULL(ids);
	for (uint32_t i = 0; i < WIRE_IDS_MAX; i++)
		ids[i] = UINT32_MAX - i;
	ev.has_type = true;
	ev.type = KVD__V1__EVENT_TYPE__EVENT_CHUNKS_UNMAP;
	ev.n_chunk_ids = WIRE_IDS_MAX;
	ev.chunk_ids = ids;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVENT;
	env.event = &ev;
	ASSERT_OK(wire_encode(&env, 0, &f, &size));
	/* Packed: one key and length, then at most 5 bytes an id. */
	ASSERT_LE(size, WIRE_HEADER_BYTES + 16 + 5 * WIRE_IDS_MAX);
	feed(rx, f, size);
	ASSERT_EQ(wire_rx_next(rx, &got, fds, &nfds), 1);
	ASSERT_EQ(got->event->n_chunk_ids, WIRE_IDS_MAX);
	ASSERT_EQ(memcmp(got->event->chunk_ids, ids, WIRE_IDS_MAX * sizeof(*ids)), 0);
	rx_free(rx);

	ASSERT_EQ(decode_unpacked(WIRE_IDS_MAX, 1u << 21), 1);
	ASSERT_EQ(decode_unpacked(4081, 0), -EBADMSG);
}

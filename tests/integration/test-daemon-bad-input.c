/* SPDX-License-Identifier: MIT */
/*
 * Hostile and broken clients: each gets an error or a disconnect, never a crash, and the
 * daemon goes on answering status afterwards.
 */
#include <fcntl.h>
#include <poll.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

static struct fixture f;
static struct wire_rx *rx;

int test_setup(void) {
	static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
		                            "--hello-timeout", "300", "--max-connections", "8", NULL };

	rx = malloc(sizeof(*rx));
	if (!rx)
		return -ENOMEM;
	fixture_start(&f, args);
	return 0;
}

/* The daemon still serves: a fresh admin connection gets a status. */
static void assert_alive(void) {
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 16u << 20);
}

/* A raw connection, with the receive state reset. */
static int fresh(void) {
	wire_rx_init(rx);
	return raw_connect(&f);
}

/* Reads until EOF, failing on a timeout; returns the first status code seen, or 0. */
static int expect_disconnect(int fd) {
	int first = 0;

	for (;;) {
		Envelope *env;
		int r = raw_recv(fd, rx, 5000, &env);

		if (r == 0)
			break;
		ASSERT_EQ(r, 1);
		if (first == 0 && env->status)
			first = env->status->code;
	}
	close(fd);
	return first;
}

static Envelope *request(int fd, Envelope *env) {
	Envelope *rep;

	ASSERT_OK(raw_send(fd, env));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->id, env->id);
	ASSERT_TRUE(rep->status);
	return rep;
}

TEST(garbage_bytes) {
	int fd = fresh();
	static const char junk[] = "GET / HTTP/1.1\r\nHost: kvd\r\n\r\n";

	ASSERT_OK(raw_send_bytes(fd, junk, sizeof(junk) - 1));
	/* "GET " read as a length is far over the cap. */
	ASSERT_EQ(expect_disconnect(fd), -EMSGSIZE);
	assert_alive();
}

TEST(frame_over_the_cap) {
	uint8_t hdr[8] = { 0x01, 0x00, 0x01, 0x00 }; /* 65537 bytes */
	int fd = fresh();

	ASSERT_OK(raw_send_bytes(fd, hdr, sizeof(hdr)));
	ASSERT_EQ(expect_disconnect(fd), -EMSGSIZE);
	assert_alive();
}

TEST(truncated_frame_then_hang_up) {
	uint8_t bytes[8 + 10] = { 100 };
	int fd = fresh();

	ASSERT_OK(raw_send_bytes(fd, bytes, sizeof(bytes)));
	close(fd);
	assert_alive();
}

TEST(truncated_frame_then_silence) {
	uint8_t bytes[8 + 10] = { 100 };
	uint64_t before = fixture_status(&f, NULL, "protocol_errors");
	int fd = fresh();

	ASSERT_OK(raw_send_bytes(fd, bytes, sizeof(bytes)));
	/* No hello ever completes: the hello timeout closes it. */
	ASSERT_EQ(expect_disconnect(fd), 0);
	ASSERT_GT(fixture_status(&f, NULL, "protocol_errors"), before);
	assert_alive();
}

/* After hello, a frame begun that makes no progress closes the connection after
 * hello-timeout, fds and all; an idle connection between frames stays (before: a stalled
 * frame held its connection, buffer and fds forever). */
TEST(stalled_frame_after_hello) {
	uint8_t bytes[8 + 10] = { 100 };
	uint64_t before = fixture_status(&f, NULL, "protocol_errors");
	int fd = fresh(), idle = fresh();
	struct pollfd p = { .fd = idle, .events = POLLIN };

	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	wire_rx_init(rx);
	ASSERT_EQ(raw_hello(idle, rx, "t", 1, 1), 0);
	wire_rx_init(rx);
	ASSERT_OK(raw_send_bytes(fd, bytes, sizeof(bytes)));
	ASSERT_EQ(expect_disconnect(fd), 0);
	ASSERT_GT(fixture_status(&f, NULL, "protocol_errors"), before);
	/* The idle one is still open: nothing to read, no hangup. */
	ASSERT_EQ(poll(&p, 1, 0), 0);
	close(idle);
	assert_alive();
}

TEST(silent_client) {
	int fd = fresh();

	ASSERT_EQ(expect_disconnect(fd), 0);
	assert_alive();
}

TEST(undecodable_payload) {
	uint8_t frame[8 + 6] = { 6, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
	int fd = fresh();
	Envelope *env;

	ASSERT_OK(raw_send_bytes(fd, frame, sizeof(frame)));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &env), 1);
	ASSERT_TRUE(env->status);
	ASSERT_EQ(env->status->code, -EBADMSG);
	/* The framing survived: the connection still works. */
	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	close(fd);
	assert_alive();
}

TEST(unknown_message) {
	/* Envelope{id = 5, field 99 = 1}: a request from a newer protocol. */
	uint8_t frame[8 + 5] = { 5, 0, 0, 0, 0, 0, 0, 0, 0x08, 0x05, 0x98, 0x06, 0x01 };
	int fd = fresh();
	Envelope *env;

	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	ASSERT_OK(raw_send_bytes(fd, frame, sizeof(frame)));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &env), 1);
	ASSERT_EQ(env->id, 5u);
	ASSERT_EQ(env->status->code, -EOPNOTSUPP);
	/* Not a reason to disconnect. */
	{
		Kvd__V1__StatusRequest sr = KVD__V1__STATUS_REQUEST__INIT;
		Envelope req = KVD__V1__ENVELOPE__INIT;

		req.has_id = true;
		req.id = 6;
		req.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
		req.status_request = &sr;
		env = request(fd, &req);
		ASSERT_EQ(env->status->code, 0);
		ASSERT_EQ(env->body_case, KVD__V1__ENVELOPE__BODY_STATUS_REPLY);
	}
	close(fd);
	assert_alive();
}

TEST(wrong_protocol_version) {
	int fd = fresh();

	ASSERT_EQ(raw_hello(fd, rx, "t", 2, 3), -EPROTONOSUPPORT);
	ASSERT_EQ(expect_disconnect(fd), 0);
	ASSERT_EQ(kvd_client_connect(f.socket, "bad name!", &(kvd_client *){ NULL }), -EINVAL);
	assert_alive();
}

TEST(requests_out_of_order) {
	Kvd__V1__SeqGrow g = KVD__V1__SEQ_GROW__INIT;
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	Envelope req = KVD__V1__ENVELOPE__INIT;
	int fd = fresh();

	req.has_id = true;
	req.id = 9;
	req.body_case = KVD__V1__ENVELOPE__BODY_SEQ_GROW;
	req.seq_grow = &g;
	g.has_seq_id = g.has_tokens = true;
	g.seq_id = 1;
	g.tokens = 10;
	ASSERT_EQ(request(fd, &req)->status->code, -EPROTO);
	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	/* A sequence that was never opened. */
	req.id = 10;
	ASSERT_EQ(request(fd, &req)->status->code, -ENOENT);
	/* A second hello. */
	h.has_min_version = true;
	h.min_version = 1;
	req.id = 11;
	req.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	req.hello = &h;
	ASSERT_EQ(request(fd, &req)->status->code, -EPROTO);
	/* A reply sent as a request. */
	req.id = 12;
	req.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REPLY;
	req.status_reply = &(Kvd__V1__StatusReply)KVD__V1__STATUS_REPLY__INIT;
	ASSERT_EQ(request(fd, &req)->status->code, -EOPNOTSUPP);
	close(fd);
	assert_alive();
}

TEST(repeated_violations_disconnect) {
	Kvd__V1__StatusRequest sr = KVD__V1__STATUS_REQUEST__INIT;
	Envelope req = KVD__V1__ENVELOPE__INIT;
	int fd = fresh();

	req.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	req.status_request = &sr;
	req.has_id = true;
	/* Requests before hello, again and again. */
	for (int i = 1; i <= 8; i++) {
		req.id = i;
		ASSERT_OK(raw_send(fd, &req));
	}
	ASSERT_EQ(expect_disconnect(fd), -EPROTO);
	assert_alive();
}

TEST(sizes_that_overflow) {
	kvd_client *c = fixture_connect(&f, "sizes");
	kvd_model_spec huge = { "huge", 1024, 1024, 1024, 4096, KVD_DTYPE_F32, 65536, KVD_LAYOUT_PER_LAYER };
	kvd_model_spec ok = { "ok", 2, 2, 2, 8, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD };
	kvd_model_spec bad = ok;
	kvd_seq *s;
	int m;

	ASSERT_EQ(kvd_model_register(c, &huge), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "chunk"));
	bad.layers = UINT32_MAX;
	ASSERT_EQ(kvd_model_register(c, &bad), -EINVAL);
	bad = ok;
	bad.q_heads = 3;
	ASSERT_EQ(kvd_model_register(c, &bad), -EINVAL);
	bad = ok;
	bad.dtype = 77;
	ASSERT_EQ(kvd_model_register(c, &bad), -EINVAL);
	bad = ok;
	bad.layout = 0;
	ASSERT_EQ(kvd_model_register(c, &bad), -EINVAL);

	m = kvd_model_register(c, &ok);
	ASSERT_OK(m);
	ASSERT_EQ(kvd_seq_open(c, m, UINT32_MAX, &s), -EINVAL);
	ASSERT_EQ(kvd_seq_open(c, m, 0, &s), -EINVAL);
	ASSERT_EQ(kvd_seq_open(c, m + 1, 16, &s), -EINVAL);
	ASSERT_OK(kvd_seq_open(c, m, 1000, &s));
	ASSERT_EQ(kvd_seq_grow(s, UINT32_MAX), -EFBIG);
	ASSERT_EQ(kvd_seq_grow(s, 0), -EINVAL);
	ASSERT_OK(kvd_seq_grow(s, 999));
	ASSERT_EQ(kvd_seq_grow(s, 2), -EFBIG);
	ASSERT_OK(kvd_seq_grow(s, 1));
	ASSERT_EQ(kvd_seq_tokens(s, 1, 1), 1000);

	ASSERT_EQ(kvd_budget_set(c, UINT64_MAX), -EINVAL);
	ASSERT_EQ(kvd_budget_set(c, (16u << 20) + 1), -EINVAL);
	ASSERT_EQ(kvd_tenant_set(c, "sizes", 2 << 20, 1 << 20, 0), -EINVAL);
	ASSERT_EQ(kvd_tenant_set(c, "sizes", UINT64_MAX / 2, KVD_TENANT_NO_CAP, 0), -EINVAL);
	ASSERT_EQ(kvd_tenant_set(c, "sizes", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 100000), -EINVAL);
	ASSERT_EQ(kvd_tenant_set(c, "", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 1), -EINVAL);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	assert_alive();
}

TEST(admin_connection_cannot_allocate) {
	kvd_client *c = fixture_connect(&f, NULL);
	kvd_model_spec ok = { "ok", 2, 2, 2, 8, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD };

	ASSERT_EQ(kvd_model_register(c, &ok), -EPERM);
	kvd_client_unref(c);
}

TEST(request_with_fds) {
	Kvd__V1__StatusRequest sr = KVD__V1__STATUS_REQUEST__INIT;
	Envelope req = KVD__V1__ENVELOPE__INIT, *rep;
	int fd = fresh(), passed = dup(2);

	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	req.has_id = true;
	req.id = 3;
	req.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	req.status_request = &sr;
	ASSERT_OK(raw_send_fds(fd, &req, &passed, 1));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->id, 3u);
	ASSERT_EQ(rep->status->code, -EBADMSG);
	close(passed);
	close(fd);
	assert_alive();
}

/* Entries of the daemon's /proc/PID/fd: how many fds it holds. */
static unsigned daemon_fds(void) {
	char path[64];
	struct dirent *e;
	unsigned n = 0;
	DIR *d;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)f.pid);
	d = opendir(path);
	ASSERT_NOT_NULL(d);
	while ((e = readdir(d)))
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

/* Sends frame with n fds (of /dev/null) attached that its header does not announce. */
static void send_with_fds(int fd, const uint8_t *frame, size_t size, unsigned n) {
	union {
		struct cmsghdr align;
		uint8_t buf[CMSG_SPACE(WIRE_FDS_MAX * sizeof(int))];
	} control = {};
	struct iovec iov = { .iov_base = (void *)frame, .iov_len = size };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
		              .msg_controllen = CMSG_SPACE(n * sizeof(int)) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	int fds[WIRE_FDS_MAX];

	ASSERT_LE(n, WIRE_FDS_MAX);
	for (unsigned i = 0; i < n; i++) {
		fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
		ASSERT_OK(fds[i]);
	}
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(n * sizeof(int));
	memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
	ASSERT_EQ(sendmsg(fd, &msg, MSG_NOSIGNAL), (ssize_t)size);
	for (unsigned i = 0; i < n; i++)
		close(fds[i]);
}

/* fds attached to a frame that announces none are closed at once and count against the
 * client, instead of staying queued in the daemon until it disconnects (up to 2 x 253 a
 * connection then: 40 connections could take a 20,000-fd limit). 30 a frame: under the
 * cap of fds in flight (fds_in_flight_capped). */
TEST(unannounced_fds_are_closed) {
	Kvd__V1__StatusRequest sr = KVD__V1__STATUS_REQUEST__INIT;
	Envelope req = KVD__V1__ENVELOPE__INIT;
	uint64_t errors = fixture_status(&f, NULL, "protocol_errors");
	int fd = fresh();
	unsigned before;

	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	before = daemon_fds();
	req.has_id = true;
	req.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	req.status_request = &sr;
	for (int i = 1; i <= 3; i++) {
		uint8_t *frame;
		size_t size;
		Envelope *rep;

		req.id = (uint64_t)i;
		ASSERT_OK(wire_encode(&req, 0, &frame, &size));
		send_with_fds(fd, frame, size, 30);
		free(frame);
		/* Answered as usual: the frame itself is fine. */
		ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
		ASSERT_EQ(rep->id, (uint64_t)i);
	}
	/* None of the 90 stays (the daemon closes them right after it answers: give it a
	 * moment; a few for the status connections of the checks). */
	for (int i = 0; i < 200 && daemon_fds() >= before + 8; i++)
		usleep(10 * 1000);
	ASSERT_LT(daemon_fds(), before + 8);
	ASSERT_EQ(fixture_status(&f, NULL, "protocol_errors"), errors + 3);
	close(fd);
	assert_alive();
}

/* A connection holds at most 32 fds that no frame has taken yet (CONN_FDS_QUEUED_MAX):
 * a partial frame with more attached gets the connection closed, and the daemon holds none
 * of them (before: up to 506 each, as long as the frame never completed). */
TEST(fds_in_flight_capped) {
	/* A header announcing 40 fds and a payload that never comes. */
	uint8_t hdr[8] = { 16, 0, 0, 0, 40, 0, 0, 0 };
	uint64_t errors = fixture_status(&f, NULL, "protocol_errors");
	int fd = fresh();
	unsigned before;

	ASSERT_EQ(raw_hello(fd, rx, "t", 1, 1), 0);
	before = daemon_fds();
	send_with_fds(fd, hdr, sizeof(hdr), 40);
	ASSERT_EQ(expect_disconnect(fd), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "protocol_errors"), errors + 1);
	for (int i = 0; i < 200 && daemon_fds() >= before + 4; i++)
		usleep(10 * 1000);
	ASSERT_LT(daemon_fds(), before + 4);
	assert_alive();
}

TEST(connection_limit) {
	kvd_client *c[8 + 4] = { NULL };
	kvd_client *extra = NULL, *admin;
	uint64_t conns = 0;
	int n = 0;

	/* The limit is 8; wait until every earlier test's connection is gone, asking on one
	 * connection that stays (the count includes it): a connection per query would race
	 * each close with the daemon's sight of it. */
	admin = fixture_connect(&f, NULL);
	for (int i = 0; i < 1000 && conns != 1; i++) {
		kvd_status *st = NULL;

		ASSERT_OK(kvd_status_get(admin, &st));
		ASSERT_OK(kvd_status_u64(st, "connections", &conns));
		kvd_status_free(st);
		if (conns != 1)
			usleep(10000);
	}
	ASSERT_EQ(conns, 1u);
	for (; n < 8; n++)
		c[n] = fixture_connect(&f, "many");
	/* Root (as every administrative peer) has 4 more past the limit, so that an operator
	 * gets in on a node a client filled (the test runs as root)... */
	c[n++] = admin;
	for (; n < 12; n++)
		c[n] = fixture_connect(&f, NULL);
	/* ...and no more: the thirteenth is refused, with a reason. */
	ASSERT_EQ(kvd_client_connect(f.socket, "many", &extra), -EUSERS);
	for (int i = 0; i < n; i++)
		kvd_client_unref(c[i]);
	assert_alive();
	ASSERT_EQ(fixture_stop(&f), 0);
}


/* SPDX-License-Identifier: MIT */
/*
 * The metrics endpoint (--metrics-listen): what a scrape shows is what kvd_status shows,
 * the text passes promtool's checks, HTTP answers are right, only loopback addresses are
 * accepted, and connections that never finish their request are closed by the deadline
 * without holding up the daemon or other scrapes.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "basic/time-util.h"
#include "config.h"
#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)

/* 8 KiB blocks of 16 tokens, one table: 2048 tokens fill one 1 MiB chunk exactly. */
static const kvd_model_spec one_chunk = { "c", 1, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

static const char *const request_types[] = {
	"hello", "register_model", "seq_open", "seq_grow", "seq_release", "chunks_unmapped",
	"seq_digest", "budget_set", "tenant_set", "status", "model_output_proj", "seq_pin",
	"seq_unpin", "seq_claim", "register_event", "budget_reset", "tenant_reset",
	"tenant_delete", "evict", "evictions", "other",
};

/* A directory of our own for the metrics socket: the fixture makes its own only at start. */
static void make_dir(char *dir, size_t n) {
	snprintf(dir, n, "/tmp/kvd-metrics-XXXXXX");
	ASSERT_TRUE(mkdtemp(dir));
}

/* Connects to "unix:/path", "127.0.0.1:PORT" or "[::1]:PORT". */
static int metrics_connect(const char *addr) {
	union {
		struct sockaddr sa;
		struct sockaddr_un un;
		struct sockaddr_in in;
		struct sockaddr_in6 in6;
	} a = {};
	socklen_t len;
	int fd;

	if (strncmp(addr, "unix:", 5) == 0) {
		a.un.sun_family = AF_UNIX;
		ASSERT_LT(strlen(addr + 5), sizeof(a.un.sun_path));
		strcpy(a.un.sun_path, addr + 5);
		len = sizeof(a.un);
	} else if (strncmp(addr, "[::1]:", 6) == 0) {
		a.in6.sin6_family = AF_INET6;
		a.in6.sin6_addr = in6addr_loopback;
		a.in6.sin6_port = htons((uint16_t)atoi(addr + 6));
		len = sizeof(a.in6);
	} else {
		ASSERT_TRUE(strncmp(addr, "127.0.0.1:", 10) == 0);
		a.in.sin_family = AF_INET;
		a.in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		a.in.sin_port = htons((uint16_t)atoi(addr + 10));
		len = sizeof(a.in);
	}
	fd = socket(a.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	ASSERT_OK(fd);
	/* With errno's name: ASSERT_OK would read connect()'s -1 as -EPERM. */
	if (connect(fd, &a.sa, len) < 0)
		test_fail(__FILE__, __LINE__, "connect to %s: %s", addr, strerror(errno));
	return fd;
}

/*
 * Reads until the daemon closes, within timeout_ms. Returns the bytes (NUL-terminated, free
 * them) and sets *ret_reset when the connection was reset rather than closed.
 */
static char *read_to_eof(int fd, int timeout_ms, bool *ret_reset) {
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap);
	uint64_t deadline = now_ms() + timeout_ms;

	ASSERT_TRUE(buf);
	if (ret_reset)
		*ret_reset = false;
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		uint64_t now = now_ms();
		ssize_t k;

		if (now >= deadline)
			test_fail(__FILE__, __LINE__, "the daemon did not close within %d ms", timeout_ms);
		ASSERT_OK(poll(&p, 1, (int)(deadline - now)));
		if (p.revents == 0)
			continue;
		if (n + 4096 > cap) {
			cap *= 2;
			buf = realloc(buf, cap);
			ASSERT_TRUE(buf);
		}
		k = recv(fd, buf + n, cap - n - 1, 0);
		if (k < 0 && errno == ECONNRESET && ret_reset) {
			*ret_reset = true;
			break;
		}
		ASSERT_OK(k);
		if (k == 0)
			break;
		n += (size_t)k;
	}
	buf[n] = '\0';
	return buf;
}

/* One request, the whole response. */
static char *http_exchange(const char *addr, const char *request, size_t size) {
	int fd = metrics_connect(addr);
	char *resp;

	ASSERT_OK(raw_send_bytes(fd, request, size));
	resp = read_to_eof(fd, 5000, NULL);
	close(fd);
	return resp;
}

static char *http_request(const char *addr, const char *request) {
	return http_exchange(addr, request, strlen(request));
}

/* GET /metrics: checks the head of the response and returns a copy of the body. */
static char *scrape(const char *addr) {
	char *resp = http_request(addr, "GET /metrics HTTP/1.1\r\nHost: kvd\r\nAccept: */*\r\n\r\n");
	char *body, *copy;
	const char *cl;

	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 200 OK\r\n", 17) == 0);
	body = strstr(resp, "\r\n\r\n");
	ASSERT_TRUE(body);
	body[2] = '\0'; /* the head, with its last line's CRLF */
	body += 4;
	ASSERT_TRUE(strstr(resp, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
	ASSERT_TRUE(strstr(resp, "\r\nConnection: close\r\n"));
	cl = strstr(resp, "\r\nContent-Length: ");
	ASSERT_TRUE(cl);
	ASSERT_EQ(strtoull(cl + 18, NULL, 10), strlen(body));
	copy = strdup(body);
	ASSERT_TRUE(copy);
	free(resp);
	return copy;
}

/* The line "series value" of a scrape, or NULL. */
static const char *find_series(const char *body, const char *series) {
	size_t n = strlen(series);

	for (const char *p = body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (strncmp(p, series, n) == 0 && p[n] == ' ')
			return p + n + 1;
	return NULL;
}

static double metric(const char *body, const char *series) {
	const char *v = find_series(body, series);

	if (!v)
		test_fail(__FILE__, __LINE__, "no series %s in the scrape", series);
	return strtod(v, NULL);
}

static uint64_t metric_u64(const char *body, const char *series) {
	double v = metric(body, series);

	ASSERT_TRUE(v >= 0 && v < 18446744073709551616.0 && v == floor(v));
	return (uint64_t)v;
}

static uint64_t metricf_u64(const char *body, const char *fmt, const char *a, const char *b) {
	char series[256];

	snprintf(series, sizeof(series), fmt, a, b);
	return metric_u64(body, series);
}

static uint64_t status_u64(const kvd_status *st, const char *key) {
	uint64_t v;

	ASSERT_OK(kvd_status_u64(st, key, &v));
	return v;
}

/*
 * A load that touches every metric: three tenants (one capped), sequences, a grant refused
 * by the cap and one by the node budget, and a protocol error. The clients stay connected
 * (free them with kvd_client_unref) so that per-tenant connections and sequences show.
 */
struct load {
	kvd_client *admin, *a, *capped, *b;
	kvd_seq *seqs[6];
	unsigned n_seqs;
	unsigned status_requests;     /* made by load_run */
};

static kvd_seq *load_seq(struct load *l, kvd_client *c, int model) {
	kvd_seq *s;

	ASSERT_OK(kvd_seq_open(c, model, 2048, &s));
	ASSERT_LT(l->n_seqs, 6u);
	l->seqs[l->n_seqs++] = s;
	return s;
}

static void load_run(struct fixture *f, struct load *l) {
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct wire_rx *rx = calloc(1, sizeof(*rx));
	Envelope *rep;
	int m, fd;

	ASSERT_TRUE(rx);
	l->n_seqs = 0;
	l->admin = fixture_connect(f, NULL);
	ASSERT_OK(kvd_tenant_set(l->admin, "capped.tenant-1", 0, 1 * MiB, 3));
	l->a = fixture_connect(f, "a");
	l->capped = fixture_connect(f, "capped.tenant-1");
	l->b = fixture_connect(f, "b_2");

	m = kvd_model_register(l->a, &one_chunk);
	ASSERT_OK(m);
	for (int i = 0; i < 2; i++)
		ASSERT_OK(kvd_seq_grow(load_seq(l, l->a, m), 2048));
	m = kvd_model_register(l->capped, &one_chunk);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_grow(load_seq(l, l->capped, m), 2048));
	ASSERT_EQ(kvd_seq_grow(load_seq(l, l->capped, m), 2048), -EDQUOT);
	m = kvd_model_register(l->b, &one_chunk);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_grow(load_seq(l, l->b, m), 2048));
	ASSERT_EQ(kvd_seq_grow(load_seq(l, l->b, m), 2048), -ENOSPC);

	/* A request with neither id nor body: a protocol error, typed "other". */
	fd = raw_connect(f);
	wire_rx_init(rx);
	ASSERT_OK(raw_send(fd, &env));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->status->code, -EINVAL);
	close(fd);
	wire_rx_done(rx);
	free(rx);
	/* Its hang-up is seen asynchronously; connections must be stable before comparing.
	 * Asked on the admin connection, so that no new connection is counted. */
	l->status_requests = 0;
	for (;;) {
		kvd_status *st;
		uint64_t n;

		ASSERT_LT(l->status_requests, 500u);
		ASSERT_OK(kvd_status_get(l->admin, &st));
		l->status_requests++;
		ASSERT_OK(kvd_status_u64(st, "connections", &n));
		kvd_status_free(st);
		if (n == 4)
			break;
		usleep(10000);
	}
}

static void load_done(struct load *l) {
	for (unsigned i = 0; i < l->n_seqs; i++)
		ASSERT_OK(kvd_seq_release(l->seqs[i]));
	kvd_client_unref(l->admin);
	kvd_client_unref(l->a);
	kvd_client_unref(l->capped);
	kvd_client_unref(l->b);
}

static const char *const load_args_fmt[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                     "--budget", "4MiB", "--metrics-listen" };

static void start_with_metrics(struct fixture *f, const char *listen, const char *extra) {
	const char *args[16];
	size_t n = 0;

	for (size_t i = 0; i < sizeof(load_args_fmt) / sizeof(load_args_fmt[0]); i++)
		args[n++] = load_args_fmt[i];
	args[n++] = listen;
	if (extra) {
		args[n++] = "--hello-timeout";
		args[n++] = extra;
	}
	args[n] = NULL;
	fixture_start(f, args);
}

TEST(scrape_matches_status) {
	char dir[64], listen[128], *body, *resp;
	struct fixture f;
	struct load l;
	kvd_status *st;
	uint64_t refused = 0;

	make_dir(dir, sizeof(dir));
	snprintf(listen, sizeof(listen), "unix:%s/metrics.sock", dir);
	start_with_metrics(&f, listen, NULL);
	load_run(&f, &l);

	/* Nothing happens between the two: the status request is counted before the scrape. */
	ASSERT_OK(kvd_status_get(l.admin, &st));
	body = scrape(listen);

	ASSERT_EQ(metric_u64(body, "kvd_pool_bytes"), status_u64(st, "pool_bytes"));
	ASSERT_EQ(metric_u64(body, "kvd_budget_bytes"), status_u64(st, "budget_bytes"));
	ASSERT_EQ(metric_u64(body, "kvd_used_bytes"), status_u64(st, "used_bytes"));
	ASSERT_EQ(metric_u64(body, "kvd_used_bytes"), 4 * MiB);
	ASSERT_EQ(metric_u64(body, "kvd_block_bytes"), status_u64(st, "block_bytes"));
	ASSERT_EQ(metric_u64(body, "kvd_chunk_bytes"), status_u64(st, "chunk_bytes"));
	ASSERT_EQ(metric_u64(body, "kvd_chunks{state=\"free\"}"), status_u64(st, "chunks_free"));
	/* The host backend is one device. */
	ASSERT_EQ(metric_u64(body, "kvd_device_free_chunks{device=\"0\"}"), status_u64(st, "chunks_free"));
	ASSERT_EQ(metric_u64(body, "kvd_chunks{state=\"draining\"}"), status_u64(st, "chunks_draining"));
	ASSERT_EQ(metric_u64(body, "kvd_chunks{state=\"owned\"}"),
	          status_u64(st, "chunks_total") - status_u64(st, "chunks_free") -
	          status_u64(st, "chunks_draining"));
	ASSERT_EQ(metric_u64(body, "kvd_chunks{state=\"owned\"}"), 4u);
	ASSERT_EQ(metric_u64(body, "kvd_connections"), status_u64(st, "connections"));
	/* fixture_start's probe, then the admin, three tenants and the raw connection. */
	ASSERT_EQ(metric_u64(body, "kvd_connections_accepted_total"), 6u);
	ASSERT_EQ(metric_u64(body, "kvd_tenants"), kvd_status_tenants(st));
	ASSERT_EQ(metric_u64(body, "kvd_protocol_errors_total"), status_u64(st, "protocol_errors"));
	ASSERT_EQ(metric_u64(body, "kvd_protocol_errors_total"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_grants_total"), 4u);
	ASSERT_EQ(metric_u64(body, "kvd_grants_refused_total{reason=\"budget\"}"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_grants_refused_total{reason=\"tenant_max\"}"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_grants_refused_total{reason=\"pool\"}"), 0u);
	ASSERT_EQ(metric_u64(body, "kvd_grants_refused_total{reason=\"error\"}"), 0u);
	for (const char *r = "budget\0pool\0tenant_max\0error\0"; *r; r += strlen(r) + 1)
		refused += metricf_u64(body, "kvd_grants_refused_total{reason=\"%s\"}%s", r, "");
	ASSERT_EQ(refused, status_u64(st, "grants_refused"));
	ASSERT_EQ(metric(body, "kvd_build_info{version=\"" KVD_VERSION "\",backend=\"host\"}"), 1.0);

	for (uint32_t i = 0; i < kvd_status_tenants(st); i++) {
		static const char *const keys[][2] = {
			{ "kvd_tenant_used_bytes", "used_bytes" },
			{ "kvd_tenant_block_bytes", "block_bytes" },
			{ "kvd_tenant_min_bytes", "min_bytes" },
			{ "kvd_tenant_weight", "weight" },
			{ "kvd_tenant_chunks", "chunks" },
			{ "kvd_tenant_sequences", "sequences" },
			{ "kvd_tenant_connections", "connections" },
		};
		char series[256];
		const char *name;
		uint64_t v, max;

		ASSERT_OK(kvd_status_tenant_name(st, i, &name));
		for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
			ASSERT_OK(kvd_status_tenant_u64(st, i, keys[k][1], &v));
			ASSERT_EQ(metricf_u64(body, "%s{tenant=\"%s\"}", keys[k][0], name), v);
		}
		/* Its policy and tier, as labels of its info series. */
		{
			const char *policy, *tier;

			ASSERT_OK(kvd_status_tenant_str(st, i, "policy", &policy));
			ASSERT_OK(kvd_status_tenant_str(st, i, "tier", &tier));
			snprintf(series, sizeof(series), "kvd_tenant_info{tenant=\"%s\",policy=\"%s\","
			         "tier=\"%s\"}", name, policy, tier);
			ASSERT_EQ(metric_u64(body, series), 1u);
		}
		ASSERT_OK(kvd_status_tenant_u64(st, i, "max_bytes", &max));
		snprintf(series, sizeof(series), "kvd_tenant_max_bytes{tenant=\"%s\"}", name);
		if (max == UINT64_MAX)
			ASSERT_TRUE(strncmp(find_series(body, series), "+Inf\n", 5) == 0);
		else
			ASSERT_EQ(metric_u64(body, series), max);
	}
	ASSERT_EQ(metric_u64(body, "kvd_tenant_max_bytes{tenant=\"capped.tenant-1\"}"), 1 * MiB);
	ASSERT_EQ(metric_u64(body, "kvd_tenant_sequences{tenant=\"a\"}"), 2u);
	ASSERT_EQ(metric_u64(body, "kvd_tenant_connections{tenant=\"b_2\"}"), 1u);
	ASSERT_TRUE(isinf(metric(body, "kvd_tenant_max_bytes{tenant=\"a\"}")));

	/* Requests by type: what load_run and this test sent, each counted once. */
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"hello\"}"), 4u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"tenant_set\"}"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"register_model\"}"), 3u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"seq_open\"}"), 6u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"seq_grow\"}"), 6u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"status\"}"), l.status_requests + 1);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"other\"}"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"budget_set\"}"), 0u);

	/* Each histogram: cumulative buckets, +Inf is the count, the count is requests_total. */
	for (size_t t = 0; t < sizeof(request_types) / sizeof(request_types[0]); t++) {
		static const char *const les[] = {
			"1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025",
			"0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "+Inf",
		};
		const char *type = request_types[t];
		uint64_t prev = 0, count;
		char series[256];

		count = metricf_u64(body, "kvd_request_duration_seconds_count{type=\"%s\"}%s", type, "");
		ASSERT_EQ(count, metricf_u64(body, "kvd_requests_total{type=\"%s\"}%s", type, ""));
		for (size_t i = 0; i < sizeof(les) / sizeof(les[0]); i++) {
			uint64_t v;

			snprintf(series, sizeof(series),
			         "kvd_request_duration_seconds_bucket{type=\"%s\",le=\"%s\"}", type, les[i]);
			v = metric_u64(body, series);
			ASSERT_GE(v, prev);
			prev = v;
		}
		ASSERT_EQ(prev, count);
		snprintf(series, sizeof(series), "kvd_request_duration_seconds_sum{type=\"%s\"}", type);
		if (count > 0)
			ASSERT_TRUE(metric(body, series) > 0 && metric(body, series) < (double)count);
		else
			ASSERT_TRUE(metric(body, series) == 0);
	}
	free(body);

	/* A second scrape sees the first one's effect on nothing but time: scrapes are not
	 * requests of the protocol. */
	body = scrape(listen);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"status\"}"), l.status_requests + 1);
	free(body);

	/* Other paths, methods and versions. */
	resp = http_request(listen, "GET /other HTTP/1.1\r\nHost: kvd\r\n\r\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 404 Not Found\r\n", 24) == 0);
	ASSERT_TRUE(strstr(resp, "\r\nConnection: close\r\n"));
	free(resp);
	resp = http_request(listen, "GET /metricsx HTTP/1.1\r\n\r\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 404 ", 13) == 0);
	free(resp);
	resp = http_request(listen, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 405 ", 13) == 0);
	ASSERT_TRUE(strstr(resp, "\r\nAllow: GET\r\n"));
	free(resp);
	resp = http_request(listen, "GET /metrics HTTP/2.0\r\n\r\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 505 ", 13) == 0);
	free(resp);
	resp = http_request(listen, "hello there\r\n\r\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 400 ", 13) == 0);
	free(resp);
	/* HTTP/1.0, bare newlines and a query string are fine. */
	resp = http_request(listen, "GET /metrics?x=1 HTTP/1.0\n\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 200 OK\r\n", 17) == 0);
	ASSERT_TRUE(strstr(resp, "\nkvd_used_bytes 4194304\n"));
	free(resp);
	/* A request that never ends within the cap is answered and closed. */
	{
		size_t n = 9000;
		char *big = malloc(n);

		ASSERT_TRUE(big);
		memcpy(big, "GET /metrics HTTP/1.1\r\nX-Pad: ", 30);
		memset(big + 30, 'x', n - 30);
		resp = http_exchange(listen, big, n);
		ASSERT_TRUE(strncmp(resp, "HTTP/1.1 431 ", 13) == 0);
		free(resp);
		free(big);
	}

	kvd_status_free(st);
	load_done(&l);
	ASSERT_EQ(fixture_stop(&f), 0);
	/* The daemon bound the socket file, so it removed it. */
	ASSERT_EQ(access(listen + 5, F_OK), -1);
	rmdir(dir);
}

/* Every request type is counted under its own name, on the socket and on the rings. */
TEST(every_request_type_counted) {
	static const kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN };
	char dir[64], listen[128], *body;
	struct fixture f;
	kvd_client *c, *admin;
	kvd_seq *s;
	int m;

	make_dir(dir, sizeof(dir));
	snprintf(listen, sizeof(listen), "unix:%s/metrics.sock", dir);
	start_with_metrics(&f, listen, NULL);
	c = fixture_connect(&f, "t");
	admin = fixture_connect(&f, NULL);
	m = kvd_model_register_evictable(c, &one_chunk, &ev);
	ASSERT_TRUE(m >= 0);
	ASSERT_OK(kvd_seq_open(c, m, 256, &s));
	ASSERT_OK(kvd_seq_grow(s, 64));
	/* Once through the rings (when the daemon gave this connection any), once on the
	 * socket. */
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin(s));
	kvd_client_set_ring(c, 0);
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_TRUE(kvd_evict(admin, "t", 1, NULL) >= 0);
	ASSERT_OK(kvd_budget_reset(admin));
	body = scrape(listen);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"seq_pin\"}"), 2u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"seq_unpin\"}"), 2u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"evict\"}"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"budget_reset\"}"), 1u);
	ASSERT_EQ(metric_u64(body, "kvd_requests_total{type=\"other\"}"), 0u);
	free(body);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
	rmdir(dir);
}

static const char *find_promtool(void) {
	static char path[512];
	const char *env = getenv("PATH");

	if (access("/usr/bin/promtool", X_OK) == 0)
		return "/usr/bin/promtool";
	for (const char *p = env; p && *p;) {
		size_t n = strcspn(p, ":");

		snprintf(path, sizeof(path), "%.*s/promtool", (int)n, p);
		if (access(path, X_OK) == 0)
			return path;
		p += n + (p[n] == ':');
	}
	return NULL;
}

TEST(promtool_accepts_the_scrape) {
	const char *promtool = find_promtool();
	char dir[64], listen[128], file[128], cmd[768], out[4096];
	struct fixture f;
	struct load l;
	size_t n;
	char *body;
	FILE *p;

	if (!promtool)
		TEST_SKIP("promtool not found (tools/setup installs Debian's prometheus package)");
	make_dir(dir, sizeof(dir));
	snprintf(listen, sizeof(listen), "unix:%s/metrics.sock", dir);
	start_with_metrics(&f, listen, NULL);
	load_run(&f, &l);
	body = scrape(listen);

	snprintf(file, sizeof(file), "%s/scrape.txt", dir);
	p = fopen(file, "we");
	ASSERT_TRUE(p);
	ASSERT_EQ(fwrite(body, 1, strlen(body), p), strlen(body));
	ASSERT_EQ(fclose(p), 0);
	/* Every complaint fails: promtool's lint problems, and anything else it prints. */
	snprintf(cmd, sizeof(cmd), "%s check metrics < %s 2>&1", promtool, file);
	p = popen(cmd, "re");
	ASSERT_TRUE(p);
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = '\0';
	if (pclose(p) != 0 || n > 0)
		test_fail(__FILE__, __LINE__, "promtool check metrics complained:\n%s", out);

	unlink(file);
	free(body);
	load_done(&l);
	ASSERT_EQ(fixture_stop(&f), 0);
	rmdir(dir);
}

/* A free port on 127.0.0.1 (or ::1), as the kernel picks one; 0 when the family is absent. */
static int free_port(int family) {
	union {
		struct sockaddr sa;
		struct sockaddr_in in;
		struct sockaddr_in6 in6;
	} a = {};
	socklen_t len = family == AF_INET ? sizeof(a.in) : sizeof(a.in6);
	int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0), port;

	if (fd < 0)
		return 0;
	a.sa.sa_family = family;
	if (family == AF_INET)
		a.in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	else
		a.in6.sin6_addr = in6addr_loopback;
	if (bind(fd, &a.sa, len) < 0 || getsockname(fd, &a.sa, &len) < 0) {
		close(fd);
		return 0;
	}
	port = ntohs(family == AF_INET ? a.in.sin_port : a.in6.sin6_port);
	close(fd);
	return port;
}

static void scrape_tcp(const char *fmt, int family) {
	int port = free_port(family);
	char listen[64], *body, *resp;
	struct fixture f;

	if (port == 0) {
		fprintf(stderr, "no loopback for address family %d here, skipping %s\n", family, fmt);
		return;
	}
	snprintf(listen, sizeof(listen), fmt, port);
	/* The port was free a moment ago; another process taking it now would fail the start. */
	start_with_metrics(&f, listen, NULL);
	body = scrape(listen);
	ASSERT_EQ(metric_u64(body, "kvd_pool_bytes"), 16 * MiB);
	ASSERT_EQ(metric_u64(body, "kvd_connections"), 0u);
	free(body);
	resp = http_request(listen, "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n");
	ASSERT_TRUE(strncmp(resp, "HTTP/1.1 404 ", 13) == 0);
	free(resp);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(scrape_over_tcp) {
	scrape_tcp("127.0.0.1:%d", AF_INET);
	scrape_tcp("[::1]:%d", AF_INET6);
}

/* Runs kvd with args, returns its exit status and what it printed. */
static int run_kvd(const char *const *args, char *out, size_t n) {
	const char *argv[16] = { getenv("KVD_DAEMON") };
	int pipefd[2], status;
	size_t k = 0, got = 0;
	pid_t pid;

	ASSERT_TRUE(argv[0]);
	for (; args[k] && k < 14; k++)
		argv[k + 1] = args[k];
	argv[k + 1] = NULL;
	ASSERT_OK(pipe2(pipefd, O_CLOEXEC));
	pid = fixture_fork();
	if (pid == 0) {
		dup2(pipefd[1], 1);
		dup2(pipefd[1], 2);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	close(pipefd[1]);
	for (ssize_t r; got < n - 1 && (r = read(pipefd[0], out + got, n - 1 - got)) > 0;)
		got += (size_t)r;
	out[got] = '\0';
	close(pipefd[0]);
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Other machines' addresses need metrics-remote = yes; malformed ones are refused. */
TEST(remote_addresses_need_opt_in) {
	static const char *const loopback_refused[] = { "0.0.0.0:9100", "192.168.1.1:9100",
		                                        "[::]:9100", "[::ffff:127.0.0.1]:9100",
		                                        "[fe80::1]:9100" };
	static const char *const malformed[] = { "9100", "127.0.0.1", "127.0.0.1:0",
		                                 "127.0.0.1:65536", "localhost:9100", "[::1]9100",
		                                 "unix:", "http://127.0.0.1:9100/" };
	char dir[64], sock[128], out[4096];

	make_dir(dir, sizeof(dir));
	snprintf(sock, sizeof(sock), "%s/kvd.sock", dir);
	for (size_t i = 0; i < sizeof(loopback_refused) / sizeof(loopback_refused[0]); i++) {
		const char *args[] = { "--socket", sock, "--metrics-listen", loopback_refused[i], NULL };

		const char *opted[] = { "--metrics-listen", loopback_refused[i], "--metrics-remote",
			                "yes", "--backend", "host", "--check-config", "/dev/null", NULL };

		ASSERT_EQ(run_kvd(args, out, sizeof(out)), 2);
		ASSERT_TRUE(strstr(out, "--metrics-listen"));
		ASSERT_TRUE(strstr(out, "set metrics-remote = yes"));
		ASSERT_EQ(run_kvd(opted, out, sizeof(out)), 0);
	}
	for (size_t i = 0; i < sizeof(malformed) / sizeof(malformed[0]); i++) {
		const char *args[] = { "--socket", sock, "--metrics-listen", malformed[i], NULL };

		ASSERT_EQ(run_kvd(args, out, sizeof(out)), 2);
		ASSERT_TRUE(strstr(out, "--metrics-listen"));
	}
	/* Nothing was started: no socket file. */
	ASSERT_EQ(access(sock, F_OK), -1);
	rmdir(dir);
}

/* Whether a connection the daemon accepted for metrics was refused at once (a 503, or a
 * plain close or reset) rather than left waiting. */
static void assert_refused_at_once(int fd) {
	bool reset;
	char *resp = read_to_eof(fd, 2000, &reset);

	ASSERT_TRUE(reset || resp[0] == '\0' || strncmp(resp, "HTTP/1.1 503 ", 13) == 0);
	free(resp);
}

TEST(idle_connections_time_out) {
	enum { N_IDLE = 8, N_EXTRA = 24 };
	char dir[64], listen[128], *body, *resp;
	int idle[N_IDLE], extra[N_EXTRA], fd;
	struct fixture f;
	uint64_t start;

	make_dir(dir, sizeof(dir));
	snprintf(listen, sizeof(listen), "unix:%s/metrics.sock", dir);
	/* The deadline of a metrics connection is --hello-timeout. */
	start_with_metrics(&f, listen, "1500");

	start = now_ms();
	/* Fill every slot: one that stops mid-request, the others silent. */
	idle[0] = metrics_connect(listen);
	ASSERT_OK(raw_send_bytes(idle[0], "GET /metrics HTTP/1.1\r\nHost: kvd\r\n", 34));
	for (int i = 1; i < N_IDLE; i++)
		idle[i] = metrics_connect(listen);
	/* Past the limit, connections are refused at once, not queued. */
	for (int i = 0; i < N_EXTRA; i++)
		extra[i] = metrics_connect(listen);
	for (int i = 0; i < N_EXTRA; i++) {
		assert_refused_at_once(extra[i]);
		close(extra[i]);
	}
	/* The daemon serves its clients meanwhile, and the silent ones are still open. */
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 16 * MiB);
	ASSERT_LT(now_ms() - start, 1500u);
	for (int i = 0; i < N_IDLE; i++) {
		struct pollfd p = { .fd = idle[i], .events = POLLIN };

		ASSERT_EQ(poll(&p, 1, 0), 0);
	}

	/* The deadline closes them all; the partial request gets no answer. */
	for (int i = 0; i < N_IDLE; i++) {
		bool reset;

		resp = read_to_eof(idle[i], 3000, &reset);
		ASSERT_EQ(resp[0], '\0');
		free(resp);
		close(idle[i]);
	}
	ASSERT_GE(now_ms() - start, 1500u);

	/* The slots are free again. */
	body = scrape(listen);
	ASSERT_EQ(metric_u64(body, "kvd_connections"), 0u);
	free(body);

	/* A stop with a scrape connection still open is clean. */
	fd = metrics_connect(listen);
	ASSERT_EQ(fixture_stop(&f), 0);
	close(fd);
	rmdir(dir);
}

/*
 * A connection handles at most CONN_FRAMES_PER_TURN (64) frames per turn of the loop, then
 * lets the others go first: 256 requests pipelined in one write are all answered, in
 * order, over several turns (kvd_turns_yielded_total), rather than in one turn that would
 * hold up every other client.
 */
TEST(pipelined_requests_yield) {
	enum { N = 256 };
	char dir[64], listen[128], *body;
	struct wire_rx *rx = malloc(sizeof(*rx));
	uint8_t *all = NULL;
	size_t used = 0;
	struct fixture f;
	Envelope *rep;
	int fd;

	ASSERT_TRUE(rx != NULL);
	wire_rx_init(rx);
	make_dir(dir, sizeof(dir));
	snprintf(listen, sizeof(listen), "unix:%s/metrics.sock", dir);
	start_with_metrics(&f, listen, NULL);
	fd = raw_connect(&f);
	ASSERT_EQ(raw_hello(fd, rx, NULL, 1, 1), 0);
	body = scrape(listen);
	ASSERT_EQ(metric_u64(body, "kvd_turns_yielded_total"), 0u);
	free(body);
	for (uint64_t i = 0; i < N; i++) {
		Kvd__V1__StatusRequest sr = KVD__V1__STATUS_REQUEST__INIT;
		Envelope req = KVD__V1__ENVELOPE__INIT;
		uint8_t *frame;
		size_t size;

		req.has_id = true;
		req.id = 100 + i;
		req.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
		req.status_request = &sr;
		ASSERT_OK(wire_encode(&req, 0, &frame, &size));
		all = realloc(all, used + size);
		ASSERT_TRUE(all != NULL);
		memcpy(all + used, frame, size);
		used += size;
		free(frame);
	}
	ASSERT_OK(raw_send_bytes(fd, all, used));
	for (uint64_t i = 0; i < N; i++) {
		ASSERT_EQ(raw_recv(fd, rx, 10000, &rep), 1);
		ASSERT_EQ(rep->id, 100 + i);
		ASSERT_EQ(rep->body_case, KVD__V1__ENVELOPE__BODY_STATUS_REPLY);
	}
	body = scrape(listen);
	ASSERT_GT(metric_u64(body, "kvd_turns_yielded_total"), 0u);
	free(body);
	free(all);
	close(fd);
	free(rx);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* SPDX-License-Identifier: MIT */
/* The metrics module's pieces: listen addresses, label escaping and latency buckets. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "metrics.h"
#include "prometheus.h"
#include "node-values.h"
#include "test.h"

static int parse(const char *s, struct http_address *a) {
	const char *why = NULL;
	int r = http_address_parse(s, a, &why);

	if (r < 0)
		ASSERT_TRUE(why && *why);
	return r;
}

TEST(address_parse_and_locality) {
	struct http_address a;

	ASSERT_OK(parse("127.0.0.1:9100", &a));
	ASSERT_TRUE(a.local);
	ASSERT_EQ(a.sa.sa_family, AF_INET);
	ASSERT_EQ(ntohs(a.in.sin_port), 9100);
	ASSERT_EQ(ntohl(a.in.sin_addr.s_addr), INADDR_LOOPBACK);
	ASSERT_EQ(a.len, sizeof(a.in));
	ASSERT_OK(parse("127.1.2.3:1", &a));
	ASSERT_TRUE(a.local);
	ASSERT_OK(parse("[::1]:65535", &a));
	ASSERT_TRUE(a.local);
	ASSERT_EQ(a.sa.sa_family, AF_INET6);
	ASSERT_EQ(ntohs(a.in6.sin6_port), 65535);
	ASSERT_OK(parse("unix:/run/kvd/metrics.sock", &a));
	ASSERT_EQ(a.sa.sa_family, AF_UNIX);
	ASSERT_STREQ(a.un.sun_path, "/run/kvd/metrics.sock");
	ASSERT_TRUE(a.local);

	/* Addresses other machines reach parse, and say so (settings.c wants an opt-in). */
	static const char *const remote[] = {
		"0.0.0.0:9100", "10.0.0.1:9100", "128.0.0.1:9100", "[::]:9100", "[::2]:1",
		"[::ffff:127.0.0.1]:1",
	};
	for (size_t i = 0; i < sizeof(remote) / sizeof(remote[0]); i++) {
		ASSERT_OK(parse(remote[i], &a));
		if (a.local)
			test_fail(__FILE__, __LINE__, "'%s' counted as local", remote[i]);
	}

	static const char *const bad[] = {
		"", "[127.0.0.1]:1", "::1:9100", "127.0.0.1", "127.0.0.1:",
		"127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:+80", "127.0.0.1:80x",
		"localhost:9100", "[::1]", "[::1]9100", "[::1:9100", "unix:", "127.0.0.1 :80",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		if (parse(bad[i], &a) != -EINVAL)
			test_fail(__FILE__, __LINE__, "'%s' was accepted", bad[i]);

	char longpath[200] = "unix:/";
	memset(longpath + 6, 'x', sizeof(longpath) - 7);
	longpath[sizeof(longpath) - 1] = '\0';
	ASSERT_EQ(parse(longpath, &a), -EINVAL);

	/* As a setting, empty means off. */
	const char *why = NULL;
	ASSERT_OK(http_address_check("", &why));
	ASSERT_OK(http_address_check("unix:/x", &why));
	ASSERT_EQ(http_address_check("localhost:1", &why), -EINVAL);
	ASSERT_TRUE(strstr(why, "numeric"));
}

TEST(label_values_escaped) {
	char *out = NULL;
	size_t n = 0;
	FILE *f = open_memstream(&out, &n);

	ASSERT_TRUE(f);
	prometheus_label_value(f, "a\"b\\c\nd.e-f_g");
	ASSERT_EQ(fclose(f), 0);
	ASSERT_STREQ(out, "a\\\"b\\\\c\\nd.e-f_g");
	free(out);
}

TEST(latency_buckets) {
	struct metrics m = {};
	struct metrics_histogram *h = &m.requests[METRICS_REQUEST_SEQ_GROW];

	/* le is "less than or equal": a bound's own value goes into its bucket. */
	metrics_observe_request(&m, METRICS_REQUEST_SEQ_GROW, 0);
	metrics_observe_request(&m, METRICS_REQUEST_SEQ_GROW, 10000);
	metrics_observe_request(&m, METRICS_REQUEST_SEQ_GROW, 10001);
	metrics_observe_request(&m, METRICS_REQUEST_SEQ_GROW, 10000000000);
	metrics_observe_request(&m, METRICS_REQUEST_SEQ_GROW, 10000000001);
	ASSERT_EQ(h->buckets[0], 2u);
	ASSERT_EQ(h->buckets[1], 1u);
	ASSERT_EQ(h->buckets[METRICS_LATENCY_BUCKETS - 1], 1u);
	ASSERT_EQ(h->buckets[METRICS_LATENCY_BUCKETS], 1u);
	ASSERT_EQ(h->count, 5u);
	ASSERT_EQ(h->sum_ns, 20000020002u);

	/* Rounds and grant waits have histograms of their own; phases add up. */
	metrics_observe_round(&m, 1500, 1000, 300, 200);
	metrics_observe_round(&m, 3000000, 2000000, 500000, 500000);
	metrics_observe_grant_wait(&m, 2000000000);
	ASSERT_EQ(m.rounds.count, 2u);
	ASSERT_EQ(m.rounds.buckets[0], 0u);
	ASSERT_EQ(m.rounds.sum_ns, 3001500000u);
	ASSERT_EQ(m.phase_ns[METRICS_PHASE_SCORE], 2001000000u);
	ASSERT_EQ(m.phase_ns[METRICS_PHASE_COMPACT], 500200000u);
	ASSERT_EQ(m.grant_wait.count, 1u);
	ASSERT_EQ(m.grant_wait.buckets[METRICS_LATENCY_BUCKETS - 3], 1u); /* le 2.5 */

	/* Out-of-range types are counted, as "other". */
	metrics_observe_request(&m, _METRICS_REQUEST_MAX, 1);
	metrics_observe_request(&m, _METRICS_REQUEST_INVALID, 1);
	ASSERT_EQ(m.requests[METRICS_REQUEST_OTHER].count, 2u);
	ASSERT_STREQ(metrics_request_name(METRICS_REQUEST_SEQ_GROW), "seq_grow");
	ASSERT_STREQ(metrics_request_name(METRICS_REQUEST_OTHER), "other");
	ASSERT_TRUE(metrics_request_name(_METRICS_REQUEST_MAX) == NULL);
}

/* The node values' table against kvd.proto: every status name is an optional integer field
 * of StatusReply (the daemon sets it by name), every metric name is unique and says what it
 * is (counters end in _total), and each entry is in status, in the metrics, or both. */
TEST(node_values_table) {
	for (size_t i = 0; i < n_node_values; i++) {
		const struct node_value *v = &node_values[i];

		ASSERT_TRUE(v->status || v->metric);
		ASSERT_NOT_NULL(v->read);
		if (v->status) {
			Kvd__V1__StatusReply rep = KVD__V1__STATUS_REPLY__INIT;

			if (message_set_u64(&rep.base, v->status, 7) < 0)
				test_fail(__FILE__, __LINE__, "%s is not a StatusReply integer", v->status);
		}
		if (v->metric) {
			size_t n = strlen(v->metric);

			ASSERT_NOT_NULL(v->help);
			ASSERT_EQ(strncmp(v->metric, "kvd_", 4), 0);
			ASSERT_EQ(v->counter, n > 6 && strcmp(v->metric + n - 6, "_total") == 0);
			for (size_t j = 0; j < i; j++)
				ASSERT_FALSE(node_values[j].metric && strcmp(node_values[j].metric, v->metric) == 0);
		}
		for (size_t j = 0; v->status && j < i; j++)
			ASSERT_FALSE(node_values[j].status && strcmp(node_values[j].status, v->status) == 0);
	}
	/* What a set looks like: the field and its presence. */
	{
		Kvd__V1__StatusReply rep = KVD__V1__STATUS_REPLY__INIT;

		ASSERT_OK(message_set_u64(&rep.base, "used_bytes", 12345));
		ASSERT_TRUE(rep.has_used_bytes);
		ASSERT_EQ(rep.used_bytes, 12345u);
		ASSERT_OK(message_set_u64(&rep.base, "protocol_version", 3));
		ASSERT_EQ(rep.protocol_version, 3u);
		ASSERT_ERRNO(message_set_u64(&rep.base, "daemon_version", 1), -ENOENT);
		ASSERT_ERRNO(message_set_u64(&rep.base, "no_such_field", 1), -ENOENT);
	}
}

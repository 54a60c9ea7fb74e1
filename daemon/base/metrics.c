/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "metrics.h"

static const char *const request_names[_METRICS_REQUEST_MAX] = {
	[METRICS_REQUEST_HELLO] = "hello",
	[METRICS_REQUEST_REGISTER_MODEL] = "register_model",
	[METRICS_REQUEST_SEQ_OPEN] = "seq_open",
	[METRICS_REQUEST_SEQ_GROW] = "seq_grow",
	[METRICS_REQUEST_SEQ_RELEASE] = "seq_release",
	[METRICS_REQUEST_CHUNKS_UNMAPPED] = "chunks_unmapped",
	[METRICS_REQUEST_SEQ_DIGEST] = "seq_digest",
	[METRICS_REQUEST_BUDGET_SET] = "budget_set",
	[METRICS_REQUEST_TENANT_SET] = "tenant_set",
	[METRICS_REQUEST_STATUS] = "status",
	[METRICS_REQUEST_MODEL_OUTPUT_PROJ] = "model_output_proj",
	[METRICS_REQUEST_SEQ_PIN] = "seq_pin",
	[METRICS_REQUEST_SEQ_UNPIN] = "seq_unpin",
	[METRICS_REQUEST_SEQ_CLAIM] = "seq_claim",
	[METRICS_REQUEST_REGISTER_EVENT] = "register_event",
	[METRICS_REQUEST_BUDGET_RESET] = "budget_reset",
	[METRICS_REQUEST_TENANT_RESET] = "tenant_reset",
	[METRICS_REQUEST_TENANT_DELETE] = "tenant_delete",
	[METRICS_REQUEST_EVICT] = "evict",
	[METRICS_REQUEST_EVICTIONS] = "evictions",
	[METRICS_REQUEST_CONNECTIONS] = "connections",
	[METRICS_REQUEST_SEQUENCES] = "sequences",
	[METRICS_REQUEST_DISCONNECT] = "disconnect",
	[METRICS_REQUEST_PLAN] = "plan",
	[METRICS_REQUEST_SEQ_RECALL] = "seq_recall",
	[METRICS_REQUEST_SEQ_TRUNCATE] = "seq_truncate",
	[METRICS_REQUEST_SEQ_PUBLISH] = "seq_publish",
	[METRICS_REQUEST_PREFIX_LOOKUP] = "prefix_lookup",
	[METRICS_REQUEST_RELOAD] = "reload",
	[METRICS_REQUEST_CONFIG] = "config",
	[METRICS_REQUEST_OTHER] = "other",
};

const uint64_t metrics_bucket_ns[METRICS_LATENCY_BUCKETS] = {
	10000, 25000, 50000, 100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000,
	25000000, 50000000, 100000000, 250000000, 500000000, 1000000000, 2500000000, 5000000000,
	10000000000,
};

static void observe(struct metrics_histogram *h, uint64_t ns) {
	unsigned i;

	/* Most requests take microseconds: a forward scan stops in the first buckets. */
	for (i = 0; i < METRICS_LATENCY_BUCKETS && ns > metrics_bucket_ns[i]; i++)
		;
	h->buckets[i]++;
	h->count++;
	h->sum_ns += ns;
}

void metrics_observe_request(struct metrics *m, enum metrics_request type, uint64_t ns) {
	if (type < 0 || type >= _METRICS_REQUEST_MAX)
		type = METRICS_REQUEST_OTHER;
	observe(&m->requests[type], ns);
}

void metrics_observe_grant_wait(struct metrics *m, uint64_t ns) {
	observe(&m->grant_wait, ns);
}

void metrics_observe_round(struct metrics *m, uint64_t duration_us, uint64_t score_us,
                           uint64_t select_us, uint64_t compact_us) {
	observe(&m->rounds, duration_us * 1000);
	m->phase_ns[METRICS_PHASE_SCORE] += score_us * 1000;
	m->phase_ns[METRICS_PHASE_SELECT] += select_us * 1000;
	m->phase_ns[METRICS_PHASE_COMPACT] += compact_us * 1000;
}

const char *metrics_request_name(enum metrics_request type) {
	if (type < 0 || type >= _METRICS_REQUEST_MAX)
		return NULL;
	return request_names[type];
}


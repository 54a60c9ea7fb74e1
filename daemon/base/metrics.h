/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the metrics endpoint (prometheus.h) shows that no other module keeps: requests by
 * type and how long the daemon took to handle each, as one histogram per type; how long
 * grows waited for an eviction round; how long rounds took, and their phases.
 *
 * Single-threaded like the rest of the daemon: plain integers, updated and read on the
 * loop's thread.
 */

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* Request types, the `type` label of kvd_requests_total and kvd_request_duration_seconds. */
enum metrics_request {
	METRICS_REQUEST_HELLO,
	METRICS_REQUEST_REGISTER_MODEL,
	METRICS_REQUEST_SEQ_OPEN,
	METRICS_REQUEST_SEQ_GROW,
	METRICS_REQUEST_SEQ_RELEASE,
	METRICS_REQUEST_CHUNKS_UNMAPPED,
	METRICS_REQUEST_SEQ_DIGEST,
	METRICS_REQUEST_BUDGET_SET,
	METRICS_REQUEST_TENANT_SET,
	METRICS_REQUEST_STATUS,
	METRICS_REQUEST_MODEL_OUTPUT_PROJ,
	METRICS_REQUEST_SEQ_PIN,
	METRICS_REQUEST_SEQ_UNPIN,
	METRICS_REQUEST_SEQ_CLAIM,
	METRICS_REQUEST_REGISTER_EVENT,
	METRICS_REQUEST_BUDGET_RESET,
	METRICS_REQUEST_TENANT_RESET,
	METRICS_REQUEST_TENANT_DELETE,
	METRICS_REQUEST_EVICT,
	METRICS_REQUEST_EVICTIONS,
	METRICS_REQUEST_CONNECTIONS,
	METRICS_REQUEST_SEQUENCES,
	METRICS_REQUEST_DISCONNECT,
	METRICS_REQUEST_PLAN,
	METRICS_REQUEST_SEQ_RECALL,
	METRICS_REQUEST_SEQ_TRUNCATE,
	METRICS_REQUEST_SEQ_PUBLISH,
	METRICS_REQUEST_PREFIX_LOOKUP,
	METRICS_REQUEST_RELOAD,
	METRICS_REQUEST_CONFIG,
	METRICS_REQUEST_OTHER,        /* unknown to this daemon, or a reply sent the wrong way */
	_METRICS_REQUEST_MAX,
	_METRICS_REQUEST_INVALID = -EINVAL,
};

/* Upper bounds from 10 us to 10 s; a last bucket, +Inf, takes the rest. */
#define METRICS_LATENCY_BUCKETS 19
/* Each bucket's upper bound in nanoseconds: 1, 2.5 and 5 times each power of ten. */
extern const uint64_t metrics_bucket_ns[METRICS_LATENCY_BUCKETS];

struct metrics_histogram {
	uint64_t buckets[METRICS_LATENCY_BUCKETS + 1]; /* per bucket, not cumulative */
	uint64_t count;
	uint64_t sum_ns;
};

/* The phases of an eviction round, the `phase` label of kvd_eviction_phase_seconds_total. */
enum metrics_phase {
	METRICS_PHASE_SCORE,
	METRICS_PHASE_SELECT,         /* selection, and the summaries of what is dropped */
	METRICS_PHASE_COMPACT,        /* applying it on the loop: compaction, chunks freed */
	_METRICS_PHASE_MAX,
};

struct metrics {
	struct metrics_histogram requests[_METRICS_REQUEST_MAX];
	struct metrics_histogram grant_wait;  /* grows parked for a round, until answered */
	struct metrics_histogram rounds;      /* eviction rounds' durations */
	uint64_t phase_ns[_METRICS_PHASE_MAX];
};

/* Counts one request of `type` that took ns nanoseconds to handle. */
void metrics_observe_request(struct metrics *m, enum metrics_request type, uint64_t ns);

/* Counts a grow answered (granted or refused) ns after it was first parked for a round. */
void metrics_observe_grant_wait(struct metrics *m, uint64_t ns);

/* Counts an eviction round of duration_us, with its phases. */
void metrics_observe_round(struct metrics *m, uint64_t duration_us, uint64_t score_us,
                           uint64_t select_us, uint64_t compact_us);

/* The label value of a request type ("seq_grow"), or NULL when out of range. */
const char *metrics_request_name(enum metrics_request type);

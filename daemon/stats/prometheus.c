/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "config.h"
#include "evict.h"
#include "metrics.h"
#include "node-values.h"
#include "policy.h"
#include "prometheus.h"
#include "server.h"
#include "tier.h"

static const char *const phase_names[_METRICS_PHASE_MAX] = {
	[METRICS_PHASE_SCORE] = "score",
	[METRICS_PHASE_SELECT] = "select",
	[METRICS_PHASE_COMPACT] = "compact",
};

static const char *const refusal_names[_POOL_REFUSED_MAX] = {
	[POOL_REFUSED_BUDGET] = "budget",
	[POOL_REFUSED_POOL] = "pool",
	[POOL_REFUSED_TENANT_MAX] = "tenant_max",
	[POOL_REFUSED_ERROR] = "error",
	[POOL_REFUSED_PINNED] = "pinned",
};

void prometheus_label_value(FILE *f, const char *value) {
	for (const char *p = value; *p; p++)
		switch (*p) {
		case '\\':
			fputs("\\\\", f);
			break;
		case '"':
			fputs("\\\"", f);
			break;
		case '\n':
			fputs("\\n", f);
			break;
		default:
			fputc(*p, f);
		}
}

static void family(FILE *f, const char *name, const char *type, const char *help) {
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample_u64(FILE *f, const char *name, uint64_t v) {
	fprintf(f, "%s %" PRIu64 "\n", name, v);
}

static void gauge(FILE *f, const char *name, const char *help, uint64_t v) {
	family(f, name, "gauge", help);
	sample_u64(f, name, v);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v) {
	family(f, name, "counter", help);
	sample_u64(f, name, v);
}

/* Seconds from nanoseconds, exactly: an integer part and nine decimals. */
static void write_seconds(FILE *f, uint64_t ns) {
	fprintf(f, "%" PRIu64 ".%09" PRIu64, ns / 1000000000, ns % 1000000000);
}

/* The samples of one histogram; label is "" or a label pair and a comma (type="hello",). */
static void histogram(FILE *f, const char *name, const char *label, const struct metrics_histogram *h) {
	uint64_t cumulative = 0;

	for (unsigned i = 0; i < METRICS_LATENCY_BUCKETS; i++) {
		cumulative += h->buckets[i];
		/* %g spells these bounds as Go's client library does (strconv 'g': 1e-05,
		 * 0.0001, 2.5), so that queries by le match other exporters' series. */
		fprintf(f, "%s_bucket{%sle=\"%g\"} %" PRIu64 "\n", name, label,
		        (double)metrics_bucket_ns[i] / 1e9, cumulative);
	}
	cumulative += h->buckets[METRICS_LATENCY_BUCKETS];
	fprintf(f, "%s_bucket{%sle=\"+Inf\"} %" PRIu64 "\n", name, label, cumulative);
	/* Without labels, the sum and count have no braces at all. */
	if (*label)
		fprintf(f, "%s_sum{%.*s} ", name, (int)strlen(label) - 1, label);
	else
		fprintf(f, "%s_sum ", name);
	write_seconds(f, h->sum_ns);
	if (*label)
		fprintf(f, "\n%s_count{%.*s} %" PRIu64 "\n", name, (int)strlen(label) - 1, label, h->count);
	else
		fprintf(f, "\n%s_count %" PRIu64 "\n", name, h->count);
}

static void render_requests(FILE *f, const struct metrics *m) {
	family(f, "kvd_requests_total", "counter", "Requests handled, by type.");
	for (unsigned t = 0; t < _METRICS_REQUEST_MAX; t++)
		fprintf(f, "kvd_requests_total{type=\"%s\"} %" PRIu64 "\n", metrics_request_name(t),
		        m->requests[t].count);

	family(f, "kvd_request_duration_seconds", "histogram",
	       "Time the daemon took to handle a request, from decoded to reply queued, by type.");
	for (unsigned t = 0; t < _METRICS_REQUEST_MAX; t++) {
		char label[64];

		snprintf(label, sizeof(label), "type=\"%s\",", metrics_request_name(t));
		histogram(f, "kvd_request_duration_seconds", label, &m->requests[t]);
	}
}

static void render_rounds(FILE *f, const struct metrics *m) {
	family(f, "kvd_grant_wait_seconds", "histogram",
	       "Time grows the budget could not meet waited for eviction rounds, until granted "
	       "or refused (grant-wait).");
	histogram(f, "kvd_grant_wait_seconds", "", &m->grant_wait);
	family(f, "kvd_eviction_round_duration_seconds", "histogram",
	       "Duration of eviction rounds: scoring, selection and compaction.");
	histogram(f, "kvd_eviction_round_duration_seconds", "", &m->rounds);
	family(f, "kvd_eviction_phase_seconds_total", "counter",
	       "Time eviction rounds spent in each phase: score, select (with the summaries of "
	       "what is dropped) and compact (applying the round on the event loop).");
	for (unsigned i = 0; i < _METRICS_PHASE_MAX; i++) {
		fprintf(f, "kvd_eviction_phase_seconds_total{phase=\"%s\"} ", phase_names[i]);
		write_seconds(f, m->phase_ns[i]);
		fputc('\n', f);
	}
}

/* What is shown of each tenant, one family each. */
enum tenant_field {
	TENANT_USED,
	TENANT_BLOCK,
	TENANT_MIN,
	TENANT_MAX,
	TENANT_WEIGHT,
	TENANT_CHUNKS,
	TENANT_SEQUENCES,
	TENANT_CONNECTIONS,
	TENANT_TIER,
	TENANT_FILE_TIER,
	TENANT_TIER_DEGRADED,
	TENANT_PINNED,
	TENANT_SHARED,
	TENANT_CACHED,
	_TENANT_FIELD_MAX,
};

/* One per-tenant counter family, from the uint64_t at offset in struct tenant. */
static void tenant_counter(FILE *f, const struct tenant_table *tt, const char *name,
                           const char *help, size_t offset) {
	family(f, name, "counter", help);
	for (uint32_t i = 0; i < tt->n; i++) {
		uint64_t v;

		memcpy(&v, (const char *)tt->tenants[i] + offset, sizeof(v));
		fprintf(f, "%s{tenant=\"", name);
		prometheus_label_value(f, tt->tenants[i]->name);
		fprintf(f, "\"} %" PRIu64 "\n", v);
	}
}

static void render_tenants(FILE *f, const struct tenant_table *tt) {
	static const struct {
		const char *name, *help;
	} fields[_TENANT_FIELD_MAX] = {
		[TENANT_USED] = { "kvd_tenant_used_bytes",
		                  "Bytes of the chunks the tenant holds, draining ones included." },
		[TENANT_BLOCK] = { "kvd_tenant_block_bytes", "Bytes inside the tenant's granted blocks." },
		[TENANT_MIN] = { "kvd_tenant_min_bytes",
		                 "The tenant's guaranteed share: eviction never takes it below." },
		[TENANT_MAX] = { "kvd_tenant_max_bytes",
		                 "Cap on the tenant's used bytes; +Inf when it has none." },
		[TENANT_WEIGHT] = { "kvd_tenant_weight",
		                    "The tenant's weight: eviction values its tokens this many times." },
		[TENANT_CHUNKS] = { "kvd_tenant_chunks", "Chunks the tenant holds, draining ones included." },
		[TENANT_SEQUENCES] = { "kvd_tenant_sequences", "Sequences the tenant has open." },
		[TENANT_CONNECTIONS] = { "kvd_tenant_connections", "Connections open as the tenant." },
		[TENANT_TIER] = { "kvd_tenant_host_tier_bytes",
		                  "Bytes of the host tier the tenant's sequences moved out hold "
		                  "(outside the budget)." },
		[TENANT_FILE_TIER] = { "kvd_tenant_file_tier_bytes",
		                       "Bytes of the file tier the tenant's sequences hold (outside the "
		                       "budget)." },
		[TENANT_PINNED] = { "kvd_tenant_pinned_bytes",
		                    "Resident bytes of the tenant's pinned sequences: nothing a round "
		                    "can take." },
		[TENANT_SHARED] = { "kvd_tenant_shared_bytes",
		                    "Block bytes the tenant's sequences hold through forks and prefix "
		                    "opens without having taken them (each block counted once in "
		                    "kvd_tenant_block_bytes)." },
		[TENANT_CACHED] = { "kvd_tenant_cached_bytes",
		                    "Bytes of the tenant's blocks the prefix cache holds after their "
		                    "last sequence went." },
		[TENANT_TIER_DEGRADED] = { "kvd_tenant_tier_degraded",
		                           "1 when the file tier failed the tenant (an I/O error, a full "
		                           "disk): it drops until its tier is set again." },
	};

	/* A family without samples says nothing; the format allows it, scrapers skip it. */
	if (tt->n == 0)
		return;
	for (unsigned k = 0; k < _TENANT_FIELD_MAX; k++) {
		family(f, fields[k].name, "gauge", fields[k].help);
		for (uint32_t i = 0; i < tt->n; i++) {
			const struct tenant *t = tt->tenants[i];
			uint64_t v = 0;

			fprintf(f, "%s{tenant=\"", fields[k].name);
			prometheus_label_value(f, t->name);
			fputs("\"} ", f);
			switch (k) {
			case TENANT_USED:
				v = t->used_bytes;
				break;
			case TENANT_BLOCK:
				v = t->block_bytes;
				break;
			case TENANT_MIN:
				v = t->min_bytes;
				break;
			case TENANT_MAX:
				if (t->max_bytes == KVD_TENANT_NO_CAP) {
					fputs("+Inf\n", f);
					continue;
				}
				v = t->max_bytes;
				break;
			case TENANT_WEIGHT:
				v = t->weight;
				break;
			case TENANT_CHUNKS:
				v = t->chunks;
				break;
			case TENANT_SEQUENCES:
				v = t->sequences;
				break;
			case TENANT_CONNECTIONS:
				v = t->connections;
				break;
			case TENANT_TIER:
				v = t->tier_bytes;
				break;
			case TENANT_FILE_TIER:
				v = t->tier_file_bytes;
				break;
			case TENANT_TIER_DEGRADED:
				v = t->tier_degraded;
				break;
			case TENANT_PINNED:
				v = t->pinned_bytes;
				break;
			case TENANT_SHARED:
				v = t->shared_bytes;
				break;
			case TENANT_CACHED:
				v = t->cached_bytes;
				break;
			}
			fprintf(f, "%" PRIu64 "\n", v);
		}
	}
	/* The tenant's settings that are names, as labels of one series worth 1 (Prometheus'
	 * info pattern): on the other families they would start new series at every change. */
	family(f, "kvd_tenant_info", "gauge",
	       "1 per tenant, labelled with its eviction policy and its tier (drop, host, "
	       "host+file): join on tenant to break the other families down by them.");
	for (uint32_t i = 0; i < tt->n; i++) {
		const struct tenant *t = tt->tenants[i];

		fputs("kvd_tenant_info{tenant=\"", f);
		prometheus_label_value(f, t->name);
		fprintf(f, "\",policy=\"%s\",tier=\"%s\"} 1\n",
		        kvd_policy_to_string((enum kvd_policy)t->policy), tier_mode_to_string(t->tier));
	}
	tenant_counter(f, tt, "kvd_tenant_tier_lost_total",
	               "The tenant's sequences lost from the host tier (full, a failed checksum, "
	               "no memory for the recall): as if evicted whole.",
	               offsetof(struct tenant, tier_lost));
	tenant_counter(f, tt, "kvd_tenant_prefix_hits_total",
	               "The tenant's prefix opens that found blocks of their prompt to share.",
	               offsetof(struct tenant, prefix_hits));
	tenant_counter(f, tt, "kvd_tenant_prefix_misses_total",
	               "The tenant's prefix opens that found no block of their prompt.",
	               offsetof(struct tenant, prefix_misses));
	tenant_counter(f, tt, "kvd_tenant_prefix_tokens_total",
	               "Tokens the tenant's prefix opens found: prefill its engines skipped.",
	               offsetof(struct tenant, prefix_tokens));
	tenant_counter(f, tt, "kvd_tenant_pins_overdue_total",
	               "The tenant's sequences held pinned past pin-report.",
	               offsetof(struct tenant, pins_overdue));
	tenant_counter(f, tt, "kvd_tenant_evicted_bytes_total",
	               "Bytes of K/V eviction rounds took from the tenant.",
	               offsetof(struct tenant, evicted_bytes));
	tenant_counter(f, tt, "kvd_tenant_evicted_tokens_total",
	               "Token slots eviction rounds took from the tenant, summed over its tables.",
	               offsetof(struct tenant, evicted_tokens));
	tenant_counter(f, tt, "kvd_tenant_grants_total", "Chunks granted to the tenant.",
	               offsetof(struct tenant, grants));
	tenant_counter(f, tt, "kvd_tenant_grants_refused_total",
	               "Chunk grants refused to the tenant (budget, pool, its cap, errors).",
	               offsetof(struct tenant, grants_refused));
	tenant_counter(f, tt, "kvd_tenant_grants_waited_total",
	               "Grows of the tenant that waited for an eviction round, each counted once.",
	               offsetof(struct tenant, grants_waited));
}

int prometheus_render(struct server *s, char **ret, size_t *ret_size) {
	const struct pool *p = s->pool;
	uint32_t owned = p->n_chunks - p->chunks_free - p->chunks_draining - p->chunks_pinned;
	_cleanup_(freep) char *buf = NULL;
	size_t size = 0;
	bool failed;
	FILE *f;

	f = open_memstream(&buf, &size);
	if (!f)
		return -ENOMEM;

	family(f, "kvd_build_info", "gauge", "The daemon's version and memory backend; always 1.");
	fputs("kvd_build_info{version=\"", f);
	prometheus_label_value(f, KVD_VERSION);
	fputs("\",backend=\"", f);
	prometheus_label_value(f, p->ops->name);
	fputs("\"} 1\n", f);

	for (size_t i = 0; i < n_node_values; i++) {
		const struct node_value *v = &node_values[i];

		if (v->metric)
			(v->counter ? counter : gauge)(f, v->metric, v->help, v->read(s));
	}
	family(f, "kvd_chunks", "gauge",
	       "Chunks by state: free (in the pool), owned (held by a tenant), draining (empty, "
	       "still mapped by a client), pinned (no device memory for their new allocation, "
	       "charged to the tenant whose old one may still be held).");
	fprintf(f, "kvd_chunks{state=\"free\"} %" PRIu32 "\n", p->chunks_free);
	fprintf(f, "kvd_chunks{state=\"owned\"} %" PRIu32 "\n", owned);
	fprintf(f, "kvd_chunks{state=\"draining\"} %" PRIu32 "\n", p->chunks_draining);
	fprintf(f, "kvd_chunks{state=\"pinned\"} %" PRIu32 "\n", p->chunks_pinned);
	family(f, "kvd_device_free_chunks", "gauge",
	       "Free chunks of each pooled device (its number in PCI bus order, as --devices "
	       "says; 0 on host): a device whose chunks run out refuses grants there while the "
	       "budget may have room.");
	for (uint32_t i = 0; i < p->n_devices; i++) {
		const struct backend_device *dev = backend_device(i);

		fprintf(f, "kvd_device_free_chunks{device=\"%d\"} %" PRIu32 "\n", dev ? dev->index : 0,
		        pool_device_free_chunks(p, i));
	}
	family(f, "kvd_gpu_failed", "gauge",
	       "1 when the daemon lost its context on the device to a sticky error (status "
	       "devices says which): rounds no longer read or score K/V there; 0 on host.");
	for (uint32_t i = 0; i < p->n_devices; i++) {
		const struct backend_device *dev = backend_device(i);

		fprintf(f, "kvd_gpu_failed{device=\"%d\"} %d\n", dev ? dev->index : 0,
		        dev && __atomic_load_n(&dev->failed, __ATOMIC_RELAXED) != 0);
	}

	family(f, "kvd_grants_memory_total", "counter",
	       "Chunk grants by the memory they gave: own (the tenant's own freed memory object), "
	       "new (memory made for it), renewed (a new object in place of another tenant's).");
	fprintf(f, "kvd_grants_memory_total{memory=\"own\"} %" PRIu64 "\n", p->grants_own);
	fprintf(f, "kvd_grants_memory_total{memory=\"new\"} %" PRIu64 "\n",
	        p->grants - p->grants_own - p->grants_renewed);
	fprintf(f, "kvd_grants_memory_total{memory=\"renewed\"} %" PRIu64 "\n", p->grants_renewed);
	family(f, "kvd_grants_refused_total", "counter",
	       "Chunk grants refused, by reason: budget (node budget spent), pool (no free chunk), "
	       "tenant_max (the tenant's cap), error (backend or memory failure), pinned (no device "
	       "memory for a chunk renewed from another tenant, whose old allocation processes may "
	       "still hold).");
	for (unsigned i = 0; i < _POOL_REFUSED_MAX; i++)
		fprintf(f, "kvd_grants_refused_total{reason=\"%s\"} %" PRIu64 "\n", refusal_names[i],
		        p->refused[i]);

	family(f, "kvd_refused_total", "counter",
	       "Connections and requests refused at a limit, by limit (see kvd(8), LIMITS).");
	for (unsigned i = 0; i < _LIMIT_MAX; i++)
		fprintf(f, "kvd_refused_total{limit=\"%s\"} %" PRIu64 "\n", limit_to_string(i),
		        s->refused[i]);
	family(f, "kvd_eviction_last_round_seconds", "gauge",
	       "Duration of the last eviction round: scoring, selection and compaction.");
	fprintf(f, "kvd_eviction_last_round_seconds %.6f\n", evict_last_round_us(s->evictor) / 1e6);

	render_requests(f, &s->metrics);
	render_rounds(f, &s->metrics);
	render_tenants(f, &s->tenants);

	/* open_memstream only fails writes for want of memory. */
	failed = ferror(f);
	if (fclose(f) != 0 || failed)
		return -ENOMEM;
	*ret = TAKE_PTR(buf);
	*ret_size = size;
	return 0;
}

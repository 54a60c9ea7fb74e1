/* SPDX-License-Identifier: MIT */
#include <inttypes.h>

#include "log.h"
#include "registry.h"
#include "server.h"
#include "basic/time-util.h"

static const char *const limit_names[_LIMIT_MAX] = {
	[LIMIT_CONNECTIONS] = "connections",
	[LIMIT_CONNECTIONS_PER_UID] = "connections_per_uid",
	[LIMIT_TENANTS_PER_UID] = "tenants_per_uid",
	[LIMIT_TENANTS] = "tenants",
	[LIMIT_MODELS] = "models",
	[LIMIT_MODELS_PER_TENANT] = "models_per_tenant",
	[LIMIT_SEQS] = "seqs",
	[LIMIT_SEQS_PER_TENANT] = "seqs_per_tenant",
	[LIMIT_SEQS_NODE] = "seqs_node",
	[LIMIT_METADATA] = "metadata",
	[LIMIT_SEQ_TOKENS] = "seq_tokens",
	[LIMIT_DESCRIPTOR] = "descriptor",
	[LIMIT_FRAME] = "frame",
	[LIMIT_SEND_QUEUE] = "send_queue",
	[LIMIT_OUTSTANDING] = "outstanding",
	[LIMIT_OBSERVATION] = "observation",
	[LIMIT_UPLOADS] = "uploads",
	[LIMIT_EVICT_REQUESTS] = "evict_requests",
	[LIMIT_EVICT_RATE] = "evict_rate",
	[LIMIT_GRANT_WAITERS] = "grant_waiters",
	[LIMIT_RING_COMPLETIONS] = "ring_completions",
	[LIMIT_PINNED] = "pinned",
	[LIMIT_RING_DOORBELL] = "ring_doorbell",
	[LIMIT_UNMAP_TIMEOUT] = "unmap_timeout",
};

const char *limit_to_string(enum server_limit l) {
	return l < _LIMIT_MAX ? limit_names[l] : NULL;
}

void registry_forget_tenant(struct server *s, struct tenant *t, const char *why) {
	uint32_t n = pool_forget_tenant(s->pool, t);

	log_info("tenant %s forgotten: %s (the memory of its %" PRIu32 " free chunks destroyed)",
	         t->name, why, n);
	tenant_table_remove(&s->tenants, t);
}

uint32_t registry_conns_max(const struct server *s) {
	return MIN(s->limits.max_connections, s->conns_by_fds);
}

uint32_t registry_seqs_max(const struct server *s) {
	return s->limits.max_seqs_node ? s->limits.max_seqs_node : s->seqs_node_derived;
}

uint64_t registry_metadata_max(const struct server *s) {
	return s->limits.max_metadata_bytes ? s->limits.max_metadata_bytes : s->metadata_derived;
}

void registry_seq_opened(struct server *s, struct seq *q) {
	q->tenant->sequences++;
	if (q->model->unit != KVD_UNIT_NONE)
		s->evictable_seqs++;
	s->sequences++;
	s->metadata_bytes += q->meta_bytes;
	q->used_ms = now_ms();
}

void registry_seq_closed(struct server *s, struct seq *q) {
	q->tenant->sequences--;
	if (q->model->unit != KVD_UNIT_NONE)
		s->evictable_seqs--;
	s->sequences--;
	s->metadata_bytes -= q->meta_bytes;
}

struct conn *registry_conn(struct server *s, uint64_t id) {
	return idmap_get(&s->conn_ids, id);
}

struct seq *registry_seq(struct server *s, uint64_t conn_id, uint64_t seq_id) {
	struct seq *q = idmap_get(&s->seq_ids, seq_id);

	return q && q->conn_id == conn_id ? q : NULL;
}

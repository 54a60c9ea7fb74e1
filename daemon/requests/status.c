/* SPDX-License-Identifier: MIT */
/*
 * Status (node values, tenants, warnings) and the eviction history.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin.h"
#include "backend.h"
#include "config.h"
#include "envelope.h"
#include "evict.h"
#include "basic/macro.h"
#include "mover.h"
#include "node-values.h"
#include "policy.h"
#include "requests.h"
#include "server.h"
#include "settings.h"
#include "tier.h"
#include "warnings.h"

void handle_evictions(struct conn *c, uint64_t id, const Envelope *request _unused_,
                      int request_fd _unused_) {
	const struct evictor *e = c->srv->evictor;
	uint32_t n = evict_records(e), n_tenants = 0;
	Kvd__V1__EvictionsReply rep = KVD__V1__EVICTIONS_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) Kvd__V1__Round *rounds = NULL;
	_cleanup_(freep) Kvd__V1__Round **rp = NULL;
	_cleanup_(freep) Kvd__V1__RoundTenant *ts = NULL;
	_cleanup_(freep) Kvd__V1__RoundTenant **tp = NULL;

	for (uint32_t i = 0; i < n; i++)
		n_tenants += evict_record_at(e, i)->n_tenants;
	rounds = calloc(MAX(n, 1u), sizeof(*rounds));
	rp = calloc(MAX(n, 1u), sizeof(*rp));
	ts = calloc(MAX(n_tenants, 1u), sizeof(*ts));
	tp = calloc(MAX(n_tenants, 1u), sizeof(*tp));
	if (!rounds || !rp || !ts || !tp) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	n_tenants = 0;
	for (uint32_t i = 0; i < n; i++) {
		const struct evict_record *rec = evict_record_at(e, i);

		round_message(rec, &rounds[i], ts + n_tenants, tp + n_tenants);
		n_tenants += rec->n_tenants;
		rp[i] = &rounds[i];
	}
	rep.n_rounds = n;
	rep.rounds = rp;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICTIONS_REPLY;
	env.evictions_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

void handle_status(struct conn *c, uint64_t id, const Envelope *request _unused_,
                   int request_fd _unused_) {
	struct server *s = c->srv;
	struct pool *p = s->pool;
	Kvd__V1__StatusReply rep = KVD__V1__STATUS_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	uint32_t n = s->tenants.n;
	_cleanup_(freep) Kvd__V1__TenantStatus *ts = calloc(MAX(n, 1u), sizeof(*ts));
	_cleanup_(freep) Kvd__V1__TenantStatus **tp = calloc(MAX(n, 1u), sizeof(*tp));
	Kvd__V1__Counter refused[_LIMIT_MAX], *refused_ptrs[_LIMIT_MAX];
	/* A line of at most ~300 bytes per GPU. */
	char devices[BACKEND_DEVICES_MAX * 320];

	if (!ts || !tp) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	rep.daemon_version = (char *)KVD_VERSION;
	rep.last_reload_error = s->last_reload_error;
	rep.backend = (char *)p->ops->name;
	node_values_status(s, &rep);
	for (unsigned i = 0; i < _LIMIT_MAX; i++) {
		kvd__v1__counter__init(&refused[i]);
		refused[i].name = (char *)limit_to_string(i);
		refused[i].has_value = true;
		refused[i].value = s->refused[i];
		refused_ptrs[i] = &refused[i];
	}
	rep.n_refused = _LIMIT_MAX;
	rep.refused = refused_ptrs;
	rep.budget_source = (char *)admin_budget_source(s->admin);
	rep.state_error = (char *)admin_state_error(s->admin);
	/* What tenants hold changes without any setting changing: look again. */
	warnings_update(s);
	rep.warnings = (char *)warnings_text(s);
	backend_devices_text(devices, sizeof(devices));
	if (devices[0])
		rep.devices = devices;
	for (uint32_t i = 0; i < n; i++) {
		const struct tenant *t = s->tenants.tenants[i];

		kvd__v1__tenant_status__init(&ts[i]);
		ts[i].name = (char *)t->name;
		ts[i].has_used_bytes = ts[i].has_block_bytes = ts[i].has_min_bytes = true;
		ts[i].has_max_bytes = ts[i].has_weight = ts[i].has_sequences = true;
		ts[i].has_connections = ts[i].has_chunks = true;
		ts[i].used_bytes = t->used_bytes;
		ts[i].block_bytes = t->block_bytes;
		ts[i].min_bytes = t->min_bytes;
		ts[i].max_bytes = t->max_bytes;
		ts[i].weight = t->weight;
		ts[i].sequences = t->sequences;
		ts[i].connections = t->connections;
		ts[i].chunks = t->chunks;
		ts[i].min_source = (char *)setting_source_to_string(t->min_source);
		ts[i].max_source = (char *)setting_source_to_string(t->max_source);
		ts[i].weight_source = (char *)setting_source_to_string(t->weight_source);
		ts[i].policy_source = (char *)setting_source_to_string(t->policy_source);
		ts[i].policy = (char *)kvd_policy_to_string(t->policy);
		ts[i].has_evicted_bytes = ts[i].has_evicted_tokens = ts[i].has_rounds = true;
		ts[i].evicted_bytes = t->evicted_bytes;
		ts[i].evicted_tokens = t->evicted_tokens;
		ts[i].rounds = t->rounds;
		ts[i].has_grants = ts[i].has_grants_refused = ts[i].has_grants_waited = true;
		ts[i].grants = t->grants;
		ts[i].grants_refused = t->grants_refused;
		ts[i].grants_waited = t->grants_waited;
		ts[i].tier = (char *)tier_mode_to_string(t->tier);
		ts[i].tier_source = (char *)setting_source_to_string(t->tier_source);
		ts[i].has_tier_bytes = ts[i].has_tier_sequences = ts[i].has_tier_lost = true;
		ts[i].has_tier_file_bytes = ts[i].has_tier_degraded = true;
		ts[i].tier_file_bytes = t->tier_file_bytes;
		ts[i].tier_degraded = t->tier_degraded;
		ts[i].tier_bytes = t->tier_bytes;
		ts[i].tier_sequences = t->tier_seqs;
		ts[i].tier_lost = t->tier_lost;
		ts[i].has_recall = ts[i].has_recalled_tokens = true;
		ts[i].recall = t->recall;
		ts[i].recall_source = (char *)setting_source_to_string(t->recall_source);
		ts[i].recalled_tokens = t->recalled_tokens;
		ts[i].has_pinned_bytes = ts[i].has_pins_overdue = true;
		ts[i].pinned_bytes = t->pinned_bytes;
		ts[i].pins_overdue = t->pins_overdue;
		ts[i].has_shared_bytes = ts[i].has_prefix_hits = true;
		ts[i].has_prefix_misses = ts[i].has_prefix_tokens = true;
		ts[i].shared_bytes = t->shared_bytes;
		ts[i].prefix_hits = t->prefix_hits;
		ts[i].prefix_misses = t->prefix_misses;
		ts[i].prefix_tokens = t->prefix_tokens;
		ts[i].has_cached_bytes = true;
		ts[i].cached_bytes = t->cached_bytes;
		tp[i] = &ts[i];
	}
	rep.n_tenants = n;
	rep.tenants = tp;
	env.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REPLY;
	env.status_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "access.h"
#include "admin.h"
#include "basic/macro.h"
#include "basic/size.h"
#include "basic/time-util.h"
#include "conn.h"
#include "evict.h"
#include "log.h"
#include "policy.h"
#include "recall.h"
#include "server.h"
#include "tier.h"

/* The eviction settings, all of which change on a reload. */
static void admin_eviction_limits(const struct settings *s, struct server_limits *ret) {
	ret->high_watermark = s->high_watermark;
	ret->low_watermark = s->low_watermark;
	ret->eviction_floor = s->eviction_floor;
	ret->round_threads = s->round_threads;
	ret->grant_wait_ms = s->grant_wait_ms;
	ret->round_interval_ms = s->round_interval_ms;
	ret->max_observation_bytes = s->max_observation_bytes;
	ret->tier_idle_ms = s->tier_idle_ms;
	ret->recall_policy = settings_recall_policy(s);
}

void admin_limits(const struct settings *s, struct server_limits *ret) {
	*ret = (struct server_limits){
		.max_connections = s->max_connections,
		.max_connections_per_uid = s->max_connections_per_uid,
		.max_tenants = s->max_tenants,
		.max_tenants_per_uid = s->max_tenants_per_uid,
		.max_models = s->max_models,
		.max_models_per_tenant = s->max_models_per_tenant,
		.max_outstanding = s->max_outstanding,
		.max_seqs = s->max_seqs,
		.max_seqs_per_tenant = s->max_seqs_per_tenant,
		.max_seqs_node = s->max_seqs_node,
		.max_metadata_bytes = s->max_metadata_bytes,
		.max_seq_tokens = s->max_seq_tokens,
		.max_descriptor_bytes = UINT64_C(64) << 20,
		.hello_timeout_ms = s->hello_timeout_ms,
		.unmap_timeout_ms = s->unmap_timeout_ms,
		.unmap_grace_ms = s->unmap_grace_ms,
		.max_pinned_percent = s->max_pinned_percent,
		.max_cached_percent = s->max_cached_percent,
		.tier_max_percent = s->tier_max_percent,
		.pin_report_ms = s->pin_report_ms,
		.pin_timeout_ms = s->pin_timeout_ms,
		.tenant_forget_ms = s->tenant_forget_ms,
		.max_tx_bytes = UINT64_C(4) << 20,
		.max_violations = 8,
		.metrics_listen = s->metrics_listen,
		.kv_events = s->kv_events,
		.kv_events_replay = s->kv_events_replay,
		.kv_events_topic = s->kv_events_topic,
		.metrics_remote = s->metrics_remote == SETTINGS_YES,
		.socket_group = s->socket_group,
		.ring_entries = s->ring_entries,
		.ring_doorbell = s->ring_doorbell,
		.uring_setup = s->uring_setup,
		.poll_us = s->poll_us,
		.host_tier_bytes = s->host_tier_size,
		.file_tier_bytes = s->file_tier_size,
		.file_tier_dir = s->file_tier_dir,
	};
	admin_eviction_limits(s, ret);
}

static const char *config_name(const struct admin *a) {
	return a->cfg.path ? a->cfg.path : "the config file";
}

/* ---- merging ---- */

static void apply_budget(struct admin *a) {
	struct pool *p = a->srv->pool;
	int i = settings_index("budget");
	uint64_t budget;

	if (a->state->has_budget) {
		budget = a->state->budget;
		a->budget_source = SOURCE_LIVE;
	} else {
		budget = settings_budget(&a->cfg, p->pool_bytes);
		a->budget_source = a->cfg.source[i];
	}
	/* Both were checked against the pool: when loaded, set or reloaded. */
	if (pool_set_budget(p, MIN(budget, p->pool_bytes)) < 0)
		log_error("budget %" PRIu64 " above the pool, ignoring", budget);
}

static int strdup_or_null(char **dst, const char *src) {
	char *copy = NULL;

	if (src && !(copy = strdup(src)))
		return -ENOMEM;
	free(*dst);
	*dst = copy;
	return 0;
}

/* A tenant whose recall is off keeps nothing: its sequences' kept tokens go back to the host
 * tier (a recall running holds its sequence's until it ends, and drops them then). */
static void drop_kept(struct server *s, const struct tenant *t) {
	for (struct conn *c = s->conns; c; c = c->next)
		for (struct seq *q = c->tenant == t ? c->seqs : NULL; q; q = q->next)
			q->kept = recall_store_free(s->tier, q->kept);
}

/* Sets t's values from the live state, the config file or the defaults; with changes, logs
 * what changed. */
static void apply_tenant(struct admin *a, struct tenant *t, bool changes) {
	const struct settings_tenant *ct = settings_tenant_find(&a->cfg, t->name);
	const struct state_tenant *lt = state_tenant_find(a->state, t->name);
	uint64_t min = 0, max = KVD_TENANT_NO_CAP;
	uint32_t weight = 1;
	int policy = KVD_POLICY_KVD, tier = TIER_DROP;
	uint32_t recall = 0;
	uint8_t min_source = SOURCE_DEFAULT, max_source = SOURCE_DEFAULT,
	        weight_source = SOURCE_DEFAULT, policy_source = SOURCE_DEFAULT,
	        tier_source = SOURCE_DEFAULT, recall_source = SOURCE_DEFAULT;

	if (lt && lt->has_min)
		min = lt->min_bytes, min_source = SOURCE_LIVE;
	else if (ct && ct->source[SETTINGS_TENANT_MIN] == SOURCE_CONFIG)
		min = ct->min_bytes, min_source = SOURCE_CONFIG;
	if (lt && lt->has_max)
		max = lt->max_bytes, max_source = SOURCE_LIVE;
	else if (ct && ct->source[SETTINGS_TENANT_MAX] == SOURCE_CONFIG)
		max = ct->max_bytes, max_source = SOURCE_CONFIG;
	if (lt && lt->has_weight)
		weight = lt->weight, weight_source = SOURCE_LIVE;
	else if (ct && ct->source[SETTINGS_TENANT_WEIGHT] == SOURCE_CONFIG)
		weight = ct->weight, weight_source = SOURCE_CONFIG;
	if (lt && lt->has_policy)
		policy = lt->policy, policy_source = SOURCE_LIVE;
	else if (ct && ct->source[SETTINGS_TENANT_POLICY] == SOURCE_CONFIG)
		policy = ct->policy, policy_source = SOURCE_CONFIG;
	if (lt && lt->has_tier)
		tier = lt->tier, tier_source = SOURCE_LIVE;
	else if (ct && ct->source[SETTINGS_TENANT_TIER] == SOURCE_CONFIG)
		tier = ct->tier, tier_source = SOURCE_CONFIG;
	if (lt && lt->has_recall)
		recall = lt->recall, recall_source = SOURCE_LIVE;
	else if (ct && ct->source[SETTINGS_TENANT_RECALL] == SOURCE_CONFIG)
		recall = ct->recall, recall_source = SOURCE_CONFIG;

	if (changes && (min != t->min_bytes || max != t->max_bytes || weight != t->weight ||
	                policy != t->policy || tier != t->tier || recall != t->recall)) {
		char old_min[32], old_max[32], new_min[32], new_max[32];

		size_format(t->min_bytes, old_min, sizeof(old_min));
		size_format(min, new_min, sizeof(new_min));
		tenant_format_max(t->max_bytes, old_max, sizeof(old_max));
		tenant_format_max(max, new_max, sizeof(new_max));
		log_notice("tenant %s: min %s, max %s, weight %" PRIu32 ", policy %s, tier %s, recall "
		           "%" PRIu32 " (was %s, %s, %" PRIu32 ", %s, %s, %" PRIu32 ")", t->name, new_min,
		           new_max, weight, kvd_policy_to_string(policy), tier_mode_to_string(tier),
		           recall, old_min, old_max, t->weight, kvd_policy_to_string(t->policy),
		           tier_mode_to_string(t->tier), t->recall);
	}
	/* A live min above a max from the file is possible (the file changed under it): the
	 * cap holds, and nothing acts on the min yet. */
	if (changes && min > max)
		log_warning("tenant %s: min (%s) above max (%s)", t->name,
		            setting_source_to_string(min_source), setting_source_to_string(max_source));
	t->min_bytes = min;
	t->max_bytes = max;
	t->weight = weight;
	t->policy = policy;
	t->tier = tier;
	t->tier_source = tier_source;
	if (recall == 0 && t->recall > 0)
		drop_kept(a->srv, t);
	t->recall = recall;
	t->recall_source = recall_source;
	t->min_source = min_source;
	t->max_source = max_source;
	t->weight_source = weight_source;
	t->policy_source = policy_source;
	if (strdup_or_null(&t->allow_users, ct ? ct->allow_users : NULL) < 0 ||
	    strdup_or_null(&t->allow_groups, ct ? ct->allow_groups : NULL) < 0)
		log_error("tenant %s: out of memory copying allow-users/allow-groups, ignoring",
		          t->name);
}

static void apply_tenants(struct admin *a, bool changes) {
	struct tenant_table *tt = &a->srv->tenants;

	for (uint32_t i = 0; i < tt->n; i++)
		apply_tenant(a, tt->tenants[i], changes);
}

/* Saves the live state: 0, or 1 (logged, and said in why) when it could not be written. */
static int save(struct admin *a, char *why, size_t why_n) {
	if (state_save(a->state) >= 0)
		return 0;
	log_warning("%s; the change applies but will not survive a restart", a->state->error);
	if (why)
		snprintf(why, why_n, "applied, but not saved: %s; it will not survive a restart",
		         a->state->error);
	return 1;
}

/* ---- start ---- */

/* Drops live values that the settings this daemon started with rule out. */
static bool state_prune(struct admin *a) {
	uint64_t pool = a->srv->pool->pool_bytes;
	struct state *st = a->state;
	bool dirty = false;
	char v[32], b[32];

	if (st->has_budget && a->cfg.source[settings_index("budget")] == SOURCE_FLAG) {
		log_notice("--budget overrides the live budget %s kept in %s; dropping it",
		           size_format(st->budget, v, sizeof(v)), st->path);
		st->has_budget = false;
		dirty = true;
	} else if (st->has_budget && st->budget > pool) {
		log_warning("the live budget %s kept in %s is above the pool (%s); dropping it",
		            size_format(st->budget, v, sizeof(v)), st->path,
		            size_format(pool, b, sizeof(b)));
		st->has_budget = false;
		dirty = true;
	}
	for (uint32_t i = 0; i < st->n_tenants; i++) {
		struct state_tenant *t = &st->tenants[i];

		if (t->has_min && t->min_bytes > pool) {
			log_warning("tenant %s: the live min %s kept in %s is above the pool; dropping it",
			            t->name, size_format(t->min_bytes, v, sizeof(v)), st->path);
			t->has_min = false;
			dirty = true;
		}
	}
	return dirty;
}

int admin_new(struct server *s, struct settings *cfg, const struct settings *flags,
              struct admin **ret) {
	struct inifile_errors e = {};
	struct admin *a;
	bool dirty;
	int r;

	a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->srv = s;
	a->flags = flags;
	a->cfg = *cfg;
	*cfg = (struct settings){};
	access_resolve(&a->cfg);
	r = state_new(a->cfg.state_dir, a->cfg.max_tenants, &a->state);
	if (r < 0)
		goto fail;
	r = state_load(a->state, &e);
	for (unsigned i = 0; i < e.n; i++)
		log_warning("%s, ignoring", e.msg[i]);
	if (e.dropped)
		log_warning("%u more errors in %s, ignoring", e.dropped, a->state->path);
	inifile_errors_done(&e);
	if (r < 0)
		goto fail;
	dirty = state_prune(a);

	/* The config file's tenants fit: settings_check() held them to max-tenants. */
	for (uint32_t i = 0; i < a->cfg.n_tenants; i++) {
		struct tenant *t;

		r = tenant_get(&s->tenants, a->cfg.tenants[i].name, &t);
		if (r < 0) {
			log_error_errno(r, "cannot add tenant %s", a->cfg.tenants[i].name);
			goto fail;
		}
	}
	for (uint32_t i = 0; i < a->state->n_tenants;) {
		const char *name = a->state->tenants[i].name;
		struct tenant *t;

		if (tenant_get(&s->tenants, name, &t) >= 0) {
			i++;
			continue;
		}
		log_warning("tenant %s kept in %s does not fit in max-tenants (%" PRIu32 "); dropping "
		            "its live values", name, a->state->path, a->cfg.max_tenants);
		state_tenant_remove(a->state, name);
		dirty = true;
	}
	apply_budget(a);
	apply_tenants(a, false);
	warnings_update(s);
	if (dirty)
		save(a, NULL, 0);
	log_info("%s %s: %" PRIu32 " tenants; live settings in %s: %s budget, %" PRIu32 " tenants",
	         a->cfg.path ? "config" : "no config file", a->cfg.path ? a->cfg.path : a->cfg.config,
	         a->cfg.n_tenants, a->state->path, a->state->has_budget ? "a" : "no",
	         a->state->n_tenants);
	*ret = a;
	return 0;
fail:
	admin_free(a);
	return r;
}

struct admin *admin_free(struct admin *a) {
	if (!a)
		return NULL;
	settings_done(&a->cfg);
	state_free(a->state);
	free(a);
	return NULL;
}

/* ---- reload ---- */

/* After a reload: a tenant value edited in the file that a live value still shadows gets
 * said, or the edit would seem to do nothing. old: the settings before the reload. */
static void log_shadowed(struct admin *a, const struct settings *old) {
	for (uint32_t i = 0; i < a->cfg.n_tenants; i++) {
		const struct settings_tenant *ct = &a->cfg.tenants[i];
		const struct settings_tenant *was = settings_tenant_find(old, ct->name);
		const struct state_tenant *lt = state_tenant_find(a->state, ct->name);
		const struct {
			const char *key;
			unsigned index;
			bool live;
			uint64_t now, before;
		} f[] = {
			{ "min", SETTINGS_TENANT_MIN, lt && lt->has_min, ct->min_bytes,
			  was ? was->min_bytes : 0 },
			{ "max", SETTINGS_TENANT_MAX, lt && lt->has_max, ct->max_bytes,
			  was ? was->max_bytes : 0 },
			{ "weight", SETTINGS_TENANT_WEIGHT, lt && lt->has_weight, ct->weight,
			  was ? was->weight : 0 },
			{ "policy", SETTINGS_TENANT_POLICY, lt && lt->has_policy, (uint64_t)ct->policy,
			  was ? (uint64_t)was->policy : 0 },
			{ "tier", SETTINGS_TENANT_TIER, lt && lt->has_tier, (uint64_t)ct->tier,
			  was ? (uint64_t)was->tier : 0 },
			{ "recall", SETTINGS_TENANT_RECALL, lt && lt->has_recall, ct->recall,
			  was ? was->recall : 0 },
		};

		for (size_t k = 0; k < ELEMENTSOF(f); k++) {
			bool set_now = ct->source[f[k].index] == SOURCE_CONFIG;
			bool set_before = was && was->source[f[k].index] == SOURCE_CONFIG;

			if (f[k].live && (set_now != set_before || (set_now && f[k].now != f[k].before)))
				log_notice("%s: tenant %s: %s changed in the file, but the live value set "
				           "with kvdctl stays until kvdctl tenant reset %s", config_name(a),
				           ct->name, f[k].key, ct->name);
		}
	}
}

/* Logs a failed reload's errors, and puts them in why: the count, then as many as fit. */
static void log_errors(struct inifile_errors *e, const char *path, char *why, size_t why_n) {
	size_t k;

	for (unsigned i = 0; i < e->n; i++)
		log_error("%s", e->msg[i]);
	if (e->dropped)
		log_error("%u more errors", e->dropped);
	log_error("reload failed: %u error%s in %s; the running settings stay",
	          inifile_errors_count(e), inifile_errors_count(e) == 1 ? "" : "s", path);
	k = (size_t)snprintf(why, why_n, "reload failed: %u error%s in %s; the running settings "
	                     "stay", inifile_errors_count(e), inifile_errors_count(e) == 1 ? "" : "s",
	                     path);
	for (unsigned i = 0; i < e->n && k < why_n; i++)
		k += (size_t)snprintf(why + k, why_n - k, "\n%s", e->msg[i]);
}

/* A reload's result, for status and metrics. */
static int reload_done(struct admin *a, int r, const char *why) {
	struct server *s = a->srv;

	s->reloads++;
	s->last_reload_ms = now_ms() - s->start_ms;
	s->last_reload_failed = r < 0;
	if (r < 0) {
		s->reload_failures++;
		/* The first line: the count and the file. */
		snprintf(s->last_reload_error, sizeof(s->last_reload_error), "%.*s",
		         (int)strcspn(why, "\n"), why);
	} else
		s->last_reload_error[0] = '\0';
	return r;
}

int admin_reload(struct admin *a, const char *by, char *why, size_t why_n) {
	struct server *s = a->srv;
	struct inifile_errors e = {};
	struct settings next, old;
	uint32_t new_tenants = 0;
	size_t n;
	const struct setting *table = settings_table(&n);
	char was[512], now[512];
	int r;

	why[0] = '\0';
	log_info("%s: reloading %s", by, a->cfg.path ? a->cfg.path : a->cfg.config);
	r = settings_init(&next);
	if (r >= 0)
		r = settings_load(&next, a->flags, NULL, &e);
	if (r == -ENOMEM) {
		log_error("reload failed: out of memory; the running settings stay");
		snprintf(why, why_n, "reload failed: out of memory; the running settings stay");
		goto done;
	}
	if (r < 0) {
		log_errors(&e, next.path ? next.path : a->cfg.config, why, why_n);
		r = -EINVAL;
		goto done;
	}

	/* What was sized or bound at start keeps its running value (and its pointers, which
	 * the server holds: the socket path, the metrics address). */
	for (size_t i = 0; i < n; i++) {
		if (table[i].flags & SETTING_RUNTIME)
			continue;
		if (!(table[i].flags & SETTING_FLAG_ONLY) && !settings_equal(&next, &a->cfg, i)) {
			settings_format(&a->cfg, i, was, sizeof(was));
			settings_format(&next, i, now, sizeof(now));
			log_warning("%s: %s changed from %s to %s; it needs a restart, ignoring",
			            next.path ? next.path : "defaults", table[i].name, was, now);
		}
		settings_swap(&next, &a->cfg, i);
	}
	/* The file may be fine for a fresh start and still not fit what runs (a budget or a
	 * tenant's min above the running pool): checked against that pool, as a start checks
	 * against the one it makes. */
	settings_check(&next, &e);
	settings_check_pool(&next, 0, s->pool->pool_bytes, &e);
	for (uint32_t i = 0; i < next.n_tenants; i++)
		if (!tenant_find(&s->tenants, next.tenants[i].name))
			new_tenants++;
	if (new_tenants > s->tenants.max - s->tenants.n)
		inifile_error(&e, next.path ? next.path : "kvd", 0,
		              "%" PRIu32 " new tenants do not fit: %" PRIu32 " of max-tenants (%" PRIu32
		              ") are known", new_tenants, s->tenants.n, s->tenants.max);
	if (inifile_errors_count(&e) > 0) {
		/* Give the running values back before the rest goes. */
		for (size_t i = 0; i < n; i++)
			if (!(table[i].flags & SETTING_RUNTIME))
				settings_swap(&next, &a->cfg, i);
		log_errors(&e, next.path ? next.path : "the config file", why, why_n);
		r = -EINVAL;
		goto done;
	}

	old = a->cfg;
	a->cfg = next;
	next = (struct settings){};
	access_resolve(&a->cfg);
	for (size_t i = 0; i < n; i++)
		if ((table[i].flags & SETTING_RUNTIME) && !settings_equal(&old, &a->cfg, i)) {
			settings_format(&old, i, was, sizeof(was));
			settings_format(&a->cfg, i, now, sizeof(now));
			log_notice("%s: %s %s (was %s)%s", config_name(a), table[i].name, now, was,
			           i == (size_t)settings_index("budget") && a->state->has_budget ?
			           "; the live budget stays until kvdctl budget reset" : "");
		}
	s->limits.max_connections = a->cfg.max_connections;
	s->limits.max_connections_per_uid = a->cfg.max_connections_per_uid;
	s->limits.max_tenants_per_uid = a->cfg.max_tenants_per_uid;
	s->limits.max_seqs = a->cfg.max_seqs;
	s->limits.max_models_per_tenant = a->cfg.max_models_per_tenant;
	s->limits.max_outstanding = a->cfg.max_outstanding;
	s->limits.max_seqs_per_tenant = a->cfg.max_seqs_per_tenant;
	s->limits.max_seqs_node = a->cfg.max_seqs_node;
	s->limits.max_metadata_bytes = a->cfg.max_metadata_bytes;
	s->limits.max_seq_tokens = a->cfg.max_seq_tokens;
	/* Checked on the tick, which follows them (server.c, tick_interval()). */
	s->limits.hello_timeout_ms = a->cfg.hello_timeout_ms;
	s->limits.unmap_timeout_ms = a->cfg.unmap_timeout_ms;
	s->limits.unmap_grace_ms = a->cfg.unmap_grace_ms;
	s->limits.max_pinned_percent = a->cfg.max_pinned_percent;
	s->limits.max_cached_percent = a->cfg.max_cached_percent;
	s->prefix.max_percent = a->cfg.max_cached_percent;
	s->limits.tier_max_percent = a->cfg.tier_max_percent;
	s->limits.pin_report_ms = a->cfg.pin_report_ms;
	s->limits.pin_timeout_ms = a->cfg.pin_timeout_ms;
	s->limits.tenant_forget_ms = a->cfg.tenant_forget_ms;
	admin_eviction_limits(&a->cfg, &s->limits);
	log_set_max_level(a->cfg.log_level);
	apply_budget(a);
	for (uint32_t i = 0; i < a->cfg.n_tenants; i++) {
		struct tenant *t;

		/* Room was checked above. */
		if (tenant_get(&s->tenants, a->cfg.tenants[i].name, &t) < 0)
			log_error("cannot add tenant %s, ignoring", a->cfg.tenants[i].name);
	}
	apply_tenants(a, true);
	log_shadowed(a, &old);
	warnings_update(s);
	settings_done(&old);
	log_notice("reloaded %s: budget %s (%s), %" PRIu32 " tenants in the file",
	           config_name(a), size_format(s->pool->budget_bytes, now, sizeof(now)),
	           admin_budget_source(a), a->cfg.n_tenants);
	r = 0;
done:
	settings_done(&next);
	inifile_errors_done(&e);
	return reload_done(a, r, why);
}

/* ---- live changes ---- */

int admin_budget_set(struct admin *a, uint64_t bytes, char *why, size_t why_n) {
	if (bytes > a->srv->pool->pool_bytes) {
		snprintf(why, why_n, "the budget must be at most the pool (%" PRIu64 " bytes)",
		         a->srv->pool->pool_bytes);
		return -EINVAL;
	}
	a->state->has_budget = true;
	a->state->budget = bytes;
	apply_budget(a);
	warnings_update(a->srv);
	return save(a, why, why_n);
}

int admin_budget_reset(struct admin *a, char *why, size_t why_n) {
	a->state->has_budget = false;
	apply_budget(a);
	warnings_update(a->srv);
	return save(a, why, why_n);
}

int admin_tenant_set(struct admin *a, struct tenant *t, const struct state_tenant *change,
                     char *why, size_t why_n) {
	struct state_tenant *lt;
	int r;

	r = state_tenant_get(a->state, t->name, &lt);
	if (r < 0) {
		snprintf(why, why_n, "cannot record the change: %s", strerror(-r));
		return r;
	}
	if (change->has_min) {
		lt->has_min = true;
		lt->min_bytes = change->min_bytes;
	}
	if (change->has_max) {
		lt->has_max = true;
		lt->max_bytes = change->max_bytes;
	}
	if (change->has_weight) {
		lt->has_weight = true;
		lt->weight = change->weight;
	}
	if (change->has_policy) {
		lt->has_policy = true;
		lt->policy = change->policy;
	}
	if (change->has_tier) {
		lt->has_tier = true;
		lt->tier = change->tier;
	}
	if (change->has_recall) {
		lt->has_recall = true;
		lt->recall = change->recall;
	}
	apply_tenant(a, t, false);
	warnings_update(a->srv);
	return save(a, why, why_n);
}

int admin_tenant_reset(struct admin *a, const char *name, char *why, size_t why_n) {
	struct tenant *t = tenant_find(&a->srv->tenants, name);

	if (!t) {
		snprintf(why, why_n, "no tenant %s", name);
		return -ENOENT;
	}
	state_tenant_remove(a->state, name);
	apply_tenant(a, t, false);
	warnings_update(a->srv);
	return save(a, why, why_n);
}

int admin_tenant_delete(struct admin *a, const char *name, char *why, size_t why_n) {
	struct tenant *t = tenant_find(&a->srv->tenants, name);

	if (!t) {
		snprintf(why, why_n, "no tenant %s", name);
		return -ENOENT;
	}
	/* Its prefix cache goes with it; its chunks then drain as any tenant's. */
	if (t->connections == 0 && t->sequences == 0)
		evict_shed_cache(a->srv, t, UINT64_MAX);
	if (!tenant_holds_nothing(t)) {
		snprintf(why, why_n, "tenant %s holds %u connections, %u sequences, %u chunks", name,
		         t->connections, t->sequences, t->chunks);
		return -EBUSY;
	}
	if (settings_tenant_find(&a->cfg, name)) {
		snprintf(why, why_n, "tenant %s is declared in the config file: remove it there and "
		         "reload", name);
		return -EBUSY;
	}
	registry_forget_tenant(a->srv, t, "deleted");
	if (!state_tenant_remove(a->state, name))
		return 0;
	return save(a, why, why_n);
}

const char *admin_budget_source(const struct admin *a) {
	return setting_source_to_string(a->budget_source);
}

bool admin_tenant_declared(const struct admin *a, const char *name) {
	return settings_tenant_find(&a->cfg, name) || state_tenant_find(a->state, name);
}

const char *admin_state_error(const struct admin *a) {
	return a->state->error[0] ? a->state->error : NULL;
}

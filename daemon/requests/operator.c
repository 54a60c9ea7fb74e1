/* SPDX-License-Identifier: MIT */
/*
 * An operator's live changes (kvdctl budget, tenant set, reset, delete): checked, applied
 * through admin.h, and answered with whether they were saved; reloads, and the settings
 * the daemon runs with (kvdctl config).
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "access.h"
#include "admin.h"
#include "basic/size.h"
#include "config.h"
#include "conn.h"
#include "envelope.h"
#include "evict.h"
#include "log.h"
#include "basic/macro.h"
#include "mover.h"
#include "policy.h"
#include "requests.h"
#include "server.h"
#include "tenant.h"
#include "tier.h"

/* Answers a live change (admin.h): a reply with code 0 and a message when it applies but
 * was not saved, so that the operator learns it will not survive a restart. */
static void reply_live(struct conn *c, uint64_t id, int r, const char *why) {
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	if (r == 0) {
		envelope_reply(c, id, &env, NULL, 0);
		return;
	}
	r = envelope_reply_status(c, id, 0, why);
	if (r < 0 && r != -ENOBUFS && !c->closing)
		conn_close(c, "cannot queue a reply");
}

/*
 * The budget a BudgetSet asks for, in bytes (a percent is of the whole pool, every device's
 * together), checked against the pool and, without force, the floor: the tenants'
 * guaranteed minimums together, and at least one chunk, below which the guarantees cannot
 * hold or nothing can be granted. Returns 0, or -EINVAL, -ERANGE with why.
 */
int budget_change(const struct server *s, const Kvd__V1__BudgetSet *req, uint64_t *ret,
                  char why[static WHY_MAX]) {
	const struct pool *p = s->pool;
	uint64_t bytes, mins = 0, floor;
	char a[32], b[32];

	if (req->has_percent && (req->percent < 1 || req->percent > 100))
		return refuse(why, -EINVAL, "a budget in percent is 1..100 of the pool");
	if (req->has_percent == req->has_bytes)
		return refuse(why, -EINVAL, "a budget in bytes or in percent of the pool, one of them");
	bytes = req->has_percent ? p->pool_bytes / 100 * req->percent +
	                           p->pool_bytes % 100 * req->percent / 100 : req->bytes;
	if (bytes > p->pool_bytes)
		return refuse(why, -EINVAL, "the budget must be at most the pool (%s)",
		              size_format(p->pool_bytes, a, sizeof(a)));
	for (uint32_t i = 0; i < s->tenants.n; i++)
		mins += s->tenants.tenants[i]->min_bytes;
	floor = MAX(mins, p->chunk_bytes);
	if (bytes < floor && !(req->has_force && req->force))
		return refuse(why, -ERANGE, "%s is below the floor of %s (%s); force it to set it "
		              "anyway", size_format(bytes, a, sizeof(a)), size_format(floor, b, sizeof(b)),
		              mins > p->chunk_bytes ? "the tenants' guaranteed minimums together" :
		                                      "one chunk: nothing could be granted");
	*ret = bytes;
	return 0;
}

void handle_budget_set(struct conn *c, uint64_t id, const Envelope *request,
                       int request_fd _unused_) {
	const Kvd__V1__BudgetSet *req = request->budget_set;
	struct pool *p = c->srv->pool;
	char why[512];
	uint64_t bytes = 0;
	int r;

	r = budget_change(c->srv, req, &bytes, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	r = admin_budget_set(c->srv->admin, bytes, why, sizeof(why));
	if (r >= 0)
		log_notice("budget set to %llu bytes by pid %d uid %u (%llu in use)%s",
		           (unsigned long long)bytes, (int)c->cred.pid, (unsigned)c->cred.uid,
		           (unsigned long long)p->used_bytes,
		           req->has_force && req->force ? ", forced below the floor" : "");
	reply_live(c, id, r, why);
	if (r >= 0 && p->used_bytes > p->budget_bytes)
		evict_kick(c->srv->evictor, ROUND_BUDGET);
}

void handle_budget_reset(struct conn *c, uint64_t id, const Envelope *request _unused_,
                         int request_fd _unused_) {
	struct pool *p = c->srv->pool;
	char why[512];
	int r;

	r = admin_budget_reset(c->srv->admin, why, sizeof(why));
	if (r >= 0)
		log_notice("budget reset to %llu bytes (%s) by pid %d uid %u",
		           (unsigned long long)p->budget_bytes, admin_budget_source(c->srv->admin),
		           (int)c->cred.pid, (unsigned)c->cred.uid);
	reply_live(c, id, r, why);
}

/*
 * Checks a TenantSet and says what the tenant's settings would be after it: those it sets,
 * the others as the tenant has them (or the defaults, for a tenant it would create), in
 * *ret (tenant_id 0 when the tenant does not exist yet). Returns 0, or -EINVAL with why.
 */
int tenant_change(const struct server *s, const Kvd__V1__TenantSet *req,
                  struct evict_patch *ret, char why[static WHY_MAX]) {
	const struct tenant *t;

	if (!req->name || !tenant_name_valid(req->name))
		return refuse(why, -EINVAL, "invalid tenant name");
	if (req->has_weight && (req->weight < 1 || req->weight > KVD_TENANT_WEIGHT_MAX))
		return refuse(why, -EINVAL, "weight must be 1..%u", KVD_TENANT_WEIGHT_MAX);
	if (req->policy && (int)kvd_policy_from_string(req->policy) < 0)
		return refuse(why, -EINVAL, "unknown policy (kvd.conf(5) lists them)");
	if (req->tier && tier_mode_from_string(req->tier) < 0)
		return refuse(why, -EINVAL, "unknown tier '%s': drop, host or host+file", req->tier);
	if (req->tier && tier_mode_from_string(req->tier) != TIER_DROP && s->tier->budget_bytes == 0)
		return refuse(why, -EINVAL, "tier %s needs a host tier: kvd runs without one "
		              "(host-tier-size 0)", req->tier);
	if (req->has_recall && req->recall > KVD_TENANT_RECALL_MAX)
		return refuse(why, -EINVAL, "recall must be 0..%u tokens per row",
		              KVD_TENANT_RECALL_MAX);
	if (req->has_recall && req->recall > 0 && s->tier->budget_bytes == 0)
		return refuse(why, -EINVAL, "recall needs a host tier, where evicted tokens are kept: "
		              "kvd runs without one (host-tier-size 0)");
	if (req->tier && tier_mode_from_string(req->tier) == TIER_HOST_FILE && !s->tier->file)
		return refuse(why, -EINVAL, "tier host+file needs a file tier: kvd runs without one "
		              "(file-tier-size 0)");
	t = tenant_find(&s->tenants, req->name);
	*ret = (struct evict_patch){
		.tenant_id = t ? t->id : 0,
		.min_bytes = req->has_min_bytes ? req->min_bytes : t ? t->min_bytes : 0,
		.max_bytes = req->has_max_bytes ? req->max_bytes : t ? t->max_bytes : KVD_TENANT_NO_CAP,
		.weight = req->has_weight ? req->weight : t ? t->weight : 1,
		.policy = req->policy ? (int)kvd_policy_from_string(req->policy) :
		          t ? t->policy : KVD_POLICY_KVD,
	};
	if (ret->min_bytes > ret->max_bytes)
		return refuse(why, -EINVAL, "min above max");
	if (ret->min_bytes != 0 && ret->min_bytes > s->pool->pool_bytes)
		return refuse(why, -EINVAL, "min above the pool");
	return 0;
}

void handle_tenant_set(struct conn *c, uint64_t id, const Envelope *request,
                       int request_fd _unused_) {
	const Kvd__V1__TenantSet *req = request->tenant_set;
	struct state_tenant change = {};
	struct evict_patch after = {};
	struct tenant *t;
	uint64_t min, max;
	char why[512], min_s[32], max_s[32];
	int r;

	r = tenant_change(c->srv, req, &after, why);
	if (r < 0) {
		envelope_reply_error(c, id, r, "%s", why);
		return;
	}
	min = after.min_bytes;
	max = after.max_bytes;
	r = tenant_get(&c->srv->tenants, req->name, &t);
	if (r < 0) {
		if (r == -EUSERS) {
			conn_refused(c, LIMIT_TENANTS);
			log_warning("tenant set by pid %d: new tenant %s refused: max-tenants (%u) are "
			            "known", (int)c->cred.pid, req->name, c->srv->limits.max_tenants);
		}
		envelope_reply_error(c, id, r, "too many tenants (%u)", c->srv->limits.max_tenants);
		return;
	}
	change.has_min = req->has_min_bytes;
	change.min_bytes = min;
	change.has_max = req->has_max_bytes;
	change.max_bytes = max;
	change.has_weight = req->has_weight;
	change.weight = req->weight;
	change.has_policy = req->policy != NULL;
	change.policy = req->policy ? (int)kvd_policy_from_string(req->policy) : 0;
	change.has_tier = req->tier != NULL;
	change.tier = req->tier ? tier_mode_from_string(req->tier) : 0;
	change.has_recall = req->has_recall;
	change.recall = req->recall;
	/* Setting it again is how an operator takes back a tenant the file tier failed. */
	if (req->tier)
		t->tier_degraded = false;
	r = admin_tenant_set(c->srv->admin, t, &change, why, sizeof(why));
	if (r >= 0)
		log_notice("tenant %s set by pid %d uid %u: min %s, max %s, weight %u, policy %s, "
		           "tier %s, recall %u", t->name, (int)c->cred.pid, (unsigned)c->cred.uid,
		           size_format(t->min_bytes, min_s, sizeof(min_s)),
		           tenant_format_max(t->max_bytes, max_s, sizeof(max_s)), t->weight,
		           kvd_policy_to_string(t->policy), tier_mode_to_string(t->tier), t->recall);
	reply_live(c, id, r, why);
	/* A cap lowered below what the tenant holds: the excess goes now, as a budget. */
	if (r >= 0 && t->max_bytes != KVD_TENANT_NO_CAP && t->used_bytes > t->max_bytes)
		evict_cap_lowered(c->srv->evictor);
}

void handle_tenant_reset(struct conn *c, uint64_t id, const Envelope *request,
                         int request_fd _unused_) {
	const Kvd__V1__TenantReset *req = request->tenant_reset;
	struct tenant *t;
	char why[512], min_s[32], max_s[32];
	int r;

	if (!req->name || !tenant_name_valid(req->name)) {
		envelope_reply_error(c, id, -EINVAL, "invalid tenant name");
		return;
	}
	r = admin_tenant_reset(c->srv->admin, req->name, why, sizeof(why));
	t = tenant_find(&c->srv->tenants, req->name);
	if (r >= 0 && t)
		log_notice("tenant %s reset by pid %d uid %u: min %s, max %s, weight %u", t->name,
		           (int)c->cred.pid, (unsigned)c->cred.uid,
		           size_format(t->min_bytes, min_s, sizeof(min_s)),
		           tenant_format_max(t->max_bytes, max_s, sizeof(max_s)), t->weight);
	reply_live(c, id, r, why);
}

void handle_tenant_delete(struct conn *c, uint64_t id, const Envelope *request,
                          int request_fd _unused_) {
	const Kvd__V1__TenantDelete *req = request->tenant_delete;
	char why[512];
	int r;

	if (!req->name || !tenant_name_valid(req->name)) {
		envelope_reply_error(c, id, -EINVAL, "invalid tenant name");
		return;
	}
	r = admin_tenant_delete(c->srv->admin, req->name, why, sizeof(why));
	if (r >= 0)
		log_notice("tenant %s deleted by pid %d uid %u", req->name, (int)c->cred.pid,
		           (unsigned)c->cred.uid);
	reply_live(c, id, r, why);
}

void handle_reload(struct conn *c, uint64_t id, const Envelope *request _unused_,
                   int request_fd _unused_) {
	char by[96], why[1024];
	int r;

	snprintf(by, sizeof(by), "kvdctl reload (pid %d, uid %u)", (int)c->cred.pid,
	         (unsigned)c->cred.uid);
	r = admin_reload(c->srv->admin, by, why, sizeof(why));
	if (r < 0)
		envelope_reply_error(c, id, r, "%s", why);
	else
		envelope_reply(c, id, NULL, NULL, 0);
}

/* One [kvd] value as the daemon runs with it, and where it comes from: the budget may be
 * live (kvdctl budget), then the pool's. */
static void config_value(const struct server *s, const struct admin *a, size_t i,
                         char *value, size_t value_n, char *source, size_t source_n) {
	const struct settings *cfg = &a->cfg;

	if ((int)i == settings_index("budget") && a->budget_source == SOURCE_LIVE) {
		size_format(s->pool->budget_bytes, value, value_n);
		snprintf(source, source_n, "live");
		return;
	}
	settings_format(cfg, i, value, value_n);
	if ((int)i == settings_index("budget") && cfg->budget != SETTINGS_UNSET &&
	    (cfg->budget & SETTINGS_PERCENT)) {
		size_t k = strlen(value);
		char b[32];

		snprintf(value + k, value_n - k, " (%s)", size_format(s->pool->budget_bytes, b, sizeof(b)));
	}
	if (cfg->source[i] == SOURCE_CONFIG)
		snprintf(source, source_n, "%s:%u", cfg->path ? cfg->path : "?", cfg->line[i]);
	else
		snprintf(source, source_n, "%s", setting_source_to_string(cfg->source[i]));
}

void handle_config(struct conn *c, uint64_t id, const Envelope *request _unused_,
                   int request_fd _unused_) {
	const struct admin *a = c->srv->admin;
	Kvd__V1__ConfigReply rep = KVD__V1__CONFIG_REPLY__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	_cleanup_(freep) Kvd__V1__Setting *rows = NULL;
	_cleanup_(freep) Kvd__V1__Setting **ptrs = NULL;
	_cleanup_(freep) char *text = NULL;
	const struct setting *table;
	size_t n, k = 0;
	/* A value is at most a path or a list of names; its source a path and a line. */
	enum { VALUE_MAX = PATH_MAX + 32 };

	/* The settings name paths, users and groups of every tenant: the operator's. */
	if (!access_admin(&a->cfg, c->fd, &c->cred)) {
		c->srv->access_refused++;
		envelope_reply_error(c, id, -EPERM, "only root and members of admin-group (%s) may "
		                     "read the daemon's settings", a->cfg.admin_group);
		return;
	}
	table = settings_table(&n);
	rows = calloc(n, sizeof(*rows));
	ptrs = calloc(n, sizeof(*ptrs));
	text = malloc(n * 2 * VALUE_MAX);
	if (!rows || !ptrs || !text) {
		envelope_reply_error(c, id, -ENOMEM, "out of memory");
		return;
	}
	for (size_t i = 0; i < n; i++) {
		char *value = text + 2 * i * VALUE_MAX, *source = value + VALUE_MAX;

		if (table[i].flags & SETTING_FLAG_ONLY)
			continue;
		kvd__v1__setting__init(&rows[k]);
		config_value(c->srv, a, i, value, VALUE_MAX, source, VALUE_MAX);
		rows[k].name = (char *)table[i].name;
		rows[k].value = value;
		rows[k].source = source;
		ptrs[k] = &rows[k];
		k++;
	}
	rep.n_settings = k;
	rep.settings = ptrs;
	env.body_case = KVD__V1__ENVELOPE__BODY_CONFIG_REPLY;
	env.config_reply = &rep;
	envelope_reply(c, id, &env, NULL, 0);
}

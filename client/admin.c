/* SPDX-License-Identifier: MIT */
/*
 * libkvd, administration: live changes of the budget and of tenants, and eviction on
 * request. Any connection may ask; the daemon decides who may change what.
 */

#include <errno.h>
#include <stdlib.h>

#include "basic/macro.h"

#include "client-internal.h"
#include "kvd/kvd.h"
#include "wire.h"

/* ---- administration ---- */

/*
 * A request whose reply carries nothing but a status. Code 0 with a message means done
 * with a caveat (a live change the daemon could not save): returns 1 and keeps the message
 * for kvd_client_last_error().
 */
static int client_simple_call(kvd_client *c, Envelope *env) {
	int fds[WIRE_FDS_MAX];
	Envelope *reply;
	int r;

	client_lock(c);
	r = client_call(c, env, BODY_ANY, false, &reply, fds, NULL);
	if (r >= 0 && reply->status && reply->status->message && *reply->status->message) {
		client_set_error(c, 0, reply->status->message);
		r = 1;
	}
	client_unlock(c);
	return r;
}

/* A BudgetSet from parameters, checked. */
static int budget_request(kvd_client *c, const kvd_budget_params *params, Kvd__V1__BudgetSet *req) {
	kvd_budget_params p;
	int r;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	r = params_copy(&p, sizeof(p), params, KVD_BUDGET_PARAMS_SIZE_1_6);
	if (r < 0)
		return r;
	if ((p.flags & ~KVD_BUDGET_FORCE) || p.percent > 100 || p.reserved != 0)
		return -EINVAL;
	req->has_bytes = p.percent == 0;
	req->bytes = p.bytes;
	req->has_percent = p.percent != 0;
	req->percent = p.percent;
	req->has_force = req->force = (p.flags & KVD_BUDGET_FORCE) != 0;
	return 0;
}

static int do_budget_set_params(kvd_client *c, const kvd_budget_params *params) {
	Kvd__V1__BudgetSet req = KVD__V1__BUDGET_SET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	int r;

	r = budget_request(c, params, &req);
	if (r < 0)
		return r;
	env.body_case = KVD__V1__ENVELOPE__BODY_BUDGET_SET;
	env.budget_set = &req;
	return client_simple_call(c, &env);
}

int kvd_budget_set_params(kvd_client *c, const kvd_budget_params *p) {
	return (int)call_result(client_key(c), do_budget_set_params(c, p), __func__);
}

static int do_budget_set(kvd_client *c, uint64_t bytes) {
	kvd_budget_params p = { .size = sizeof(p), .bytes = bytes };

	return do_budget_set_params(c, &p);
}

int kvd_budget_set(kvd_client *c, uint64_t bytes) {
	return (int)call_result(client_key(c), do_budget_set(c, bytes), __func__);
}

/* A TenantSet from parameters, checked: req's strings point into params. */
static int tenant_request(kvd_client *c, const char *tenant, const kvd_tenant_params *params,
                          Kvd__V1__TenantSet *req) {
	kvd_tenant_params p;
	int r;

	if (!c || !tenant)
		return -EINVAL;
	if (!tenant_name_valid(tenant))
		return client_error(c, -EINVAL, TENANT_NAME_RULE);
	if (client_forked(c))
		return -ECHILD;
	r = params_copy(&p, sizeof(p), params, KVD_TENANT_PARAMS_SIZE_1_4);
	if (r < 0)
		return r;
	if ((p.set & ~(KVD_TENANT_SET_MIN | KVD_TENANT_SET_MAX | KVD_TENANT_SET_WEIGHT |
		       KVD_TENANT_SET_POLICY | KVD_TENANT_SET_TIER | KVD_TENANT_SET_RECALL)) ||
	    p.reserved != 0 || p.reserved2 != 0 ||
	    ((p.set & KVD_TENANT_SET_POLICY) && !p.policy) ||
	    ((p.set & KVD_TENANT_SET_TIER) && !p.tier))
		return -EINVAL;
	/* A daemon that predates the field would drop it without a word. */
	if ((p.set & KVD_TENANT_SET_POLICY) && !(c->features & KVD_FEATURE_TENANT_POLICY))
		return -EOPNOTSUPP;
	if ((p.set & KVD_TENANT_SET_TIER) && !(c->features & KVD_FEATURE_TIERS))
		return -EOPNOTSUPP;
	if ((p.set & KVD_TENANT_SET_RECALL) && !(c->features & KVD_FEATURE_RECALL))
		return -EOPNOTSUPP;
	req->name = (char *)tenant;
	req->has_min_bytes = p.set & KVD_TENANT_SET_MIN;
	req->min_bytes = p.min_bytes;
	req->has_max_bytes = p.set & KVD_TENANT_SET_MAX;
	req->max_bytes = p.max_bytes;
	req->has_weight = p.set & KVD_TENANT_SET_WEIGHT;
	req->weight = p.weight;
	req->policy = p.set & KVD_TENANT_SET_POLICY ? (char *)p.policy : NULL;
	req->tier = p.set & KVD_TENANT_SET_TIER ? (char *)p.tier : NULL;
	req->has_recall = p.set & KVD_TENANT_SET_RECALL;
	req->recall = p.recall;
	return 0;
}

static int do_tenant_set_params(kvd_client *c, const char *tenant, const kvd_tenant_params *params) {
	Kvd__V1__TenantSet req = KVD__V1__TENANT_SET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	int r;

	r = tenant_request(c, tenant, params, &req);
	if (r < 0)
		return r;
	env.body_case = KVD__V1__ENVELOPE__BODY_TENANT_SET;
	env.tenant_set = &req;
	return client_simple_call(c, &env);
}

int kvd_tenant_set_params(kvd_client *c, const char *tenant, const kvd_tenant_params *params) {
	return (int)call_result(client_key(c), do_tenant_set_params(c, tenant, params), __func__);
}

static int do_tenant_set(kvd_client *c, const char *tenant, uint64_t min_bytes,
		   uint64_t max_bytes, uint32_t weight) {
	kvd_tenant_params p = {
		.size = sizeof(p),
		.set = (min_bytes != KVD_TENANT_KEEP ? KVD_TENANT_SET_MIN : 0) |
		       (max_bytes != KVD_TENANT_KEEP ? KVD_TENANT_SET_MAX : 0) |
		       (weight != 0 ? KVD_TENANT_SET_WEIGHT : 0),
		.min_bytes = min_bytes,
		.max_bytes = max_bytes,
		.weight = weight,
	};

	return do_tenant_set_params(c, tenant, &p);
}

int kvd_tenant_set(kvd_client *c, const char *tenant, uint64_t min_bytes,
		   uint64_t max_bytes, uint32_t weight) {
	return (int)call_result(client_key(c), do_tenant_set(c, tenant, min_bytes, max_bytes, weight), __func__);
}

static int do_budget_reset(kvd_client *c) {
	Kvd__V1__BudgetReset req = KVD__V1__BUDGET_RESET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	env.body_case = KVD__V1__ENVELOPE__BODY_BUDGET_RESET;
	env.budget_reset = &req;
	return client_simple_call(c, &env);
}

int kvd_budget_reset(kvd_client *c) {
	return (int)call_result(client_key(c), do_budget_reset(c), __func__);
}

static int do_reload(kvd_client *c) {
	Kvd__V1__Reload req = KVD__V1__RELOAD__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	if (!c)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	env.body_case = KVD__V1__ENVELOPE__BODY_RELOAD;
	env.reload = &req;
	return client_simple_call(c, &env);
}

int kvd_reload(kvd_client *c) {
	return (int)call_result(client_key(c), do_reload(c), __func__);
}

/* A request that names one tenant (env's body holds the name): checks it, then calls. */
static int tenant_call(kvd_client *c, const char *tenant, Envelope *env) {
	if (!c || !tenant)
		return -EINVAL;
	if (!tenant_name_valid(tenant))
		return client_error(c, -EINVAL, TENANT_NAME_RULE);
	if (client_forked(c))
		return -ECHILD;
	return client_simple_call(c, env);
}

static int do_tenant_reset(kvd_client *c, const char *tenant) {
	Kvd__V1__TenantReset req = KVD__V1__TENANT_RESET__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	req.name = (char *)tenant;
	env.body_case = KVD__V1__ENVELOPE__BODY_TENANT_RESET;
	env.tenant_reset = &req;
	return tenant_call(c, tenant, &env);
}

int kvd_tenant_reset(kvd_client *c, const char *tenant) {
	return (int)call_result(client_key(c), do_tenant_reset(c, tenant), __func__);
}

static int do_tenant_delete(kvd_client *c, const char *tenant) {
	Kvd__V1__TenantDelete req = KVD__V1__TENANT_DELETE__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;

	req.name = (char *)tenant;
	env.body_case = KVD__V1__ENVELOPE__BODY_TENANT_DELETE;
	env.tenant_delete = &req;
	return tenant_call(c, tenant, &env);
}

int kvd_tenant_delete(kvd_client *c, const char *tenant) {
	return (int)call_result(client_key(c), do_tenant_delete(c, tenant), __func__);
}

/* ---- eviction ---- */

/* An Evict from its arguments, checked: of kvd_evict and kvd_evict_plan. */
static int evict_request(kvd_client *c, const char *tenant, uint64_t bytes, Kvd__V1__Evict *req) {
	if (!c)
		return -EINVAL;
	if (tenant && !tenant_name_valid(tenant))
		return client_error(c, -EINVAL, TENANT_NAME_RULE);
	if (client_forked(c))
		return -ECHILD;
	req->tenant = (char *)tenant;
	req->has_bytes = bytes != 0;
	req->bytes = bytes;
	return 0;
}

static int do_evict(kvd_client *c, const char *tenant, uint64_t bytes, uint64_t *ret_freed) {
	Kvd__V1__Evict req = KVD__V1__EVICT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	int fds[WIRE_FDS_MAX];
	int r;

	r = evict_request(c, tenant, bytes, &req);
	if (r < 0)
		return r;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICT;
	env.evict = &req;

	/* The daemon answers when the round is done; the lock is held until then, like for
	 * any other round trip. */
	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_EVICT_REPLY, false, &reply, fds, NULL);
	if (r >= 0 && ret_freed)
		*ret_freed = reply->evict_reply->has_freed_bytes ? reply->evict_reply->freed_bytes : 0;
	client_unlock(c);
	return r;
}

int kvd_evict(kvd_client *c, const char *tenant, uint64_t bytes, uint64_t *ret_freed) {
	return (int)call_result(client_key(c), do_evict(c, tenant, bytes, ret_freed), __func__);
}

/* ---- dry runs ---- */

/* Sends a Plan and keeps its answer, one round, as a kvd_evictions. */
static int plan_call(kvd_client *c, Kvd__V1__Plan *plan, kvd_evictions **ret) {
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!ret)
		return -EINVAL;
	e = evictions_new();
	if (!e)
		return -ENOMEM;
	env.body_case = KVD__V1__ENVELOPE__BODY_PLAN;
	env.plan = plan;
	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_EVICTIONS_REPLY, false, &reply, fds, NULL);
	if (r >= 0 && reply->evictions_reply->n_rounds != 1)
		r = -EPROTO;
	if (r >= 0)
		r = evictions_copy(reply->evictions_reply, e);
	client_unlock(c);
	if (r < 0)
		return r;
	*ret = TAKE_PTR(e);
	return 0;
}

static int do_budget_plan(kvd_client *c, const kvd_budget_params *params, kvd_evictions **ret) {
	Kvd__V1__BudgetSet req = KVD__V1__BUDGET_SET__INIT;
	Kvd__V1__Plan plan = KVD__V1__PLAN__INIT;
	int r;

	r = budget_request(c, params, &req);
	if (r < 0)
		return r;
	plan.budget_set = &req;
	return plan_call(c, &plan, ret);
}

int kvd_budget_plan(kvd_client *c, const kvd_budget_params *p, kvd_evictions **ret) {
	return (int)call_result(client_key(c), do_budget_plan(c, p, ret), __func__);
}

static int do_tenant_plan(kvd_client *c, const char *tenant, const kvd_tenant_params *params,
                          kvd_evictions **ret) {
	Kvd__V1__TenantSet req = KVD__V1__TENANT_SET__INIT;
	Kvd__V1__Plan plan = KVD__V1__PLAN__INIT;
	int r;

	r = tenant_request(c, tenant, params, &req);
	if (r < 0)
		return r;
	plan.tenant_set = &req;
	return plan_call(c, &plan, ret);
}

int kvd_tenant_plan(kvd_client *c, const char *tenant, const kvd_tenant_params *p,
                    kvd_evictions **ret) {
	return (int)call_result(client_key(c), do_tenant_plan(c, tenant, p, ret), __func__);
}

static int do_evict_plan(kvd_client *c, const char *tenant, uint64_t bytes, kvd_evictions **ret) {
	Kvd__V1__Evict req = KVD__V1__EVICT__INIT;
	Kvd__V1__Plan plan = KVD__V1__PLAN__INIT;
	int r;

	r = evict_request(c, tenant, bytes, &req);
	if (r < 0)
		return r;
	plan.evict = &req;
	return plan_call(c, &plan, ret);
}

int kvd_evict_plan(kvd_client *c, const char *tenant, uint64_t bytes, kvd_evictions **ret) {
	return (int)call_result(client_key(c), do_evict_plan(c, tenant, bytes, ret), __func__);
}

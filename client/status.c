/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the daemon's numbers: status (node and tenants) and the recent eviction rounds,
 * read by name from the reply messages' descriptors, so that a number the daemon adds is a
 * key at once.
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "client-internal.h"
#include "basic/macro.h"
#include "kvd/kvd.h"
#include "wire.h"

/* ---- status ---- */

/* The strings kvd_status_tenant_str() knows, in the order of status_tenant.str. */
static const char *const tenant_str_keys[] = {
	"min_source", "max_source", "weight_source", "policy", "policy_source", "tier",
	"tier_source", "recall_source",
};
#define TENANT_STR_KEYS ELEMENTSOF(tenant_str_keys)

/* Fields of a reply message, at most: the bits of `present`. */
#define VALUES_MAX 128u

/*
 * Numbers read by name (status, tenants, evictions): every optional integer field of a
 * reply message, named as kvd.proto names it, so that a number the daemon adds is a key
 * here at once, with no list to keep in step. values[i] is the message's field i.
 */
struct status_values {
	const ProtobufCMessageDescriptor *desc; /* NULL: nothing read */
	uint64_t v[VALUES_MAX];
	uint64_t present[VALUES_MAX / 64]; /* bit i: v[i] was sent */
};

struct status_tenant {
	char *name;
	struct status_values values;
	char *str[TENANT_STR_KEYS]; /* NULL: not sent */
};

struct kvd_status {
	struct status_values node;
	/* Refusals by limit, as the daemon names them ("refused_" + name for kvd_status_u64). */
	uint32_t n_refused;
	char **refused_names;
	uint64_t *refused;
	char *daemon_version;
	char *backend;
	char *budget_source;
	char *state_error;
	char *warnings;
	char *devices;
	char *last_reload_error;
	uint32_t n_tenants;
	struct status_tenant *tenants;
};

static bool field_is_number(const ProtobufCFieldDescriptor *f) {
	return f->label == PROTOBUF_C_LABEL_OPTIONAL &&
	       (f->type == PROTOBUF_C_TYPE_UINT32 || f->type == PROTOBUF_C_TYPE_UINT64);
}

static void status_values_read(struct status_values *sv, const ProtobufCMessage *m) {
	const ProtobufCMessageDescriptor *d = m->descriptor;
	const char *base = (const char *)m;

	sv->desc = d;
	memset(sv->present, 0, sizeof(sv->present));
	for (unsigned i = 0; i < d->n_fields && i < VALUES_MAX; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];

		if (!field_is_number(f) || !*(const protobuf_c_boolean *)(base + f->quantifier_offset))
			continue;
		sv->v[i] = f->type == PROTOBUF_C_TYPE_UINT32 ? *(const uint32_t *)(base + f->offset) :
		                                                *(const uint64_t *)(base + f->offset);
		sv->present[i / 64] |= UINT64_C(1) << (i % 64);
	}
}

static int status_get(const struct status_values *sv, const char *key, uint64_t *ret) {
	for (unsigned i = 0; sv->desc && i < sv->desc->n_fields && i < VALUES_MAX; i++) {
		const ProtobufCFieldDescriptor *f = &sv->desc->fields[i];

		if (!field_is_number(f) || strcmp(f->name, key) != 0)
			continue;
		if (!(sv->present[i / 64] & (UINT64_C(1) << (i % 64))))
			return -ENOENT;
		*ret = sv->v[i];
		return 0;
	}
	return -ENOENT;
}

/* Copies a reply into a status that outlives the receive buffer. */
static int status_copy(const Kvd__V1__StatusReply *rep, kvd_status *st) {
	struct status_values *n = &st->node;

	if (rep->daemon_version && !(st->daemon_version = strdup(rep->daemon_version)))
		return -ENOMEM;
	if (rep->backend && !(st->backend = strdup(rep->backend)))
		return -ENOMEM;
	if (rep->budget_source && !(st->budget_source = strdup(rep->budget_source)))
		return -ENOMEM;
	if (rep->warnings && !(st->warnings = strdup(rep->warnings)))
		return -ENOMEM;
	if (rep->last_reload_error && !(st->last_reload_error = strdup(rep->last_reload_error)))
		return -ENOMEM;
	if (rep->devices && !(st->devices = strdup(rep->devices)))
		return -ENOMEM;
	if (rep->state_error && !(st->state_error = strdup(rep->state_error)))
		return -ENOMEM;
	status_values_read(n, &rep->base);
	if (rep->n_refused > 0) {
		/* Bounded by the 64 KiB frame like everything else in the reply. */
		st->refused_names = calloc(rep->n_refused, sizeof(char *));
		st->refused = calloc(rep->n_refused, sizeof(uint64_t));
		if (!st->refused_names || !st->refused)
			return -ENOMEM;
		for (size_t i = 0; i < rep->n_refused; i++) {
			const Kvd__V1__Counter *k = rep->refused[i];

			st->refused_names[i] = strdup(k->name ? k->name : "");
			if (!st->refused_names[i])
				return -ENOMEM;
			st->refused[i] = k->has_value ? k->value : 0;
			st->n_refused++;
		}
	}

	if (rep->n_tenants == 0)
		return 0;
	/* A 64 KiB message holds far fewer than UINT32_MAX tenants. */
	st->tenants = calloc(rep->n_tenants, sizeof(*st->tenants));
	if (!st->tenants)
		return -ENOMEM;
	st->n_tenants = rep->n_tenants;
	for (size_t i = 0; i < rep->n_tenants; i++) {
		const Kvd__V1__TenantStatus *ts = rep->tenants[i];
		struct status_values *tv = &st->tenants[i].values;

		st->tenants[i].name = strdup(ts->name ? ts->name : "");
		if (!st->tenants[i].name)
			return -ENOMEM;
		status_values_read(tv, &ts->base);

		const char *const strs[TENANT_STR_KEYS] = {
			ts->min_source, ts->max_source, ts->weight_source, ts->policy,
			ts->policy_source, ts->tier, ts->tier_source, ts->recall_source,
		};

		for (size_t k = 0; k < TENANT_STR_KEYS; k++)
			if (strs[k] && !(st->tenants[i].str[k] = strdup(strs[k])))
				return -ENOMEM;
	}
	return 0;
}

kvd_status *kvd_status_free(kvd_status *st) {
	if (!st)
		return NULL;
	for (uint32_t i = 0; i < st->n_refused; i++)
		free(st->refused_names[i]);
	free(st->refused_names);
	free(st->refused);
	for (uint32_t i = 0; i < st->n_tenants; i++) {
		free(st->tenants[i].name);
		for (size_t k = 0; k < TENANT_STR_KEYS; k++)
			free(st->tenants[i].str[k]);
	}
	free(st->tenants);
	free(st->daemon_version);
	free(st->last_reload_error);
	free(st->backend);
	free(st->budget_source);
	free(st->state_error);
	free(st->warnings);
	free(st->devices);
	free(st);
	return NULL;
}

static int do_status_get(kvd_client *c, kvd_status **ret) {
	Kvd__V1__StatusRequest req = KVD__V1__STATUS_REQUEST__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	st = calloc(1, sizeof(*st));
	if (!st)
		return -ENOMEM;
	env.body_case = KVD__V1__ENVELOPE__BODY_STATUS_REQUEST;
	env.status_request = &req;

	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_STATUS_REPLY, false, &reply, fds, NULL);
	if (r >= 0)
		r = status_copy(reply->status_reply, st);
	client_unlock(c);
	if (r < 0)
		return r;

	*ret = TAKE_PTR(st);
	return 0;
}

int kvd_status_get(kvd_client *c, kvd_status **ret) {
	return (int)call_result(client_key(c), do_status_get(c, ret), __func__);
}

int kvd_status_u64(const kvd_status *st, const char *key, uint64_t *ret) {
	if (!st || !key || !ret)
		return -EINVAL;
	if (strncmp(key, "refused_", 8) == 0)
		for (uint32_t i = 0; i < st->n_refused; i++)
			if (strcmp(st->refused_names[i], key + 8) == 0) {
				*ret = st->refused[i];
				return 0;
			}
	return status_get(&st->node, key, ret);
}

uint32_t kvd_status_refusals(const kvd_status *st) {
	return st ? st->n_refused : 0;
}

int kvd_status_refusal(const kvd_status *st, uint32_t index, const char **ret_name,
		       uint64_t *ret_value) {
	if (!st || index >= st->n_refused)
		return -EINVAL;
	if (ret_name)
		*ret_name = st->refused_names[index];
	if (ret_value)
		*ret_value = st->refused[index];
	return 0;
}

int kvd_status_str(const kvd_status *st, const char *key, const char **ret) {
	const char *v = NULL;

	if (!st || !key || !ret)
		return -EINVAL;
	if (strcmp(key, "daemon_version") == 0)
		v = st->daemon_version;
	else if (strcmp(key, "backend") == 0)
		v = st->backend;
	else if (strcmp(key, "budget_source") == 0)
		v = st->budget_source;
	else if (strcmp(key, "state_error") == 0)
		v = st->state_error;
	else if (strcmp(key, "warnings") == 0)
		v = st->warnings;
	else if (strcmp(key, "devices") == 0)
		v = st->devices;
	else if (strcmp(key, "last_reload_error") == 0)
		v = st->last_reload_error;
	if (!v)
		return -ENOENT;
	*ret = v;
	return 0;
}

uint32_t kvd_status_tenants(const kvd_status *st) {
	return st ? st->n_tenants : 0;
}

int kvd_status_tenant_name(const kvd_status *st, uint32_t index, const char **ret) {
	if (!st || !ret || index >= st->n_tenants)
		return -EINVAL;
	*ret = st->tenants[index].name;
	return 0;
}

int kvd_status_tenant_u64(const kvd_status *st, uint32_t index, const char *key,
			  uint64_t *ret) {
	if (!st || !key || !ret || index >= st->n_tenants)
		return -EINVAL;
	return status_get(&st->tenants[index].values, key, ret);
}

int kvd_status_tenant_str(const kvd_status *st, uint32_t index, const char *key,
			  const char **ret) {
	if (!st || !key || !ret || index >= st->n_tenants)
		return -EINVAL;
	for (size_t k = 0; k < TENANT_STR_KEYS; k++)
		if (strcmp(tenant_str_keys[k], key) == 0) {
			if (!st->tenants[index].str[k])
				return -ENOENT;
			*ret = st->tenants[index].str[k];
			return 0;
		}
	return -ENOENT;
}

/* ---- eviction rounds ---- */

struct round_tenant {
	char *name;
	uint64_t freed_bytes, evicted_tokens;
	bool has_predicted_error;
	double predicted_error;
};

struct eviction_round {
	struct status_values values;
	bool has_predicted_error;
	double predicted_error;
	char *trigger; /* NULL: not sent */
	char *error;   /* NULL: the round did not fail */
	char *note;    /* NULL: it gave chunks back, or failed */
	uint32_t n_tenants;
	struct round_tenant *tenants;
};

struct kvd_evictions {
	uint32_t n_rounds;
	struct eviction_round *rounds;
};

static int round_copy(const Kvd__V1__Round *in, struct eviction_round *out) {
	struct status_values *v = &out->values;

	status_values_read(v, &in->base);
	out->has_predicted_error = in->has_predicted_error;
	out->predicted_error = in->predicted_error;
	if (in->trigger && !(out->trigger = strdup(in->trigger)))
		return -ENOMEM;
	if (in->error && !(out->error = strdup(in->error)))
		return -ENOMEM;
	if (in->note && !(out->note = strdup(in->note)))
		return -ENOMEM;

	if (in->n_tenants == 0)
		return 0;
	/* Bounded by the 64 KiB message, like the status's tenants. */
	out->tenants = calloc(in->n_tenants, sizeof(*out->tenants));
	if (!out->tenants)
		return -ENOMEM;
	out->n_tenants = in->n_tenants;
	for (size_t i = 0; i < in->n_tenants; i++) {
		const Kvd__V1__RoundTenant *t = in->tenants[i];

		out->tenants[i].name = strdup(t->name ? t->name : "");
		if (!out->tenants[i].name)
			return -ENOMEM;
		out->tenants[i].freed_bytes = t->has_freed_bytes ? t->freed_bytes : 0;
		out->tenants[i].evicted_tokens = t->has_evicted_tokens ? t->evicted_tokens : 0;
		out->tenants[i].has_predicted_error = t->has_predicted_error;
		out->tenants[i].predicted_error = t->predicted_error;
	}
	return 0;
}

kvd_evictions *evictions_new(void) {
	return calloc(1, sizeof(kvd_evictions));
}

/* Copies a reply into an object that outlives the receive buffer. */
int evictions_copy(const Kvd__V1__EvictionsReply *rep, kvd_evictions *e) {
	if (rep->n_rounds == 0)
		return 0;
	e->rounds = calloc(rep->n_rounds, sizeof(*e->rounds));
	if (!e->rounds)
		return -ENOMEM;
	e->n_rounds = rep->n_rounds;
	for (size_t i = 0; i < rep->n_rounds; i++) {
		int r = round_copy(rep->rounds[i], &e->rounds[i]);

		if (r < 0)
			return r;
	}
	return 0;
}

kvd_evictions *kvd_evictions_free(kvd_evictions *e) {
	if (!e)
		return NULL;
	for (uint32_t i = 0; i < e->n_rounds; i++) {
		struct eviction_round *rd = &e->rounds[i];

		for (uint32_t t = 0; t < rd->n_tenants; t++)
			free(rd->tenants[t].name);
		free(rd->tenants);
		free(rd->trigger);
		free(rd->error);
		free(rd->note);
	}
	free(e->rounds);
	free(e);
	return NULL;
}

static int do_evictions_get(kvd_client *c, kvd_evictions **ret) {
	Kvd__V1__EvictionsRequest req = KVD__V1__EVICTIONS_REQUEST__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *reply;
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	int fds[WIRE_FDS_MAX];
	int r;

	if (!c || !ret)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICTIONS_REQUEST;
	env.evictions_request = &req;

	client_lock(c);
	r = client_call(c, &env, KVD__V1__ENVELOPE__BODY_EVICTIONS_REPLY, false, &reply, fds,
			NULL);
	if (r >= 0)
		r = evictions_copy(reply->evictions_reply, e);
	client_unlock(c);
	if (r < 0)
		return r;

	*ret = TAKE_PTR(e);
	return 0;
}

int kvd_evictions_get(kvd_client *c, kvd_evictions **ret) {
	return (int)call_result(client_key(c), do_evictions_get(c, ret), __func__);
}

uint32_t kvd_evictions_count(const kvd_evictions *e) {
	return e ? e->n_rounds : 0;
}

int kvd_evictions_u64(const kvd_evictions *e, uint32_t round, const char *key, uint64_t *ret) {
	if (!e || !key || !ret || round >= e->n_rounds)
		return -EINVAL;
	return status_get(&e->rounds[round].values, key, ret);
}

int kvd_evictions_double(const kvd_evictions *e, uint32_t round, const char *key,
			 double *ret) {
	if (!e || !key || !ret || round >= e->n_rounds)
		return -EINVAL;
	if (strcmp(key, "predicted_error") != 0 || !e->rounds[round].has_predicted_error)
		return -ENOENT;
	*ret = e->rounds[round].predicted_error;
	return 0;
}

int kvd_evictions_str(const kvd_evictions *e, uint32_t round, const char *key,
		      const char **ret) {
	const char *v = NULL;

	if (!e || !key || !ret || round >= e->n_rounds)
		return -EINVAL;
	if (strcmp(key, "trigger") == 0)
		v = e->rounds[round].trigger;
	else if (strcmp(key, "error") == 0)
		v = e->rounds[round].error;
	else if (strcmp(key, "note") == 0)
		v = e->rounds[round].note;
	if (!v)
		return -ENOENT;
	*ret = v;
	return 0;
}

uint32_t kvd_evictions_tenants(const kvd_evictions *e, uint32_t round) {
	if (!e || round >= e->n_rounds)
		return 0;
	return e->rounds[round].n_tenants;
}

int kvd_evictions_tenant(const kvd_evictions *e, uint32_t round, uint32_t index,
			 const char **ret_name, uint64_t *ret_freed_bytes,
			 uint64_t *ret_evicted_tokens) {
	const struct round_tenant *t;

	if (!e || round >= e->n_rounds || index >= e->rounds[round].n_tenants)
		return -EINVAL;
	t = &e->rounds[round].tenants[index];
	if (ret_name)
		*ret_name = t->name;
	if (ret_freed_bytes)
		*ret_freed_bytes = t->freed_bytes;
	if (ret_evicted_tokens)
		*ret_evicted_tokens = t->evicted_tokens;
	return 0;
}

int kvd_evictions_tenant_double(const kvd_evictions *e, uint32_t round, uint32_t index,
				const char *key, double *ret) {
	const struct round_tenant *t;

	if (!e || !key || !ret || round >= e->n_rounds || index >= e->rounds[round].n_tenants)
		return -EINVAL;
	t = &e->rounds[round].tenants[index];
	if (strcmp(key, "predicted_error") != 0 || !t->has_predicted_error)
		return -ENOENT;
	*ret = t->predicted_error;
	return 0;
}

/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"
#include "tenant.h"

bool tenant_name_valid(const char *name) {
	size_t n = name ? strlen(name) : 0;

	if (n == 0 || n > KVD_TENANT_NAME_MAX)
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = name[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '.' || c == '-'))
			return false;
	}
	return true;
}

int tenant_table_init(struct tenant_table *t, uint32_t max) {
	t->tenants = calloc(max, sizeof(*t->tenants));
	if (!t->tenants)
		return -ENOMEM;
	t->n = 0;
	t->max = max;
	t->next_id = 1;
	return 0;
}

static void tenant_free(struct tenant *t) {
	free(t->allow_users);
	free(t->allow_groups);
	free(t);
}

void tenant_table_done(struct tenant_table *t) {
	for (uint32_t i = 0; i < t->n; i++)
		tenant_free(t->tenants[i]);
	free(t->tenants);
	t->tenants = NULL;
	t->n = 0;
}

bool tenant_holds_nothing(const struct tenant *t) {
	return t->connections == 0 && t->sequences == 0 && t->models == 0 && t->chunks == 0 &&
	       t->tier_moving == 0;
}

void tenant_table_remove(struct tenant_table *tt, struct tenant *t) {
	for (uint32_t i = 0; i < tt->n; i++)
		if (tt->tenants[i] == t) {
			memmove(&tt->tenants[i], &tt->tenants[i + 1],
			        (tt->n - i - 1) * sizeof(*tt->tenants));
			tt->n--;
			tenant_free(t);
			return;
		}
}

struct tenant *tenant_find_id(const struct tenant_table *t, uint32_t id) {
	for (uint32_t i = 0; i < t->n; i++)
		if (t->tenants[i]->id == id)
			return t->tenants[i];
	return NULL;
}

struct tenant *tenant_find(const struct tenant_table *t, const char *name) {
	for (uint32_t i = 0; i < t->n; i++)
		if (strcmp(t->tenants[i]->name, name) == 0)
			return t->tenants[i];
	return NULL;
}

uint32_t tenant_count_created_by(const struct tenant_table *t, uint32_t uid) {
	uint32_t n = 0;

	for (uint32_t i = 0; i < t->n; i++)
		n += t->tenants[i]->creator_uid == uid;
	return n;
}

int tenant_get(struct tenant_table *t, const char *name, struct tenant **ret) {
	struct tenant *x;

	if (!tenant_name_valid(name))
		return -EINVAL;
	x = tenant_find(t, name);
	if (x) {
		*ret = x;
		return 0;
	}
	if (t->n >= t->max)
		return -EUSERS;
	x = calloc(1, sizeof(*x));
	if (!x)
		return -ENOMEM;
	x->id = t->next_id++;
	x->creator_uid = TENANT_NO_CREATOR;
	strcpy(x->name, name);
	x->max_bytes = KVD_TENANT_NO_CAP;
	x->weight = 1;
	x->policy = KVD_POLICY_KVD;
	t->tenants[t->n++] = x;
	*ret = x;
	return 0;
}

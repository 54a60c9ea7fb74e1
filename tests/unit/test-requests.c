/* SPDX-License-Identifier: MIT */
/*
 * The request table (daemon/requests/dispatch.c), the one index of what the daemon serves, against
 * kvd.proto: every member of Envelope's body that is a request is served, no reply or event
 * is; the changes of the node (budget, tenants) need an operator, what works on a tenant's
 * memory needs a tenant's connection, and the one request that carries an fd says so.
 */
#include <string.h>

#include "dispatch.h"
#include "test.h"

/* Whether a body member is something the daemon sends, not serves. */
static bool sent_by_daemon(const char *name) {
	size_t n = strlen(name);

	return strcmp(name, "event") == 0 || (n > 6 && strcmp(name + n - 6, "_reply") == 0);
}

static bool named(const char *name, const char *const *list) {
	for (; *list; list++)
		if (strcmp(name, *list) == 0)
			return true;
	return false;
}

TEST(every_request_and_only_requests) {
	static const char *const admin[] = { "budget_set", "budget_reset", "tenant_set",
		                             "tenant_reset", "tenant_delete", "reload", NULL };
	static const char *const anyone[] = { "hello", "status_request", "evict",
		                              "evictions_request", "connections_request",
		                              "sequences_request", "disconnect", "plan",
		                              "config_request", NULL };
	const ProtobufCMessageDescriptor *d = &kvd__v1__envelope__descriptor;
	unsigned served = 0;

	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		unsigned flags = 0;
		bool serves;

		if (!(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF))
			continue;
		serves = dispatch_serves((int)f->id, &flags);
		if (sent_by_daemon(f->name)) {
			ASSERT_FALSE(serves);
			continue;
		}
		if (!serves)
			test_fail(__FILE__, __LINE__, "request %s has no handler", f->name);
		served++;
		ASSERT_EQ(!!(flags & REQUEST_NEEDS_ADMIN), named(f->name, admin));
		ASSERT_EQ(!!(flags & REQUEST_NEEDS_TENANT), !named(f->name, admin) && !named(f->name, anyone));
		/* An output projection's memfd; a prefix open's keys. */
		ASSERT_EQ(!!(flags & REQUEST_TAKES_FD), strcmp(f->name, "model_output_proj") == 0 ||
		                                        strcmp(f->name, "seq_open") == 0 ||
		                                        strcmp(f->name, "prefix_lookup") == 0);
	}
	/* The table has nothing past the body members either. */
	for (int body = 0; body < 1000; body++) {
		bool member = false;

		for (unsigned i = 0; i < d->n_fields; i++)
			member |= (d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
			          (int)d->fields[i].id == body;
		if (!member)
			ASSERT_FALSE(dispatch_serves(body, NULL));
	}
	ASSERT_GE(served, 24u);
}

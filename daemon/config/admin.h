/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The operator's side of a running daemon: the settings it runs with (the config file under
 * the flags, settings.h), the live changes (state.h), and how they merge into the node
 * budget and the tenants. For each value, the first that has one wins:
 *
 *   budget:               --budget  >  live  >  config file  >  the pool size
 *   tenant min/max/weight/policy/tier: live  >  config file  >  0 / none / 1 / kvd / drop
 *   tenant allow-users, allow-groups:           config file  >  none
 *
 * (--budget wins at start: a live budget kept from before is then dropped. Set live while
 * running, it applies until the next restart.) Every tenant of the config file and of the
 * live state is in the tenant table from the start, so that status shows it before any of
 * its processes connects; the values of a tenant created by a hello are the defaults.
 *
 * A live change is applied first and saved second: when the state file cannot be written,
 * the change still holds until the daemon stops, the request's reply says so (status 0 with
 * a message; libkvd returns 1), the daemon logs it, and status reports state_error until a
 * later save works.
 *
 * SIGHUP (admin_reload) reads the file again and applies it without dropping anyone: the
 * budget (unless live), the tenants (values that are not live) and the SETTING_RUNTIME
 * limits; a change to another setting is logged as needing a restart and ignored. A file
 * with errors changes nothing: the errors are logged with their file:line.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "settings.h"
#include "state.h"

struct server;
struct server_limits;
struct tenant;

struct admin {
	struct server *srv;
	struct settings cfg;          /* running: defaults < config file < flags */
	const struct settings *flags; /* the command line, put over the file on every reload */
	struct state *state;
	uint8_t budget_source;        /* enum setting_source */
};

/* The server's limits as the settings give them. */
void admin_limits(const struct settings *s, struct server_limits *ret);

/*
 * Takes over *cfg (left empty), loads the live state, creates the tenants, and sets the
 * budget and every tenant's values. flags must outlive the admin. Problems with the state
 * file are logged and its bad entries skipped. Returns 0 or -ENOMEM.
 */
int admin_new(struct server *s, struct settings *cfg, const struct settings *flags,
              struct admin **ret);
struct admin *admin_free(struct admin *a);

/*
 * SIGHUP, or kvdctl reload: reads the config file again and applies what can change while
 * running; by is who asked ("SIGHUP", "kvdctl (pid N, uid U)"), for the log. Counts it in
 * the server (reloads, reload_failures, last_reload_ms, last_reload_error). Returns 0, or
 * -EINVAL (errors in the file: the running settings stay) or -ENOMEM, with the errors in
 * why (the first ones and how many more).
 */
int admin_reload(struct admin *a, const char *by, char *why, size_t why_n);

/*
 * Live changes and their resets. Each returns 0 when applied and saved, 1 when applied but
 * not saved (why says so: it will not survive a restart), or a negative errno with why:
 * -EINVAL (budget above the pool), -ENOENT (reset of an unknown tenant), -EUSERS, -ENOMEM.
 * admin_tenant_set changes only what `change` has set; the caller checked the values.
 */
int admin_budget_set(struct admin *a, uint64_t bytes, char *why, size_t why_n);
int admin_budget_reset(struct admin *a, char *why, size_t why_n);
int admin_tenant_set(struct admin *a, struct tenant *t, const struct state_tenant *change,
                     char *why, size_t why_n);
int admin_tenant_reset(struct admin *a, const char *name, char *why, size_t why_n);
/* Forgets a tenant and its live values (registry_forget_tenant). Returns as above, or -ENOENT
 * (unknown), -EBUSY (it holds something, or the config file declares it). */
int admin_tenant_delete(struct admin *a, const char *name, char *why, size_t why_n);

const char *admin_budget_source(const struct admin *a);
/* Whether the tenant has settings of its own: in the config file, or set live. */
bool admin_tenant_declared(const struct admin *a, const char *name);
/* Why the last save of the live state failed, or NULL when it did not. */
const char *admin_state_error(const struct admin *a);

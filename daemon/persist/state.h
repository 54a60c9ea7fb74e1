/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The live state: what operators changed while the daemon ran (kvdctl budget set, tenant
 * set), kept in STATE_DIR/state so that it survives a restart and wins over the config
 * file until it is reset (kvdctl budget reset, tenant reset). INI, like the config file:
 *
 *   # kvd live settings: ...
 *   [kvd]
 *   budget = 6442450944
 *
 *   [tenant llama]
 *   max = 2147483648
 *   weight = 3
 *
 * Only values set live appear; a [tenant NAME] section without keys keeps a tenant that
 * kvdctl created. Sizes are in bytes ("none": no cap). The daemon writes the file whole,
 * atomically (a temporary file, fsync, rename, fsync of the directory), after each change;
 * it is read once, at start. The table is bounded by max-tenants, the file by
 * STATE_FILE_MAX.
 */

#include <stdbool.h>
#include <stdint.h>

#include "inifile.h"
#include "tenant.h"

#define STATE_FILE_MAX (UINT64_C(4) << 20)
#define STATE_FILE_NAME "state"

struct state_tenant {
	char name[KVD_TENANT_NAME_MAX + 1];
	bool has_min, has_max, has_weight, has_policy, has_tier, has_recall;
	uint64_t min_bytes;
	uint64_t max_bytes;           /* KVD_TENANT_NO_CAP: none */
	uint32_t weight;
	int policy;                   /* enum kvd_policy */
	int tier;                     /* enum tier_mode */
	uint32_t recall;
};

struct state {
	char *dir;
	char *path;                   /* dir/state */
	bool has_budget;
	uint64_t budget;
	struct state_tenant *tenants;
	uint32_t n_tenants, max_tenants;
	char *saved;                  /* the text last written, to skip writing it again */
	char error[256];              /* why the last save failed; "" when it did not */
};

/* Returns 0, or -ENOMEM. Reads nothing yet. */
int state_new(const char *dir, uint32_t max_tenants, struct state **ret);
struct state *state_free(struct state *st);

/*
 * Reads the file; a missing one leaves the state empty. Entries that are not valid are
 * skipped, each with an error in e (the daemon logs them and goes on: the file is its own).
 * Returns 0, or -ENOMEM.
 */
int state_load(struct state *st, struct inifile_errors *e);

struct state_tenant *state_tenant_find(const struct state *st, const char *name);
/* Finds or adds (with nothing set). Returns 0, or -EINVAL (bad name), -EUSERS (max_tenants
 * entries already), -ENOMEM. */
int state_tenant_get(struct state *st, const char *name, struct state_tenant **ret);
/* Forgets a tenant's live values; returns whether there were any. */
bool state_tenant_remove(struct state *st, const char *name);

/* The file's text, malloc'ed. Returns 0 or -ENOMEM. */
int state_format(const struct state *st, char **ret);

/*
 * Writes the file when its text changed since the last good save (creating the directory,
 * one level, when missing). Returns 0, or -errno with st->error saying what failed; the
 * state in memory is unchanged either way.
 */
int state_save(struct state *st);
